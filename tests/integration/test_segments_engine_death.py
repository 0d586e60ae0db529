"""An engine core SIGKILLed while a long video is captioned in segments: a real `mmworker run`,
the real broker, the real engine (tiny model).

- While the worker runs: it replaces the core in its own process, records the segmented job as
  a suspect (it was inside), runs it again, and answers it whole; the image jobs posted with it
  are answered too, and the process never exits.
- While it drains after SIGTERM: it records the suspect all the same, exits without leaving a
  process behind, and the next worker of the group answers every job."""

from __future__ import annotations

import json
import signal
import time
import uuid
import zlib
from pathlib import Path

import psutil
import pytest
from kafka import KafkaConsumer
from kafka.structs import TopicPartition
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
    wait_for_log,
)
from tests.media_scenes import scene_video

pytestmark = pytest.mark.integration

DURATION_S = 600.0
EVERY_S = 10.0  # 60 segments: the job is still inside the engine when the first images are back
SEGMENTS = round(DURATION_S / EVERY_S)
IMAGES = 6


def _jobs(clip: bytes) -> list[tuple[str, bytes]]:
    seg = Job(
        job_id="seg-killed", media=[MediaRef(data=clip)], video={"fps": 0.25, "max_frames": 4},
        generation={"max_tokens": 8}, segments={"mode": "fixed", "every_s": EVERY_S},
    )  # type: ignore[arg-type]  # fmt: skip
    jobs = [(seg.job_id, seg.model_dump_json(exclude_defaults=True).encode())]
    for i in range(IMAGES):
        image = sample_image(width=112, height=112, seed=zlib.crc32(f"img-{i}".encode()) % 1000)
        job = Job(
            job_id=f"img-{i}", media=[MediaRef(data=image)],
            generation=GenerationParams(max_tokens=8),
        )  # fmt: skip
        jobs.append((job.job_id, job.model_dump_json().encode()))
    return jobs


def _suspect_records(bootstrap: str, topic: str) -> list[tuple[str, dict[str, object] | None]]:
    """Every record of the suspects topic in order: key, and its JSON (None: a tombstone)."""
    consumer = KafkaConsumer(
        bootstrap_servers=[bootstrap], group_id=None, enable_auto_commit=False,
        auto_offset_reset="earliest",
    )  # fmt: skip
    try:
        parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or {0}]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        out: list[tuple[str, dict[str, object] | None]] = []
        quiet_until = time.monotonic() + 5
        while time.monotonic() < quiet_until:
            for records in consumer.poll(timeout_ms=500).values():
                for r in records:
                    out.append((r.key.decode(), json.loads(r.value) if r.value else None))
                    quiet_until = time.monotonic() + 5
        return out
    finally:
        consumer.close()


def _engine_core(worker: WorkerProcess) -> psutil.Process:
    assert worker.proc is not None
    cores = [p for p in process_tree(worker.proc.pid) if is_engine_core(p)]
    assert len(cores) == 1, cores
    return cores[0]


def _start_with_the_segmented_job_inside(
    broker: EmbeddedBroker, tmp_path: Path, name: str, extra: dict[str, object]
) -> tuple[WorkerProcess, Collector, dict[str, str], str, list[tuple[str, bytes]], Posted]:
    """A worker with its own suspects topic, the jobs posted, and the segmented job still
    running once every image is back (the images are quick; the 60 segments are not) and its
    segments are being captioned. That it was inside the engine is checked afterwards through
    the suspects topic, not assumed. Every image answered first: one still inside at the kill
    would be a second job in the death's count."""
    topics = make_topics(broker.bootstrap, name)
    suspects = f"{name}-{uuid.uuid4().hex[:6]}.suspects"
    group = f"{name}-{uuid.uuid4().hex[:6]}"
    jobs = _jobs(scene_video([150.0, 300.0, 450.0], DURATION_S))
    collector = Collector(broker.bootstrap, [topics["output"], topics["dlq"]])
    worker = WorkerProcess(
        broker.bootstrap, tmp_path, topics, group, {"kafka.suspects_topic": suspects, **extra}
    )
    posted = Posted()
    try:
        worker.__enter__()
        wait_for_log(worker, "assigned [", 300)
        post(broker.bootstrap, topics["input"], jobs, posted)
        collector.wait_for({f"img-{i}" for i in range(IMAGES)}, 120, worker)
        wait_for_log(worker, "job seg-killed: segment", 120)
        collector.pump(200)
        assert "seg-killed" not in collector.by_job, "the segmented job ended before the kill"
    except BaseException:
        worker.__exit__(None, None, None)
        collector.close()
        raise
    return worker, collector, topics, suspects, jobs, posted


