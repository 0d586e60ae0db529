"""Settings left unset that are chosen from the hardware: the fast path without hand-tuning.

Only choices that leave the model's numerics alone are made here (processes per GPU, the compiled
vision encoder, how many jobs a process holds); FP8 changes them and stays the user's switch
(`engine.quantization`). On a host without a GPU every choice is what the worker always did, so
CPU behaviour does not move. Each rule returns its value with the reason, which `mmworker config`
prints, so an operator can see why a machine got what it got.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmworker.errors import ConfigError
from mmworker.hardware import GIB, Hardware

if TYPE_CHECKING:
    from mmworker.config import WorkerConfig

#: vLLM's own line for its larger offline batch (1,024 sequences per step).
LARGE_GPU_BYTES = 70 * GIB
#: Two engines share a GPU from here: each has room for the 3B model's 7.5 GiB of weights and a
#: KV cache far larger than 1,024 jobs need.
TWO_ENGINES_MIN_GPU_BYTES = LARGE_GPU_BYTES
#: GPU memory left outside each engine's `gpu_memory_utilization` share when several share a GPU.
#: vLLM sizes an engine's KV cache from a profile step whose vision-encoder activations fall
#: short of a real 16,384-token step full of images or clips: on an 80 GB H100 two engines at
#: half of 0.92 each went 2-3.5 GiB over their share and one died out of memory (session 20).
#: One engine has vLLM's own 8 % beside it; N engines get this much each instead.
ENGINE_HEADROOM_BYTES = 6 * GIB
#: The least GPU fraction an engine of the default split gets: below it even a small model's
#: weights and a few KV blocks do not fit, and vLLM's own error comes only after the load.
MIN_ENGINE_SHARE = 0.05
#: Two processes each run a vLLM front end, an engine core and half the preprocessing pool.
TWO_PROCESSES_MIN_CORES = 8
#: What a process holds on a large GPU: as many jobs as vLLM schedules in one step there.
LARGE_GPU_IN_FLIGHT = 1024
#: What it holds elsewhere (vLLM's 256 sequences per step on smaller GPUs and on CPU).
DEFAULT_IN_FLIGHT = 256


@dataclass(frozen=True, slots=True)
class Choice:
    value: Any
    reason: str


def processes(hw: Hardware, gpus_per_model: int = 1) -> Choice:
    """Worker processes, each with its own engine on the one GPU. On an H200 one process's vLLM
    front end (a single Python thread rendering every request) left the GPU idle, and two beat
    one by 1.5x on images (bench/HISTORY.md, sessions 9-16). Three were slower than two on an
    H100 (session 31: 115.6 against 117.7-120.0 images/s, 16.07 against 16.50-16.83 videos/s),
    as three plain engines were no faster than two: the GPU is the limit there."""
    if not hw.gpu:
        return Choice(1, "no GPU: one engine, on the CPU")
    if gpus_per_model > 1:
        return Choice(1, f"the model spans {gpus_per_model} GPUs (tensor/pipeline/data parallel)")
    memory = hw.gpu_memory_bytes / GIB
    if hw.gpu_memory_bytes < TWO_ENGINES_MIN_GPU_BYTES:
        return Choice(
            1,
            f"{memory:.0f} GiB GPU: under {TWO_ENGINES_MIN_GPU_BYTES // GIB} GiB a second "
            "engine's share leaves too little KV cache",
        )
    if hw.cores < TWO_PROCESSES_MIN_CORES:
        return Choice(
            1,
            f"{hw.cores} cores: two front ends and their preprocessing would need "
            f"{TWO_PROCESSES_MIN_CORES}",
        )
    return Choice(
        2,
        f"{hw.describe()}: one vLLM front end cannot keep this GPU busy; two "
        "engines share it (half the preprocessing pool each, GPU memory as "
        "engine.gpu_memory_utilization's row says)",
    )


def engine_memory_share(hw: Hardware, utilization: float, engines: int, user_set: bool) -> Choice:
    """`gpu_memory_utilization` of each of `engines` engines on one GPU. A user's own fraction
    (`user_set`) is split evenly, as they asked; the default is lowered first so that every
    engine keeps `ENGINE_HEADROOM_BYTES` beside its share, which on a 141 GB H200 changes
    little (0.457 each instead of 0.46) and on an 80 GB H100 gives 0.42 each instead of 0.46."""
    if engines <= 1:
        return Choice(utilization, "one engine on the GPU: the whole fraction")
    if user_set or not hw.gpu:
        return Choice(utilization / engines, f"set: split evenly over {engines} engines")
    headroom = engines * ENGINE_HEADROOM_BYTES / hw.gpu_memory_bytes
    total = min(utilization, 1.0 - headroom)
    if total / engines < MIN_ENGINE_SHARE:
        # Said here, before any child starts: each engine would otherwise fail its load with
        # vLLM's traceback about a negative or tiny gpu_memory_utilization.
        raise ConfigError(
            f"processes={engines} on a {hw.gpu_memory_bytes / GIB:.0f} GiB GPU leaves each "
            f"engine {max(total, 0.0) / engines:.2f} of it once {ENGINE_HEADROOM_BYTES // GIB} "
            "GiB beside each share are kept free: run fewer processes, or set "
            "engine.gpu_memory_utilization to split the GPU evenly yourself"
        )
    return Choice(
        total / engines,
        f"{hw.gpu_memory_bytes / GIB:.0f} GiB GPU, {engines} engines: {total:.2f} of it split "
        f"evenly, {ENGINE_HEADROOM_BYTES // GIB} GiB beside each share for the vision encoder's "
        "activations that vLLM's profile does not count",
    )


def compile_vision_encoder(hw: Hardware, enforce_eager: bool | None) -> Choice:
    """torch.compile of the vision encoder (vLLM's `compile_mm_encoder`): the language model is
    compiled by vLLM's default already, the encoder is not. It was on for both sides of every
    H200 comparison since session 10; it costs start-up time, less once torch.compile's cache
    on disk holds the model class."""
    if not hw.gpu:
        return Choice(False, "no GPU: the CPU engine runs eagerly")
    if enforce_eager:
        return Choice(False, "engine.enforce_eager: nothing is compiled")
    return Choice(True, f"{hw.describe()}: compiled like the language model")


def max_in_flight(hw: Hardware) -> Choice:
    """Jobs one process holds: fewer than the engine can schedule in one step leaves batch slots
    empty on a large GPU; more only holds memory."""
    if hw.gpu and hw.gpu_memory_bytes >= LARGE_GPU_BYTES:
        return Choice(
            LARGE_GPU_IN_FLIGHT,
            f"{hw.describe()}: vLLM schedules up to "
            f"{LARGE_GPU_IN_FLIGHT} sequences per step on a GPU "
            f"of {LARGE_GPU_BYTES // GIB} GiB or more",
        )
    where = "no GPU" if not hw.gpu else f"{hw.gpu_memory_bytes / GIB:.0f} GiB GPU"
    return Choice(
        DEFAULT_IN_FLIGHT,
        f"{where}: vLLM schedules up to {DEFAULT_IN_FLIGHT} sequences per step here",
    )


def explain(cfg: WorkerConfig, hw: Hardware) -> list[tuple[str, Any, str]]:
    """(setting, value, why) for each hardware-chosen setting of `cfg`: chosen here when left
    unset, the user's own value otherwise."""
    engine = cfg.engine
    rows: list[tuple[str, Any, Choice | None]] = [
        (
            "processes",
            cfg.processes,
            None
            if "processes" in cfg.model_fields_set
            else processes(
                hw,
                gpus_per_model(
                    engine.tensor_parallel_size,
                    engine.pipeline_parallel_size,
                    engine.data_parallel_size,
                ),
            ),
        ),
        (
            "engine.compile_vision_encoder",
            engine.compile_vision_encoder,
            None
            if "compile_vision_encoder" in engine.model_fields_set
            else compile_vision_encoder(hw, engine.enforce_eager),
        ),
        (
            "limits.max_in_flight",
            cfg.limits.max_in_flight,
            None if "max_in_flight" in cfg.limits.model_fields_set else max_in_flight(hw),
        ),
    ]
    if hw.gpu:  # the CPU engine sizes its KV cache otherwise; the row only misled there
        engines = 1 if engine.shared_core else cfg.processes
        user_set = "gpu_memory_utilization" in engine.model_fields_set
        share = engine_memory_share(hw, engine.gpu_memory_utilization, engines, user_set)
        rows.append(
            (
                "engine.gpu_memory_utilization, each engine",
                round(share.value, 3),
                None if user_set else share,
            )
        )
    return [
        (name, value, f"auto: {choice.reason}" if choice is not None else "set")
        for name, value, choice in rows
    ]


def gpus_per_model(tensor: int, pipeline: int, data: int) -> int:
    return tensor * pipeline * data


def idle_gpus(hw: Hardware, used: int) -> str | None:
    """A warning when the engines leave visible GPUs unused: each engine runs on the first
    visible GPU(s), and spreading over the rest is a choice of parallelism (vLLM's) or of
    workers (one per GPU) that changes the memory and process layout, so it stays the user's."""
    if not hw.gpu or hw.gpus <= used:
        return None
    return (
        f"{hw.gpus} GPUs visible and the engines use {used}: set engine.data_parallel_size="
        f"{hw.gpus} (or tensor_parallel_size for a model too large for one GPU), or run one "
        "worker per GPU with CUDA_VISIBLE_DEVICES"
    )
