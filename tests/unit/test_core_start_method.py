"""How vLLM's engine core is started on a GPU host: forked the first time (no re-import of vLLM
and torch, ~16 s per start on an H100), spawned when it is replaced after a death (the worker
then holds broker sockets and threads), and never against the user's own choice."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from mmworker import engine, lifeline
from mmworker.config import EngineConfig

VAR = engine.START_METHOD_VAR


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """engine_process_env writes os.environ (also variables that were unset, which monkeypatch
    would not restore): later tests must not inherit a "fork" as if the user had chosen it."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def gpu_host(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(engine, "_cpu_only", lambda: False)
    monkeypatch.setattr(engine, "_USERS_START_METHOD", [])
    monkeypatch.setattr(engine, "_CORES_STARTED", {"count": 0})
    monkeypatch.delenv(VAR, raising=False)
    return monkeypatch


def test_the_first_core_forks_and_a_replacement_spawns(gpu_host: pytest.MonkeyPatch) -> None:
    engine.engine_process_env(first_start=True)
    assert os.environ[VAR] == "fork"
    assert os.environ[lifeline.CORE_FORKED_ENV] == "1", "the core's own children must spawn"
    engine.engine_process_env(first_start=False)  # Engine.restart
    assert os.environ[VAR] == "spawn"
    assert lifeline.CORE_FORKED_ENV not in os.environ


@pytest.mark.parametrize("users", ["spawn", "fork"])
def test_a_method_the_user_exported_is_kept_for_every_start(
    gpu_host: pytest.MonkeyPatch, users: str
) -> None:
    gpu_host.setenv(VAR, users)
    for first in (True, False, True):
        engine.engine_process_env(first_start=first)
        assert os.environ[VAR] == users
        assert lifeline.CORE_FORKED_ENV not in os.environ  # the user's fork reaches the workers


def test_a_shared_core_supervisor_keeps_spawning(gpu_host: pytest.MonkeyPatch) -> None:
    """`processes._run_shared` starts the core from the supervisor with the default argument."""
    engine.engine_process_env()
    assert os.environ[VAR] == "spawn"


def test_cpu_hosts_are_left_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "_cpu_only", lambda: True)
    monkeypatch.setattr(engine, "_USERS_START_METHOD", [])
    monkeypatch.delenv(VAR, raising=False)
    engine.engine_process_env(first_start=True)
    assert VAR not in os.environ


def test_an_engine_forks_its_first_core_and_spawns_its_replacement(
    gpu_host: pytest.MonkeyPatch,
) -> None:
    """The wiring: what vLLM reads when `Engine.start`, then `Engine.restart`, build the core;
    a second Engine in the same process (its sockets and threads are there by then) spawns too."""
    seen: list[str] = []

    class StandInLLM:
        model_config = SimpleNamespace(
            hf_config=SimpleNamespace(architectures=["Other"]), get_vocab_size=lambda: 32
        )

        @classmethod
        def from_engine_args(cls, _args: Any, **_kwargs: Any) -> StandInLLM:
            seen.append(os.environ[VAR])
            return cls()

        def shutdown(self) -> None:
            pass

    gpu_host.setattr("vllm.v1.engine.async_llm.AsyncLLM", StandInLLM)
    gpu_host.setattr("vllm.engine.arg_utils.AsyncEngineArgs", SimpleNamespace)  # no model "m"
    gpu_host.setattr("transformers.AutoTokenizer.from_pretrained", lambda *_a, **_k: object())
    gpu_host.setattr(engine.frontend, "keep_heap", lambda: True)  # no mallopt in pytest itself
    gpu_host.setattr(engine, "_reap", lambda *_a: None)
    gpu_host.setattr(engine, "_wait_gpu_released", lambda *_a: None)
    first = engine.Engine(EngineConfig(pixels_on_engine=False), "m")
    first.start()
    first.restart()
    engine.Engine(EngineConfig(pixels_on_engine=False), "m").start()
    assert seen == ["fork", "spawn", "spawn"]
