"""How vLLM's engine core is started on a GPU host: forked the first time (no re-import of vLLM
and torch, ~16 s per start on an H100), spawned when it is replaced after a death (the worker
then holds broker sockets and threads), and never against the user's own choice."""

from __future__ import annotations

import pytest

from mmworker import engine

VAR = engine.START_METHOD_VAR


@pytest.fixture
def gpu_host(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(engine, "_cpu_only", lambda: False)
    monkeypatch.setattr(engine, "_USERS_START_METHOD", [])
    return monkeypatch


def test_the_first_core_forks_and_a_replacement_spawns(gpu_host: pytest.MonkeyPatch) -> None:
    gpu_host.delenv(VAR, raising=False)
    engine.engine_process_env(first_start=True)
    assert engine.os.environ[VAR] == "fork"
    engine.engine_process_env(first_start=False)  # Engine.restart
    assert engine.os.environ[VAR] == "spawn"
    engine.engine_process_env(first_start=True)  # e.g. a test building a second Engine
    assert engine.os.environ[VAR] == "fork"


@pytest.mark.parametrize("users", ["spawn", "fork"])
def test_a_method_the_user_exported_is_kept_for_every_start(
    gpu_host: pytest.MonkeyPatch, users: str
) -> None:
    gpu_host.setenv(VAR, users)
    for first in (True, False, True):
        engine.engine_process_env(first_start=first)
        assert engine.os.environ[VAR] == users


def test_a_shared_core_supervisor_keeps_spawning(gpu_host: pytest.MonkeyPatch) -> None:
    """`processes._run_shared` starts the core from the supervisor with the default argument."""
    gpu_host.delenv(VAR, raising=False)
    engine.engine_process_env()
    assert engine.os.environ[VAR] == "spawn"


def test_cpu_hosts_are_left_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "_cpu_only", lambda: True)
    monkeypatch.setattr(engine, "_USERS_START_METHOD", [])
    monkeypatch.delenv(VAR, raising=False)
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "MALLOC_MMAP_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    engine.engine_process_env(first_start=True)
    assert VAR not in engine.os.environ
