"""The raw ×N engines peer loads its engines one after another, minutes each on a GPU. An engine
that already loaded and then dies must stop the run while the next one loads, not minutes later
at the next barrier; these stand-in engines (plain processes speaking the same pipe protocol)
die or answer at chosen moments."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers.raw_engines import _collect, _Engine

CTX = multiprocessing.get_context("fork")


def _idle(link: Connection) -> None:
    time.sleep(60)


def _die_soon(link: Connection) -> None:
    time.sleep(0.5)
    os._exit(7)


def _load_after(link: Connection, delay_s: float) -> None:
    time.sleep(delay_s)
    link.send(("loaded", {"index": 1}))
    time.sleep(60)


@pytest.fixture
def engines() -> Iterator[list[_Engine]]:
    started: list[_Engine] = []
    yield started
    for e in started:
        e.proc.kill()
        e.proc.join()
        e.link.close()


def _start(
    engines: list[_Engine], index: int, target: Callable[..., None], *args: object
) -> _Engine:
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=target, args=(child, *args))
    proc.start()
    child.close()
    engines.append(_Engine(index, proc, parent))
    return engines[-1]


def test_a_loaded_engine_that_dies_stops_the_next_load_at_once(engines: list[_Engine]) -> None:
    earlier = _start(engines, 0, _die_soon)
    loading = _start(engines, 1, _idle)  # never answers: only the watch can end the wait
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"raw engine 0 exited \(7\) while waiting for 'loaded'"):
        _collect([loading], "loaded", time.monotonic() + 60.0, watch=[earlier])
    assert time.monotonic() - t0 < 10.0  # not the 60 s deadline


def test_a_live_loaded_engine_does_not_disturb_the_next_load(engines: list[_Engine]) -> None:
    earlier = _start(engines, 0, _idle)
    loading = _start(engines, 1, _load_after, 1.0)
    got = _collect([loading], "loaded", time.monotonic() + 30.0, watch=[earlier])
    assert got == [{"index": 1}]
    assert earlier.proc.is_alive()


def test_without_the_watch_the_same_death_goes_unseen_until_the_deadline(
    engines: list[_Engine],
) -> None:
    _start(engines, 0, _die_soon)
    loading = _start(engines, 1, _idle)
    with pytest.raises(TimeoutError, match=r"raw engines \[1\]: no 'loaded'"):
        _collect([loading], "loaded", time.monotonic() + 1.5)
