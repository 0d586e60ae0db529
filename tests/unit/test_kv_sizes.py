"""The KV cache sizes kept for engines that load together (`mmworker.kv_sizes`), and the sum that
turns a profiled engine's blocks back into the bytes that give them again."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mmworker import hardware, kv_sizes
from mmworker.config import load_config
from mmworker.engine import kv_size_of
from mmworker.hardware import Hardware
from mmworker.kv_sizes import KvSize, SizeBook, size_key
from mmworker.processes import together_size

_WINDOWED = SimpleNamespace(use_sliding_window=True, sliding_window=8)
H100 = Hardware(gpu_name="NVIDIA H100 80GB HBM3", gpu_memory_bytes=80 * 2**30, gpus=1, cores=16)


def test_a_kept_size_is_read_back_and_forgotten(tmp_path: Path) -> None:
    book = SizeBook(tmp_path / "engine-sizes")
    assert book.get("k") is None
    book.put("k", KvSize(blocks=45537, bytes=26_858_619_584))
    assert book.get("k") == KvSize(blocks=45537, bytes=26_858_619_584)
    book.forget("k")
    assert book.get("k") is None
    book.forget("k")  # twice is fine


def test_a_damaged_record_means_profiling_not_a_crash(tmp_path: Path) -> None:
    book = SizeBook(tmp_path)
    (tmp_path / "k.json").write_text("{not json")
    assert book.get("k") is None
    (tmp_path / "k.json").write_text('{"blocks": 0, "bytes": 5}')
    assert book.get("k") is None


def test_the_book_sits_beside_the_feature_cache_not_in_it(tmp_path: Path) -> None:
    """A cold start empties the feature cache; what the engine needs does not change with it."""
    book = kv_sizes.book_for(tmp_path / "features")
    book.put("k", KvSize(1, 2))
    assert (tmp_path / "engine-sizes" / "k.json").exists()


def test_the_key_follows_what_sizes_the_cache_and_nothing_else() -> None:
    kwargs: dict[str, Any] = {"model": "/m", "gpu_memory_utilization": 0.42, "max_num_seqs": 512}
    key = size_key(kwargs, H100)
    unsized = {**kwargs, "kv_cache_memory_bytes": 123, "use_tqdm_on_load": False}
    assert size_key(unsized, H100) == key
    assert size_key({**kwargs, "gpu_memory_utilization": 0.45}, H100) != key
    assert size_key({**kwargs, "max_num_seqs": 256}, H100) != key
    h200 = Hardware(gpu_name="NVIDIA H200", gpu_memory_bytes=141 * 2**30, gpus=1, cores=16)
    assert size_key(kwargs, h200) != key


def _vllm_config(**over: Any) -> SimpleNamespace:
    """The parts of a vLLM config the sum reads, as Qwen2.5-VL-3B has them in bf16."""
    model = SimpleNamespace(
        hf_text_config=SimpleNamespace(use_sliding_window=False, sliding_window=32768),
        is_hybrid=False,
        is_attention_free=False,
        use_mla=False,
        dtype=torch.bfloat16,
        get_num_kv_heads=lambda parallel: 2,
        get_head_size=lambda: 128,
        get_num_layers=lambda parallel: 36,
        multimodal_config=SimpleNamespace(mm_ipc_gpu_memory_gb=0),
    )
    cache = SimpleNamespace(num_gpu_blocks=45537, block_size=16, cache_dtype="auto")
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
    config = SimpleNamespace(model_config=model, cache_config=cache, parallel_config=parallel)
    for path, value in over.items():
        section, name = path.split("__")
        setattr(getattr(config, section), name, value)
    return config


def test_blocks_become_the_bytes_vllm_divides_back_into_them() -> None:
    # vLLM: blocks = bytes // (2 * block_size * kv_heads * head_size * itemsize) // layers
    size = kv_size_of(_vllm_config())
    page = 2 * 16 * 2 * 128 * 2
    assert size == KvSize(blocks=45537, bytes=45537 * page * 36)
    assert size is not None and size.bytes // page // 36 == 45537
    fp8 = kv_size_of(_vllm_config(cache_config__cache_dtype="fp8_e4m3"))
    assert fp8 is not None and fp8.bytes == size.bytes // 2
    reserved = kv_size_of(
        _vllm_config(model_config__multimodal_config=SimpleNamespace(mm_ipc_gpu_memory_gb=1))
    )
    assert reserved is not None and reserved.bytes == size.bytes + 2**30


@pytest.mark.parametrize(
    "over",
    [
        {"parallel_config__tensor_parallel_size": 2},
        {"model_config__is_hybrid": True},
        {"model_config__use_mla": True},
        {"cache_config__cache_dtype": "int8"},
        {"cache_config__num_gpu_blocks": None},
        {"model_config__hf_text_config": _WINDOWED},
    ],
)
def test_caches_one_page_size_cannot_describe_keep_profiling(over: dict[str, Any]) -> None:
    assert kv_size_of(_vllm_config(**over)) is None


def test_no_config_is_no_size() -> None:
    assert kv_size_of(None) is None


def test_engines_load_one_by_one_until_a_size_is_known(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mmworker import app

    monkeypatch.setattr(hardware, "probe", lambda: H100)
    monkeypatch.setattr(app, "resolve_model", lambda model, cache_dir: "/models/m")
    cfg = load_config(
        processes=2,
        cache={"directory": tmp_path / "features", "encoder_outputs": False},
        engine={"model": "m", "pixels_on_engine": False, "start_together": True},
    )
    assert together_size(cfg) is None  # nothing measured yet
    first = cfg.model_copy(update={"processes": 1})
    from mmworker.processes import child_config

    child = child_config(cfg, 0)
    key = app.kv_size_key(child, app.make_engine(child))
    assert key is not None
    kv_sizes.book_for(cfg.cache.directory).put(key, KvSize(100, 200))
    assert together_size(cfg) == (key, KvSize(100, 200))
    # Each of these loads one by one, size kept or not.
    assert together_size(first) is None
    off = load_config(
        processes=2,
        cache={"directory": tmp_path / "features", "encoder_outputs": False},
        engine={"model": "m", "pixels_on_engine": False, "start_together": False},
    )
    assert together_size(off) is None
    user_sized = load_config(
        processes=2,
        cache={"directory": tmp_path / "features", "encoder_outputs": False},
        engine={
            "model": "m",
            "pixels_on_engine": False,
            "start_together": True,
            "kv_cache_memory_bytes": 2**30,
        },
    )
    assert together_size(user_sized) is None


class _StandIn:
    """A worker process in a thread: waits for its turn, notes the KV bytes it was given, and
    is ready (or dies first, exit code 3)."""

    def __init__(
        self, children: Any, index: int, dies: bool, dies_given: bool = False, stop: bool = False
    ) -> None:
        import threading

        self.name, self.pid, self.exitcode = f"mmworker-{index}", None, None
        self.ready = children.ctx.Event()
        turn = children.ctx.Event()
        children.turns.append(turn)
        children.procs.append(self)
        self.given: int | None = None
        self.waited_alone = False

        def run() -> None:
            turn.wait()
            self.given = int(children.planned.value)
            # One after another: the next turn is set only once this one is ready.
            self.waited_alone = not all(t.is_set() for t in children.turns)
            if stop:  # a SIGTERM to the supervisor while this engine loads
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)
            if dies or (dies_given and self.given):
                self.exitcode = 3
            else:
                self.ready.set()

        threading.Thread(target=run, daemon=True).start()

    def join(self, timeout: float | None = None) -> None:
        return None

    def kill(self) -> None:
        return None


def _run_set(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    dies: bool = False,
    dies_given: bool = False,
    stop: bool = False,
) -> Any:
    from mmworker import app, processes

    monkeypatch.setattr(hardware, "probe", lambda: H100)
    monkeypatch.setattr(app, "resolve_model", lambda model, cache_dir: "/models/m")
    cfg = load_config(
        processes=2,
        limits={"shutdown_grace_s": 1},
        cache={"directory": tmp_path / "features", "encoder_outputs": False},
        engine={"model": "m", "pixels_on_engine": False, "start_together": True},
    )
    made: list[_StandIn] = []

    def spawn(self: Any, index: int, core: Any = None) -> tuple[Any, Any]:
        one = index == 1
        made.append(_StandIn(self, index, dies and one, dies_given and one, stop=stop and one))
        return made[-1], made[-1].ready

    monkeypatch.setattr(processes._Children, "spawn", spawn)
    monkeypatch.setattr(processes._Children, "consume", lambda self, how: 0)
    return processes.run_processes(cfg), made, cfg


def test_a_set_with_a_kept_size_loads_together_and_one_without_loads_in_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mmworker import app
    from mmworker.processes import child_config, together_size

    code, made, cfg = _run_set(tmp_path, monkeypatch)
    assert code == 0
    assert [c.given for c in made] == [0, 0], "no size kept: each profiles"
    assert made[0].waited_alone, "the second engine's turn came after the first was ready"
    # The stand-ins keep nothing (a real child does once its engine is up): keep one.
    child = child_config(cfg, 0)
    key = app.kv_size_key(child, app.make_engine(child))
    assert key is not None
    kv_sizes.book_for(cfg.cache.directory).put(key, KvSize(43039, 25_383_993_344))
    assert together_size(cfg) is not None
    code, made, _ = _run_set(tmp_path, monkeypatch)
    assert code == 0
    assert [c.given for c in made] == [25_383_993_344] * 2
    assert not any(c.waited_alone for c in made), "every turn was set before any engine loaded"


def test_a_set_that_fails_to_load_together_forgets_the_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mmworker import app
    from mmworker.processes import child_config

    _, _, cfg = _run_set(tmp_path, monkeypatch)
    child = child_config(cfg, 0)
    key = app.kv_size_key(child, app.make_engine(child))
    assert key is not None
    book = kv_sizes.book_for(cfg.cache.directory)
    book.put(key, KvSize(43039, 25_383_993_344))
    code, made, _ = _run_set(tmp_path, monkeypatch, dies=True)
    assert code == 3, "a set that fails in turn as well reports the failure"
    assert made[1].given == 25_383_993_344
    assert [c.given for c in made[2:]] == [0, 0], "then a new set loaded in turn, profiling"
    assert book.get(key) is None, "the next start profiles, one engine after another"


def test_a_set_that_fails_together_starts_again_in_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading together is the default: a kept size that no longer fits (another tenant on the
    GPU) must cost a slower start, not the worker's start."""
    from mmworker import app
    from mmworker.processes import child_config

    _, _, cfg = _run_set(tmp_path, monkeypatch)
    child = child_config(cfg, 0)
    key = app.kv_size_key(child, app.make_engine(child))
    assert key is not None
    kv_sizes.book_for(cfg.cache.directory).put(key, KvSize(43039, 25_383_993_344))
    code, made, _ = _run_set(tmp_path, monkeypatch, dies_given=True)
    assert code == 0
    assert len(made) == 4, "the failed set, then a new one"
    assert made[1].exitcode == 3 and made[1].given == 25_383_993_344
    assert [c.given for c in made[2:]] == [0, 0]
    assert made[2].waited_alone, "the new set loads in turn: its first engine's turn came alone"


def test_a_stop_during_a_together_load_starts_no_new_set_and_keeps_the_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while the engines load together (a rolling update): the worker stops without
    waiting out a load, and the size stays, so the next start loads together again."""
    from mmworker import app
    from mmworker.processes import child_config

    _, _, cfg = _run_set(tmp_path, monkeypatch)
    child = child_config(cfg, 0)
    key = app.kv_size_key(child, app.make_engine(child))
    assert key is not None
    book = kv_sizes.book_for(cfg.cache.directory)
    book.put(key, KvSize(43039, 25_383_993_344))
    code, made, _ = _run_set(tmp_path, monkeypatch, dies_given=True, stop=True)
    assert code != 0
    assert len(made) == 2, "no new set after a stop"
    assert book.get(key) == KvSize(43039, 25_383_993_344)


def test_loading_together_is_the_default(tmp_path: Path) -> None:
    cfg = load_config(
        processes=2,
        cache={"directory": tmp_path / "features"},
        engine={"model": "m", "pixels_on_engine": False},
    )
    assert cfg.engine.start_together
