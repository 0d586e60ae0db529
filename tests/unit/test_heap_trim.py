"""Heap trimming: freed holes in malloc's heaps go back to the system, in every process of the tree.

The memory tests run in a fresh interpreter each, so that what this pytest process has allocated
before cannot hide or fake the holes they make.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor

import pytest

from mmworker import heap_trim, lifeline

#: A fresh process makes ~200 MB of 100 kB blocks (below glibc's 128 KiB mmap threshold, so they
#: come from the heap), touches them, frees every other one and keeps the rest: ~100 MB of holes
#: that no top-of-heap trim can return. Then it waits with or without a trimmer and reports RSS.
HOLES = r"""
import json, os, sys, time
from mmworker import heap_trim

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

blocks = [bytearray(100_000) for _ in range(2000)]
for b in blocks:
    b[::4096] = b"\x01" * len(range(0, len(b), 4096))
del blocks[::2]
before = rss_mib()
trimmer = heap_trim.start() if sys.argv[1] == "trim" else None
if trimmer is None:
    time.sleep(0.5)  # ten periods of the trimming run
else:
    deadline = time.monotonic() + 30
    while trimmer.trims < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
print(json.dumps({"before": before, "after": rss_mib(),
                  "trims": trimmer.trims if trimmer else 0}))
"""


def _holes(mode: str, period: str = "0.05") -> dict[str, float]:
    env = {**os.environ, heap_trim.ENV: period}
    out = subprocess.run(
        [sys.executable, "-c", HOLES, mode],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _not_held() -> Iterator[None]:
    yield
    heap_trim._held.clear()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")
def test_a_trimmer_gives_freed_holes_back_and_without_one_they_stay_resident() -> None:
    kept = _holes("none")
    trimmed = _holes("trim")
    # Control: glibc alone keeps the ~100 MB of holes (what the soak saw grow).
    assert kept["before"] - kept["after"] < 20, kept
    assert trimmed["trims"] >= 1
    assert trimmed["before"] - trimmed["after"] > 60, trimmed


def test_the_trimmer_calls_trim_each_period_and_stops() -> None:
    calls = threading.Semaphore(0)

    def trim() -> bool:
        calls.release()
        return True

    trimmer = _running(trim)
    for _ in range(3):
        assert calls.acquire(timeout=10)
    trimmer.stop()
    assert trimmer.trims >= 3
    assert not trimmer.alive()


def test_a_process_that_keeps_its_heap_is_not_trimmed() -> None:
    calls: list[int] = []

    def trim() -> bool:
        calls.append(1)
        return True

    heap_trim.hold()
    trimmer = _running(trim)
    threading.Event().wait(0.3)  # thirty periods
    trimmer.stop()
    assert calls == []
    assert trimmer.trims == 0


def _running(trim: Callable[[], bool]) -> heap_trim.HeapTrimmer:
    return heap_trim.HeapTrimmer(0.01, trim).start()


@pytest.mark.parametrize(
    ("value", "period"), [(None, heap_trim.DEFAULT_PERIOD_S), ("5", 5.0), ("0", None), ("x", None)]
)
def test_period_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str | None, period: float | None
) -> None:
    if value is None:
        monkeypatch.delenv(heap_trim.ENV, raising=False)
    else:
        monkeypatch.setenv(heap_trim.ENV, value)
    assert heap_trim.period_from_env() == period


def test_a_period_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        heap_trim.HeapTrimmer(0)


def _trim_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == heap_trim.THREAD_NAME]


def test_preprocessing_processes_trim() -> None:
    """The pool's initializer starts the trimmer in each spawned process."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx, initializer=lifeline.pool_child) as pool:
        assert pool.submit(_trim_threads).result(timeout=120) == [heap_trim.THREAD_NAME]


ENGINE_CHILD = r"""
import threading
from mmworker import heap_trim, lifeline
lifeline.install()
print([t.name for t in threading.enumerate() if t.name == heap_trim.THREAD_NAME])
"""


def test_an_engine_process_of_an_armed_worker_trims() -> None:
    """vLLM loads `lifeline.install` as a plugin in its engine core: a child of an armed worker
    trims, a vLLM process of anyone else does not."""
    armed = {**os.environ, lifeline.ENV: str(os.getpid())}
    unarmed = {k: v for k, v in os.environ.items() if k != lifeline.ENV}
    for env, expected in ((armed, "['heap-trim']"), (unarmed, "[]")):
        out = subprocess.run(
            [sys.executable, "-c", ENGINE_CHILD], env=env, capture_output=True, text=True,
            timeout=120, start_new_session=True, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == expected


_COUNT_ARENAS = """
import ctypes, sys, threading
from mmworker import heap_trim
if sys.argv[1] == "limit":
    assert heap_trim.limit_arenas(2)
barrier = threading.Barrier(9)
kept = []
def allocate():
    kept.append([bytearray(4096) for _ in range(64)])  # above pymalloc's 512 B: malloc's
    barrier.wait()
threads = [threading.Thread(target=allocate) for _ in range(8)]
for t in threads:
    t.start()
barrier.wait()
ctypes.CDLL(None).malloc_stats()  # one 'Arena N:' block per arena, on stderr
"""


@pytest.mark.skipif(heap_trim._malloc_trim_fn() is None, reason="glibc only")
@pytest.mark.parametrize(("how", "most"), [("limit", 2), ("none", None)])
def test_limit_arenas_caps_the_arenas_threads_get(how: str, most: int | None) -> None:
    """Eight threads holding memory get an arena each unless capped; capped, they share two."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    done = subprocess.run(
        [sys.executable, "-c", _COUNT_ARENAS, how],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    arenas = done.stderr.count("Arena ")
    if most is None:
        assert arenas >= 5, done.stderr
    else:
        assert 1 <= arenas <= most, done.stderr


def test_a_users_malloc_arena_max_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert heap_trim.limit_arenas(2) is False
