"""The pieces every raw-engine peer shares: configuration, decoded inputs, prompts, warm-up, clock.

Why one module: `bench/e2e.py`'s single engine and `bench/peers/raw_engines.py`'s N engines are
compared with each other and with the worker; a prompt, a resize or an engine argument built two
ways would make them measure different work. Importing it must stay cheap (no vLLM at module
level): the N-engine peer's spawned children import it before they decide how vLLM starts.
"""

from __future__ import annotations

import hashlib
import io
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import mean


def load_worker_config(worker_args: list[str]) -> Any:
    """The worker's settings parsed from its own command line, exactly as `mmworker run` would:
    the peers' engines and preprocessing then follow every `--set` the worker got."""
    from mmworker.cli import build_parser as mm_parser
    from mmworker.cli import overrides_from
    from mmworker.config import load_config

    ns = mm_parser().parse_args(worker_args)
    return load_config(ns.config, **overrides_from(ns))


def engine_kwargs(cfg: Any, model_path: str, share: int = 1) -> dict[str, Any]:
    """`LLM(**kwargs)` as the worker builds its engine; `share` engines split the GPU memory the
    way the worker's `processes` do, everything else (the CPU KV budget included) unchanged.
    Plain vLLM: the worker's own model class for raw pixels (`engine.pixels_on_engine`) is not
    something a user of vLLM alone has, so the peers run vLLM's processor path."""
    from mmworker import fast_defaults, hardware
    from mmworker.engine import Engine

    update: dict[str, Any] = {"pixels_on_engine": False}
    if share > 1:
        update["gpu_memory_utilization"] = fast_defaults.engine_memory_share(
            hardware.probe(),
            cfg.engine.gpu_memory_utilization,
            share,
            user_set="gpu_memory_utilization" in cfg.engine.model_fields_set,
        ).value
    return Engine(cfg.engine.model_copy(update=update), model_path).engine_kwargs()


def sampling_params(max_tokens: int, ignore_eos: bool) -> Any:
    """Greedy and, by default, exactly `max_tokens` tokens: every peer does the same decode work."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)


def scheduler_facts(llm: Any) -> dict[str, Any]:
    """The batch limits vLLM chose (they depend on the usage context, not only on the args) and
    the KV blocks it found room for: engines sharing a GPU can size each other's cache."""
    config = getattr(llm.llm_engine, "vllm_config", None)
    sched = getattr(config, "scheduler_config", None)
    facts = {k: getattr(sched, k, None) for k in ("max_num_seqs", "max_num_batched_tokens")}
    facts["num_gpu_blocks"] = getattr(getattr(config, "cache_config", None), "num_gpu_blocks", None)
    return facts


def shutdown(llm: Any) -> None:
    """Stop the engine core now rather than at interpreter exit, so the GPU is free when the
    process's parent starts the next engine."""
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()


# ---------------------------------------------------------------------------------------------
# Inputs


def _prepare_one(args: tuple[str, Any, Any]) -> Any:
    from mmworker_preprocess.prepare import prepare_media

    path, image_params, video_params = args
    data = Path(path).read_bytes()
    t0 = time.perf_counter()
    prepared = prepare_media(data, image_params, video_params)
    return hashlib.sha256(data).hexdigest(), prepared, time.perf_counter() - t0


