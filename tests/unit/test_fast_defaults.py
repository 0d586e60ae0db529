"""The settings chosen from the hardware when left unset, on plain values of a few real machines."""

from __future__ import annotations

import pytest

from mmworker import fast_defaults, hardware
from mmworker.errors import ConfigError
from mmworker.hardware import GIB, Hardware

CPU = Hardware(gpu_name=None, gpu_memory_bytes=0, gpus=0, cores=2)
# Total memory as NVML reports it on the lent machines (nvidia-smi's memory.total).
H200 = Hardware(gpu_name="NVIDIA H200", gpu_memory_bytes=143771 * 1024**2, gpus=1, cores=16)
H100 = Hardware(
    gpu_name="NVIDIA H100 80GB HBM3", gpu_memory_bytes=81559 * 1024**2, gpus=1, cores=16
)
A100_40 = Hardware(gpu_name="NVIDIA A100-SXM4-40GB", gpu_memory_bytes=40 * GIB, gpus=1, cores=32)
L4 = Hardware(gpu_name="NVIDIA L4", gpu_memory_bytes=23 * GIB, gpus=1, cores=8)


def test_a_host_without_gpu_keeps_what_the_worker_always_did() -> None:
    assert fast_defaults.processes(CPU).value == 1
    assert fast_defaults.compile_vision_encoder(CPU, None).value is False
    assert fast_defaults.max_in_flight(CPU).value == 256


def test_an_h200_gets_two_engines_the_compiled_encoder_and_a_full_batch() -> None:
    chosen = fast_defaults.processes(H200)
    assert chosen.value == 2
    assert "NVIDIA H200" in chosen.reason
    assert fast_defaults.compile_vision_encoder(H200, None).value is True
    assert fast_defaults.max_in_flight(H200).value == 1024


def test_an_80_gb_h100_gets_two_engines_with_room_beside_each() -> None:
    """Two engines at half of 0.92 each ran out of memory on an H100 (session 20): each went
    2-3.5 GiB over its share. By default each now keeps 6 GiB beside its share."""
    assert fast_defaults.processes(H100).value == 2
    assert fast_defaults.compile_vision_encoder(H100, None).value is True
    assert fast_defaults.max_in_flight(H100).value == 1024
    share = fast_defaults.engine_memory_share(H100, 0.92, 2, user_set=False)
    assert share.value == pytest.approx(0.4247, abs=1e-3)
    left = H100.gpu_memory_bytes * (1 - 2 * share.value)
    assert left >= 2 * fast_defaults.ENGINE_HEADROOM_BYTES * 0.999
    assert "2 engines" in share.reason and "6 GiB beside each" in share.reason


def test_a_users_fraction_is_split_evenly_and_one_engine_keeps_it_whole() -> None:
    assert fast_defaults.engine_memory_share(H100, 0.92, 2, user_set=True).value == 0.46
    assert fast_defaults.engine_memory_share(H100, 0.92, 1, user_set=False).value == 0.92
    assert fast_defaults.engine_memory_share(CPU, 0.9, 2, user_set=False).value == 0.45
    # On a 141 GB H200 the default barely moves: vLLM's 8 % already leaves 11 GiB.
    h200 = fast_defaults.engine_memory_share(H200, 0.92, 2, user_set=False).value
    assert 0.455 < h200 <= 0.46


def test_more_engines_than_the_default_split_leaves_room_for_are_refused_before_any_load() -> None:
    """processes = 4 on an L4 left each engine a negative fraction, which vLLM refused only
    after each child had loaded its model, with a traceback."""
    with pytest.raises(ConfigError, match=r"processes=4 on a 23 GiB GPU.*run fewer processes"):
        fast_defaults.engine_memory_share(L4, 0.92, 4, user_set=False)
    assert fast_defaults.engine_memory_share(L4, 0.92, 2, user_set=False).value > 0.2


@pytest.mark.parametrize("hw", [A100_40, L4])
def test_a_smaller_gpu_runs_one_engine_with_vllms_smaller_batch(hw: Hardware) -> None:
    chosen = fast_defaults.processes(hw)
    assert chosen.value == 1
    assert "GiB" in chosen.reason
    assert fast_defaults.compile_vision_encoder(hw, None).value is True  # numerics unchanged
    assert fast_defaults.max_in_flight(hw).value == 256


def test_few_cores_or_a_model_over_several_gpus_keep_one_process() -> None:
    few = Hardware(gpu_name="NVIDIA H200", gpu_memory_bytes=140 * GIB, gpus=1, cores=4)
    assert fast_defaults.processes(few) == fast_defaults.Choice(
        1, "4 cores: two front ends and their preprocessing would need 8"
    )
    assert fast_defaults.processes(H200, gpus_per_model=2).value == 1


