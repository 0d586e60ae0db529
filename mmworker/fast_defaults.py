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

from mmworker.hardware import GIB, Hardware

if TYPE_CHECKING:
    from mmworker.config import WorkerConfig

#: Two engines on one GPU each get half of it. On an 80 GB H100 two engines at 0.46 each ran out
#: of GPU memory in a 16,384-token prefill step (worker and plain-vLLM peer alike, session 20:
#: the vision encoder's activations are not all inside vLLM's budget); on the 141 GB H200 they
#: ran in every session since 9.
TWO_ENGINES_MIN_GPU_BYTES = 100 * GIB
#: vLLM's own line for its larger offline batch (1,024 sequences per step).
LARGE_GPU_BYTES = 70 * GIB
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
    one by 1.5x on images (bench/HISTORY.md, sessions 9-16); more than two was not measured."""
    if not hw.gpu:
        return Choice(1, "no GPU: one engine, on the CPU")
    if gpus_per_model > 1:
        return Choice(1, f"the model spans {gpus_per_model} GPUs (tensor/pipeline/data parallel)")
    memory = hw.gpu_memory_bytes / GIB
    if hw.gpu_memory_bytes < TWO_ENGINES_MIN_GPU_BYTES:
        return Choice(
            1,
            f"{memory:.0f} GiB GPU: under {TWO_ENGINES_MIN_GPU_BYTES // GIB} GiB two engines do "
            "not fit (on an 80 GB H100 two at half the memory each ran out of it)",
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
        "engines share it (half the GPU memory and preprocessing pool each)",
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
    return [
        (name, value, f"auto: {choice.reason}" if choice is not None else "set")
        for name, value, choice in rows
    ]


def gpus_per_model(tensor: int, pipeline: int, data: int) -> int:
    return tensor * pipeline * data