def _assert_answered_whole_and_suspected_once(
    bootstrap: str, collector: Collector, topics: dict[str, str], suspects: str,
    jobs: list[tuple[str, bytes]], posted: Posted,
) -> None:  # fmt: skip
    topic, doc = collector.one("seg-killed")
    assert topic == topics["output"], doc
    assert len(doc["segments"]) == SEGMENTS, doc
    for seg in doc["segments"]:
        assert seg["error"] is None and seg["text"], seg
    for job_id, _ in jobs:
        for topic, doc in collector.by_job[job_id]:
            assert topic == topics["output"], (job_id, doc)
    # It was inside at the death (recorded: one death), and cleared once it finished.
    partition, offset = posted.where["seg-killed"]
    key = f"{topics['input']}/{partition}/{offset}"
    mine = [value for k, value in _suspect_records(bootstrap, suspects) if k == key]
    assert mine and mine[0] is not None and mine[0]["deaths"] == 1, mine
    assert mine[-1] is None, mine  # the tombstone: it finished, so it was innocent


@pytest.mark.timeout(900)
def test_engine_core_killed_under_a_segmented_job_is_replaced_and_the_job_answered_whole(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    worker, collector, topics, suspects, jobs, posted = _start_with_the_segmented_job_inside(
        broker, tmp_path, "segdeath", {}
    )
    try:
        _engine_core(worker).send_signal(signal.SIGKILL)
        collector.wait_for({job_id for job_id, _ in jobs}, 600, worker)
        assert worker.proc is not None and worker.proc.poll() is None, worker.log()
        assert "engine restarted in" in worker.log_path.read_text(errors="replace"), worker.log()
        _assert_answered_whole_and_suspected_once(
            broker.bootstrap, collector, topics, suspects, jobs, posted
        )
    finally:
        worker.__exit__(None, None, None)
        collector.close()


@pytest.mark.timeout(900)
def test_engine_core_killed_during_the_sigterm_drain_is_replaced_and_the_job_finished(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """The drain's grace (120 s here) outlasts a CPU core's restart (~12 s), so the job that was
    inside is run again, alone, and answered before the worker exits 0. (A shorter grace cuts it
    off uncommitted, with its suspect record, for the partition's next owner.)"""
    worker, collector, topics, suspects, jobs, posted = _start_with_the_segmented_job_inside(
        broker, tmp_path, "draindeath", {"limits.shutdown_grace_s": 120}
    )
    try:
        core = _engine_core(worker)
        assert worker.proc is not None
        tree = process_tree(worker.proc.pid)
        worker.signal(signal.SIGTERM)
        wait_for_log(worker, "draining", 30)
        core.send_signal(signal.SIGKILL)
        assert worker.wait(180) == 0, worker.log()
        log = worker.log_path.read_text(errors="replace")
        assert "engine died with 1 jobs inside" in log and "engine restarted in" in log, log
        assert still_alive(tree, 10) == []
        collector.wait_for({job_id for job_id, _ in jobs}, 30)
        _assert_answered_whole_and_suspected_once(
            broker.bootstrap, collector, topics, suspects, jobs, posted
        )
    finally:
        worker.__exit__(None, None, None)
        collector.close()
