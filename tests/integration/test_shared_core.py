"""`engine.shared_core`: two real workers as front ends of ONE real vLLM engine core."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

import pytest
from mmworker_schemas import GenerationParams, Job, MediaRef

from mmworker.devkit.broker import EmbeddedBroker
from mmworker.devkit.samples import sample_image
from tests.integration.workerkit import (
    Collector,
    Posted,
    WorkerProcess,
    is_engine_core,
    make_topics,
    post,
    process_tree,
    still_alive,
    wait_committed,
)

pytestmark = pytest.mark.integration


def test_two_workers_feed_one_engine_core_and_drain_on_sigterm(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    topics = make_topics(broker.bootstrap, "shared")
    group = f"shared-{uuid.uuid4().hex[:6]}"
    posted = Posted()
    jobs = []
    for i in range(24):
        job = Job(
            job_id=f"s-{i}",
            media=[MediaRef(data=sample_image(seed=100 + i))],
            generation=GenerationParams(max_tokens=8),
        )
        jobs.append((job.job_id, job.model_dump_json().encode()))
    post(broker.bootstrap, topics["input"], jobs, posted)
    collector = Collector(broker.bootstrap, [topics["output"], topics["dlq"]])
    extra = {"processes": 2, "engine.shared_core": True, "worker_id": "pair"}
    with WorkerProcess(broker.bootstrap, tmp_path, topics, group, extra) as worker:
        ids = {key for key, _ in jobs}
        collector.wait_for(ids, 300, worker)
        answered_by = set()
        for job_id in ids:
            topic, doc = collector.one(job_id)  # exactly one record per job
            assert topic == topics["output"], doc
            assert doc["usage"]["output_tokens"] == 8, doc
            answered_by.add(doc["worker_id"])
        assert answered_by == {"pair-0", "pair-1"}, worker.log()
        assert worker.proc is not None
        tree = process_tree(worker.proc.pid)
        cores = [p for p in tree if is_engine_core(p)]
        # One engine core for both workers: the point of the setting.
        assert len(cores) == 1, tree
        worker.signal(signal.SIGTERM)
        assert worker.wait(120) == 0, worker.log()
        log = worker.log()
        assert "2 worker processes ready on one engine core" in log, log
        alive = still_alive(tree, 10)
        assert not alive, [p.pid for p in alive]
    got = wait_committed(broker.bootstrap, group, topics["input"], posted.ends(), timeout=20)
    assert got == posted.ends()
    collector.close()
