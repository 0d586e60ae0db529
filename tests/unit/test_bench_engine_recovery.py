"""bench/engine_recovery.py's pure parts: which process it kills and which answer it times.

The benchmark gets a few minutes of GPU: a wrong process killed (a compile worker below the
core, the worker itself) or a stale answer timed would waste the run without saying so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.engine_recovery import (  # noqa: E402
    Answer,
    NoEngineCore,
    ProcInfo,
    accounting,
    answer_from,
    engine_cores,
    kill_engine_core,
    log_time,
    next_answer,
)

WORKER = 100


def test_the_core_is_found_by_the_titles_vllm_gives_it() -> None:
    procs = [
        ProcInfo(101, WORKER, "python3 /usr/bin/python3 -c from multiprocessing.spawn import "
                              "spawn_main; spawn_main(tracker_fd=5)"),
        ProcInfo(102, WORKER, "VLLM::EngineCore VLLM::EngineCore"),
        ProcInfo(103, WORKER, "python3 -m multiprocessing.resource_tracker"),
    ]  # fmt: skip
    assert engine_cores(procs, WORKER) == [102]
    for title in ("EngineCore_0 python", "EngineCore_DP0 python", "python VLLM::ENGINECORE"):
        assert engine_cores([ProcInfo(7, WORKER, title)], WORKER) == [7]


def test_children_of_the_core_and_the_worker_itself_are_never_the_core() -> None:
    procs = [
        ProcInfo(WORKER, 1, "python -m mmworker run --set note=EngineCore"),
        ProcInfo(102, WORKER, "VLLM::EngineCore"),
        ProcInfo(104, 102, "VLLM::EngineCore compile_worker"),  # inherits the title
        ProcInfo(105, 104, "VLLM::EngineCore"),
    ]
    assert engine_cores(procs, WORKER) == [102]


def test_no_core_is_an_empty_list_for_the_caller_to_fail_on() -> None:
    assert engine_cores([ProcInfo(101, WORKER, "python spawn_main")], WORKER) == []


def test_a_tree_without_a_core_stops_the_run_and_kills_nothing() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(NoEngineCore, match=str(child.pid)):  # the tree is shown
            kill_engine_core(os.getpid())
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def _answer(job_id: str, received: float, began: float | None, dead: bool = False) -> Answer:
    return Answer(job_id, dead, received, None if began is None else began + 0.5, 0.5)


def test_the_next_answer_is_the_first_of_an_engine_call_begun_after_the_death() -> None:
    death = 1000.0
    answers = [
        _answer("stale", 1000.1, began=999.0),  # finished by the old core, published after
        _answer("dead-letter", 1000.2, began=None, dead=True),
        _answer("late", 1012.0, began=1010.0),
        _answer("new", 1009.0, began=1008.0),
    ]
    got = next_answer(answers, death)
    assert got is not None and got.job_id == "new"
    assert next_answer(answers[:2], death) is None


def test_results_and_dead_letters_are_read_with_their_engine_times() -> None:
    doc = {"job_id": "j", "created_at": "2026-12-05T10:00:10+00:00", "timings": {"engine_s": 2.5}}
    a = answer_from(doc, b"j", False, now=5.0)
    assert a.created is not None and a.engine_began == a.created - 2.5
    assert a.created == 1_796_464_810.0  # 2026-12-05T10:00:10Z
    dead = answer_from({"code": "BAD_MEDIA"}, b"k", True, now=5.0)
    assert (dead.job_id, dead.engine_began) == ("k", None)


def test_every_posted_job_needs_a_record_and_extra_records_are_duplicates() -> None:
    answers = [_answer("a", 1, 0), _answer("a", 2, 1), _answer("b", 3, None, dead=True)]
    assert accounting(["a", "b", "c"], answers) == {
        "posted": 3, "answered": 2, "dead_lettered": 1, "duplicates": 1, "lost": 1,
    }  # fmt: skip


def test_the_worker_log_time_is_read_and_other_formats_are_none() -> None:
    assert log_time("2026-12-05 10:00:10,250") is not None
    assert log_time('{"time":') is None
