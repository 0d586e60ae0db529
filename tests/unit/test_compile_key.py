"""`engine.compile_key`: a warm start of engines sized by `kv_cache_memory_bytes` finds the
torch.compile cache that their first start, sized by `gpu_memory_utilization`, wrote."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

import pytest
import vllm.config.cache

from mmworker.engine import compile_key
from mmworker.lifeline import ENV


def every_field_hash() -> type:
    """A CacheConfig as vLLM 0.25 hashes it: every field but a few runtime knobs, and
    `kv_cache_memory_bytes` not among them (checked against the 0.25.1 wheel's own class)."""

    @dataclass
    class CacheConfig:
        block_size: int = 16
        gpu_memory_utilization: float = 0.9
        cache_dtype: str = "auto"
        kv_cache_memory_bytes: int | None = None

        def compute_hash(self) -> str:
            factors = [(f.name, getattr(self, f.name)) for f in fields(self)
                       if f.name != "gpu_memory_utilization"]  # fmt: skip
            return hashlib.sha256(repr(factors).encode()).hexdigest()

    return CacheConfig


def test_sized_and_unsized_engines_share_one_compile_key() -> None:
    config_class = every_field_hash()
    first_start = config_class(gpu_memory_utilization=0.46)
    together = config_class(kv_cache_memory_bytes=25_383_000_000)
    assert compile_key.keyed_on_kv_size(config_class)
    assert first_start.compute_hash() != together.compute_hash()  # the cache missed

    assert compile_key.ignore_kv_size(config_class)

    assert not compile_key.keyed_on_kv_size(config_class)
    assert first_start.compute_hash() == together.compute_hash()
    assert together.kv_cache_memory_bytes == 25_383_000_000  # set back after hashing
    # What does shape the graphs still keys the cache.
    assert config_class(cache_dtype="fp8").compute_hash() != first_start.compute_hash()
    assert not compile_key.ignore_kv_size(config_class)  # once only


def test_a_vllm_that_leaves_the_size_out_is_not_touched() -> None:
    """The installed vLLM (0.32) already leaves the size out of its key."""
    config_class = vllm.config.cache.CacheConfig
    before = config_class.compute_hash
    assert not compile_key.keyed_on_kv_size(config_class)
    assert not compile_key.ignore_kv_size(config_class)
    assert config_class.compute_hash is before


@pytest.mark.parametrize("in_worker", [True, False])
def test_the_plugin_acts_only_in_a_workers_processes(
    monkeypatch: pytest.MonkeyPatch, in_worker: bool
) -> None:
    config_class = every_field_hash()
    monkeypatch.setattr(vllm.config.cache, "CacheConfig", config_class)
    if in_worker:
        monkeypatch.setenv(ENV, "1")
    else:
        monkeypatch.delenv(ENV, raising=False)
    compile_key.install()
    assert compile_key.keyed_on_kv_size(config_class) is not in_worker


def test_vllm_finds_the_plugin_in_every_process_it_starts() -> None:
    from importlib.metadata import entry_points

    plugins = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "mmworker.engine.compile_key:install" in plugins
