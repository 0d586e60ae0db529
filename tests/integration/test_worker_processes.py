"""`processes = 2`: two real workers (two engines) under one supervisor, one consumer group."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from mmworker_schemas import GenerationParams, Job, MediaRef

from mmworker.devkit.broker import EmbeddedBroker, free_port
from mmworker.devkit.samples import sample_image
from tests.integration.workerkit import (
    Collector,
    Posted,
    WorkerProcess,
    describe,
    is_engine_core,
    make_topics,
    metric_sum,
    post,
    process_tree,
    still_alive,
    wait_committed,
)

pytestmark = pytest.mark.integration


def _entries(store: Path) -> dict[str, float]:
    return {f.parent.name: f.stat().st_mtime for f in store.glob("*/*/encoder_cache.safetensors")}


def test_two_processes_share_the_partitions_and_drain_on_sigterm(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    topics = make_topics(broker.bootstrap, "procs")
    group = f"procs-{uuid.uuid4().hex[:6]}"
    port = free_port()
    posted = Posted()
    jobs = []
    for i in range(30):
        job = Job(
            job_id=f"p-{i}",
            media=[MediaRef(data=sample_image(seed=i))],
            generation=GenerationParams(max_tokens=8),
        )
        jobs.append((job.job_id, job.model_dump_json().encode()))
    post(broker.bootstrap, topics["input"], jobs, posted)
    assert len({p for p, _ in posted.where.values()}) == 3  # every partition has work
    collector = Collector(broker.bootstrap, [topics["output"], topics["dlq"]])
    extra = {"processes": 2, "metrics_port": port, "worker_id": "duo"}
    fresh = {"VLLM_CACHE_ROOT": str(tmp_path / "vllm")}  # the model class looked at: not kept
    with WorkerProcess(broker.bootstrap, tmp_path, topics, group, extra, fresh) as worker:
        ids = {key for key, _ in jobs}
        collector.wait_for(ids, 300, worker)
        answered_by = set()
        for job_id in ids:
            topic, doc = collector.one(job_id)  # exactly one record per job
            assert topic == topics["output"], doc
            answered_by.add(doc["worker_id"])
        # Three partitions over two members: both hold at least one, so both answered.
        assert answered_by == {"duo-0", "duo-1"}, worker.log()
        # Both processes start together; on CPU (no KV size kept) their engines load one after
        # another: the second was waiting (imports done) before the first engine was ready, and
        # loaded only after it.
        lines = worker.log().splitlines()

        def first(tag: str, text: str) -> int:
            return next(i for i, line in enumerate(lines) if f"[{tag}]" in line and text in line)

        first_ready = first("duo-0", "engine ready in")
        assert first("duo-1", "waiting for the turn to load the engine") < first_ready
        # The supervisor had vLLM's look at the model class taken beside the children's imports
        # (before the first turn), so no engine started that look of its own.
        looked = next(i for i, ln in enumerate(lines) if "look at the model class taken" in ln)
        assert looked < first("duo-0", "loading the model now"), worker.log()
        assert list((tmp_path / "vllm" / "modelinfos").glob("*.json"))
        assert first("duo-1", "loading the model now that the engine before") > first_ready
        # Each child serves its own metrics on port + 1 + index; together they count every job,
        # and the supervisor's port carries both (labelled) and answers the probes for both.
        per_child = [metric_sum(port + 1 + i, "mmworker_jobs_total") for i in (0, 1)]
        assert all(n > 0 for n in per_child) and sum(per_child) == len(ids), per_child
        assert metric_sum(port, "mmworker_jobs_total") == len(ids)
        for probe in ("/startupz", "/readyz", "/livez"):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{probe}", timeout=10) as reply:
                body = json.loads(reply.read())
            assert set(body["checks"]["processes"]) == {"0", "1"}, (probe, body)

        # The encoder store is shared: repeats of one image on every partition reach the process
        # that never encoded it, which loads the output from disk (a hit refreshes the mtime)
        # instead of storing a second entry.
        store = tmp_path / "features" / "encoder"
        before = _entries(store)
        assert len(before) == len(ids), "one stored encoder output per distinct image"
        time.sleep(1.1)  # mtime resolution
        repeats = [(f"again-{i}", jobs[0][1].replace(b'"p-0"', f'"again-{i}"'.encode()))
                   for i in range(9)]  # fmt: skip
        post(broker.bootstrap, topics["input"], repeats, posted)
        assert {posted.where[k][0] for k, _ in repeats} == {0, 1, 2}
        collector.wait_for({k for k, _ in repeats}, 120, worker)
        after = _entries(store)
        assert set(after) == set(before)
        assert len([k for k in before if after[k] > before[k]]) == 1, (before, after)

        worker.signal(signal.SIGTERM)
        assert worker.wait(120) == 0, worker.log()
        log = worker.log()
        assert "2 worker processes ready" in log and "passing it to 2 worker processes" in log
    got = wait_committed(broker.bootstrap, group, topics["input"], posted.ends(), timeout=20)
    assert got == posted.ends()
    collector.close()


@pytest.mark.timeout(300)
def test_sigterm_while_the_engines_load_stops_the_set_with_exit_0_and_no_process_left(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """The supervisor passes the stop on once; taking the set down after it sent each child a
    second SIGTERM (exit 130, no drain), and children that stopped as asked counted as a
    failed start (exit 1). A stop is a stop: exit 0, as with one process."""
    topics = make_topics(broker.bootstrap, "procs-stop")
    group = f"procs-stop-{uuid.uuid4().hex[:6]}"
    extra = {"processes": 2, "worker_id": "duo"}
    with WorkerProcess(broker.bootstrap, tmp_path, topics, group, extra) as worker:
        assert worker.proc is not None
        deadline = time.monotonic() + 240
        while not any(is_engine_core(p) for p in process_tree(worker.proc.pid)):
            assert worker.proc.poll() is None, worker.log()
            assert time.monotonic() < deadline, worker.log()
            time.sleep(0.05)
        tree = process_tree(worker.proc.pid)
        worker.signal(signal.SIGTERM)
        assert worker.wait(60) == 0, worker.log()
        log = worker.log()
        assert "passing it to 2 worker processes" in log, log
        assert "Traceback" not in log, log
        alive = still_alive(tree, 10)
        assert not alive, [describe(p) for p in alive]