def prepare_all(
    cfg: Any, images: list[Path], videos: list[Path]
) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """Decode and resize every input once, outside any timed region, exactly as the worker does.

    Also returns the mean decode+resize seconds per item on one core: with the raw engine's
    jobs/s it says how many preprocess processes the worker needs to keep the engine fed.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    image_params = cfg.preprocess.image_params(None, None)
    video_params = cfg.preprocess.video_params(None, None, None, None, None)
    t0 = time.perf_counter()
    workers = max(1, os.cpu_count() or 1)
    # spawn, and before the engine exists: no CUDA state may be forked.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        out = {
            "image": list(
                pool.map(
                    _prepare_one,
                    [(str(p), image_params, video_params) for p in images],
                    chunksize=16,
                )
            ),
            "video": list(
                pool.map(_prepare_one, [(str(p), image_params, video_params) for p in videos])
            ),
        }
    wall = time.perf_counter() - t0
    facts = {
        "prepare_wall_s": round(wall, 2),
        "prepare_processes": workers,
        "prepare_ms_per_item_one_core": {
            kind: round(1000 * (mean(t for _, _, t in items) or 0.0), 2)
            for kind, items in out.items()
        },
    }
    print(
        f"prepared {len(images)} images + {len(videos)} videos in {wall:.1f}s (not timed): "
        f"{facts['prepare_ms_per_item_one_core']} ms per item on one core",
        flush=True,
    )
    return {k: [(sha, item) for sha, item, _ in v] for k, v in out.items()}, facts


def prompts(
    tokenizer: Any, prepared: dict[str, list[Any]], kind: str, suffix: str | None
) -> list[dict[str, Any]]:
    """One `LLM.generate` prompt per prepared item, with the worker's chat template.

    `suffix` None sends no uuid (vLLM hashes the pixels); otherwise the content hash plus the
    suffix, so a new suffix makes every item new to vLLM's processor and prefix caches — a cold
    engine without starting another.
    """
    from mmworker_schemas import DEFAULT_PROMPTS

    from mmworker.engine import EngineItem, _mm_data, chat_prompt

    text = chat_prompt(tokenizer, DEFAULT_PROMPTS[kind], (kind,))
    out = []
    for sha, item in prepared[kind]:
        p: dict[str, Any] = {
            "prompt": text,
            "multi_modal_data": _mm_data([EngineItem(item, sha)], raw_pixels=False),
        }
        if suffix is not None:
            p["multi_modal_uuids"] = {kind: [sha + suffix]}
        out.append(p)
    return out


def warm_up(llm: Any, tokenizer: Any, sampling: Any, prepared: dict[str, list[Any]]) -> bool:
    """One request of each kind outside the timing (first-batch allocations, lazy kernels), under
    uuids no timed run uses, so nothing of it can be served from vLLM's caches later.

    It also tries the progress hook; returns whether it works. Should this vLLM's hook differ,
    timed runs go without latencies (the failure is harmless: the second call drains whatever
    the first one queued).
    """
    warm = [
        p
        for kind in ("image", "video")
        for p in prompts(tokenizer, {kind: prepared[kind][:1]}, kind, "#warmup")
    ]
    if not warm:
        return True
    try:
        llm.generate(warm, sampling, use_tqdm=FinishClock().factory)
    except (TypeError, AttributeError) as exc:
        print(f"progress hook unsupported ({exc}): raw latencies will be missing", flush=True)
        llm.generate(warm, sampling, use_tqdm=False)
        return False
    return True


class FinishClock:
    """A `use_tqdm` factory for `LLM.generate` that records when each request finishes.

    vLLM calls `pbar.update(n)` as requests finish; a silent tqdm subclass timestamps those calls
    so a raw peer gets per-request completion times without touching vLLM internals. `clock`
    must be the one the caller takes its start time from (`time.monotonic` when processes
    compare their times: it is one system-wide clock).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        from tqdm import tqdm

        owner = self
        self.bars: list[Any] = []

        class Bar(tqdm):  # type: ignore[misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs.update(file=io.StringIO(), mininterval=3600.0, dynamic_ncols=False)
                super().__init__(*args, **kwargs)
                self.stamps: list[float] = []
                owner.bars.append(self)

            def update(self, n: float | None = 1) -> bool | None:
                self.stamps.extend([clock()] * int(n or 0))
                return super().update(n)  # type: ignore[no-any-return]

        self.factory = Bar

    def finish_times(self) -> list[float]:
        running = [b for b in self.bars if str(b.desc).startswith("Processed")] or self.bars[-1:]
        return [t for b in running for t in b.stamps]
