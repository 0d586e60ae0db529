"""The broker restarts under a running worker: stopped mid-stream (SIGTERM, as a rolling upgrade
does) and started again on the same port a few seconds later, with its topics kept in a local
S3 store. The worker process stays up, says so in a line of its own, reconnects, and every job
is answered; none is lost, and a job answered before the stop is not redone unless its offset
had not been committed yet."""

from __future__ import annotations

import os
import signal
import time
import uuid
import zlib
from pathlib import Path

import pytest
from mmworker_schemas import GenerationParams, Job, MediaRef

from mmworker.broker_watch import CONNECTION_NOISE
from mmworker.devkit.broker import EmbeddedBroker
from mmworker.devkit.object_store import ObjectStore
from mmworker.devkit.samples import sample_image
from tests.integration.workerkit import (
    Collector,
    Posted,
    WorkerProcess,
    make_topics,
    post,
    wait_for_log,
)

pytestmark = pytest.mark.integration

JOBS = 150


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault", ["restart", "freeze"])
def test_the_worker_rides_out_a_broker_restart_and_loses_nothing(
    tmp_path: Path, fault: str
) -> None:
    """`restart`: SIGTERM, 5 s down, a new broker on the same port and store. `freeze`: SIGSTOP
    for 8 s, and longer until the worker has said so, then SIGCONT (a hung broker: connections
    are accepted, nothing is answered; its probe waits 5 s for an answer, so on a slow host
    it could still be waiting at 8 s and see the broker answer)."""
    with ObjectStore() as store:
        broker = EmbeddedBroker(store=store).start()
        worker = None
        try:
            topics = make_topics(broker.bootstrap, "bounce")
            group = f"bounce-{uuid.uuid4().hex[:6]}"
            jobs = []
            for i in range(JOBS):
                job_id = f"b-{i}"
                image = sample_image(width=112, height=112, seed=zlib.crc32(job_id.encode()) % 997)
                job = Job(job_id=job_id, media=[MediaRef(data=image)],
                          generation=GenerationParams(max_tokens=8))  # fmt: skip
                jobs.append((job_id, job.model_dump_json().encode()))
            # Idempotence off: Tansu can lose a batch cut off by its restart and answer its
            # retry "duplicate" (test_broker_restart_producer.py says how).
            extra = {"limits.max_in_flight": 16, "kafka.enable_idempotence": False}
            worker = WorkerProcess(broker.bootstrap, tmp_path, topics, group, extra)
            worker.__enter__()
            post(broker.bootstrap, topics["input"], jobs, Posted())
            collector = Collector(broker.bootstrap, [topics["output"], topics["dlq"]])
            deadline = time.monotonic() + 300
            while len(collector.by_job) < 30 and time.monotonic() < deadline:
                collector.pump(200)
            collector.close()
            down_at = time.monotonic()
            if fault == "restart":
                broker.stop()
                time.sleep(5)
                broker.start()
            else:
                assert broker.pid is not None
                os.kill(broker.pid, signal.SIGSTOP)
                time.sleep(8)
                wait_for_log(worker, "lost the Kafka brokers", 30)
                os.kill(broker.pid, signal.SIGCONT)
            print(f"\nbroker down {time.monotonic() - down_at:.1f}s")
            collector = Collector(broker.bootstrap, [topics["output"], topics["dlq"]])
            collector.wait_for({job_id for job_id, _ in jobs}, 300, worker)
            collector.close()

            assert worker.proc is not None and worker.proc.poll() is None, worker.log()
            # The worker's own check (a probe every 0.5 s while lost, each waiting up to 5 s for
            # an answer) may trail kafka-python's reconnect, which answered the last jobs.
            deadline = time.monotonic() + 30
            while (
                time.monotonic() < deadline
                and "Kafka brokers back after" not in worker.log_path.read_text(errors="replace")
            ):
                time.sleep(0.2)
            log = worker.log_path.read_text(errors="replace")
            for job_id, _ in jobs:
                (topic, doc), *_ = collector.by_job[job_id]
                assert topic == topics["output"], (job_id, doc)
            duplicates = sum(len(v) - 1 for v in collector.by_job.values())
            print(f"{JOBS} jobs answered across the restart, {duplicates} duplicates")
            # One line of its own each way, and none of kafka-python's per-attempt lines.
            assert log.count("lost the Kafka brokers") == 1, log[-6000:]
            assert log.count("Kafka brokers back after") == 1, log[-6000:]
            chatter = [
                line
                for line in log.splitlines()
                if " kafka." in line and any(p in line for p in CONNECTION_NOISE)
            ]
            assert not chatter, chatter[:5]
        finally:
            if worker is not None:
                worker.__exit__(None, None, None)
            broker.stop()