def test_enforce_eager_compiles_nothing() -> None:
    chosen = fast_defaults.compile_vision_encoder(H200, True)
    assert chosen.value is False
    assert "enforce_eager" in chosen.reason


@pytest.mark.parametrize(
    ("cpu_max", "want"),
    [("max 100000", None), ("400000 100000", 4), ("150000 100000", 2), ("", None), ("x y", None)],
)
def test_a_cgroup_quota_is_read_in_whole_cpus(cpu_max: str, want: int | None) -> None:
    assert hardware.cgroup_cpu_quota(cpu_max) == want


@pytest.mark.parametrize(
    ("env", "want"),
    [(None, 0), ("", None), ("-1", None), ("3,1", 3), ("GPU-8f1c", "GPU-8f1c")],
)
def test_the_gpu_the_engine_uses_follows_cuda_visible_devices(
    env: str | None, want: int | str | None
) -> None:
    assert hardware.visible_index(env) == want


def test_cuda_visible_devices_can_hide_every_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    hardware.probe.cache_clear()
    try:
        found = hardware.probe()
    finally:
        hardware.probe.cache_clear()
    assert found.gpu_name is None and found.gpus == 0 and found.cores >= 1


def test_the_compiled_encoder_reaches_the_engine_only_on_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CPU build of vLLM the setting is inert (the CPU engine runs eagerly); on a GPU it
    becomes vLLM's compilation_config, merged with one given through engine.extra."""
    import mmworker.engine as engine_module
    from mmworker.config import EngineConfig
    from mmworker.engine import Engine

    on = EngineConfig(compile_vision_encoder=True)
    # The model "m" is no model: the raw-pixels class's config lookup would go to the Hub (minutes
    # of retries on a host without network and without HF_HUB_OFFLINE) and fall back anyway.
    monkeypatch.setattr(engine_module.pixels, "overrides", lambda *_args: None)
    monkeypatch.setattr(engine_module, "_cpu_only", lambda: True)
    assert "compilation_config" not in Engine(on, "m").engine_kwargs()
    monkeypatch.setattr(engine_module, "_cpu_only", lambda: False)
    assert Engine(on, "m").engine_kwargs()["compilation_config"] == {"compile_mm_encoder": True}
    off = EngineConfig(compile_vision_encoder=False)
    assert "compilation_config" not in Engine(off, "m").engine_kwargs()
    eager = EngineConfig(compile_vision_encoder=True, enforce_eager=True)
    assert "compilation_config" not in Engine(eager, "m").engine_kwargs()
    extra = EngineConfig(
        compile_vision_encoder=True,
        extra={"compilation_config": {"cudagraph_mode": "PIECEWISE", "compile_mm_encoder": False}},
    )
    assert Engine(extra, "m").engine_kwargs()["compilation_config"] == {
        "compile_mm_encoder": False,  # the user's own key wins
        "cudagraph_mode": "PIECEWISE",
    }
    level = EngineConfig(compile_vision_encoder=True, extra={"compilation_config": 3})
    assert Engine(level, "m").engine_kwargs()["compilation_config"] == 3


def test_gpus_the_engines_leave_unused_are_named_with_the_settings_that_use_them() -> None:
    """One engine (or two sharing the first GPU) on an 8-GPU node used one GPU of eight, with
    nothing said."""
    node = Hardware(gpu_name="NVIDIA H100 80GB HBM3", gpu_memory_bytes=80 * GIB, gpus=8, cores=96)
    warning = fast_defaults.idle_gpus(node, 1)
    assert warning is not None and "8 GPUs visible" in warning
    assert "engine.data_parallel_size=8" in warning and "CUDA_VISIBLE_DEVICES" in warning
    assert fast_defaults.idle_gpus(node, 8) is None
    assert fast_defaults.idle_gpus(H100, 1) is None
    assert fast_defaults.idle_gpus(CPU, 1) is None


def test_mmworker_config_explains_the_gpu_memory_share_only_on_a_gpu() -> None:
    """On a CPU host the row read "one engine on the GPU: the whole fraction" of a setting the
    CPU engine does not use."""
    from mmworker.config import WorkerConfig

    cfg = WorkerConfig(engine={"model": "m"})  # type: ignore[arg-type]
    on_cpu = [name for name, _, _ in fast_defaults.explain(cfg, CPU)]
    on_h100 = [name for name, _, _ in fast_defaults.explain(cfg, H100)]
    assert "engine.gpu_memory_utilization, each engine" not in on_cpu
    assert on_h100 == [*on_cpu, "engine.gpu_memory_utilization, each engine"]
