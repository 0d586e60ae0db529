"""Segment mode on an hour of video, on the real parts: a worker SIGKILLed half-way through the
video loses nothing (its successor answers the job, once, complete), and the worker's memory
while it captions an hour is what it is for ten minutes (decoded segment by segment, at most
SEGMENTS_IN_FLIGHT of a job's segments held).
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
from mmworker_schemas import Job, MediaRef

from mmworker.devkit.broker import EmbeddedBroker
from tests.integration.workerkit import Collector, Posted, WorkerProcess, make_topics, post
from tests.media_scenes import scene_video

pytestmark = pytest.mark.integration

HOUR_S = 3600.0
TEN_MIN_S = 600.0
#: A 64x64 clip at 4 fps; 0.1 fps sampling and 4 frames keep each segment's request small.
VIDEO = {"fps": 0.1, "max_frames": 4}
#: Peak RSS of the worker and its processes may grow this much from a ten-minute video to an
#: hour (noise of the allocator and vLLM's buffers; the segments' frames are a few MB).
RSS_SLACK = 64 << 20


def _job(job_id: str, clip: Path, every_s: float) -> tuple[str, bytes]:
    job = Job(
        job_id=job_id, media=[MediaRef(uri=clip.as_uri())], video=VIDEO,
        generation={"max_tokens": 6},
        segments={"mode": "fixed", "every_s": every_s, "summary": {"max_tokens": 8}},
    )  # type: ignore[arg-type]  # fmt: skip
    return job.job_id, job.model_dump_json().encode()


class _PeakRss:
    """Polls the RSS of a process and its children (the preprocessing pool) on a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.NoSuchProcess:
                        continue
            except psutil.NoSuchProcess:
                return
            self.peak = max(self.peak, total)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def _captioned(worker: WorkerProcess, job_id: str) -> int:
    return worker.log_path.read_text(errors="replace").count(f"job {job_id}: segment ")


#: Two worker starts and two hours of video: 4 minutes on a quiet 2-core machine, over the
#: suite's 300 s default when other work shares it.
@pytest.mark.timeout(1500)
def test_an_hour_of_video_survives_sigkill_and_memory_does_not_grow_with_length(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    topics = make_topics(broker.bootstrap, "seglong")
    group = f"seglong-{uuid.uuid4().hex[:6]}"
    hour = tmp_path / "hour.mp4"
    hour.write_bytes(scene_video([300.0 * k for k in range(1, 12)], HOUR_S))
    ten = tmp_path / "ten.mp4"
    ten.write_bytes(scene_video([60.0 * k for k in range(1, 10)], TEN_MIN_S))
    collector = Collector(broker.bootstrap, [topics["output"], topics["dlq"]])
    post(broker.bootstrap, topics["input"], [_job("hour-1", hour, 60.0)], Posted())

    # 1. SIGKILL once 10 of the hour's 60 segments are captioned.
    with WorkerProcess(broker.bootstrap, tmp_path, topics, group) as victim:
        deadline = time.monotonic() + 400
        while _captioned(victim, "hour-1") < 10:
            assert victim.proc is not None and victim.proc.poll() is None, victim.log()
            assert time.monotonic() < deadline, victim.log()
            time.sleep(0.2)
        victim.signal(signal.SIGKILL)
        victim.wait(30)
        done_before = _captioned(victim, "hour-1")
        assert done_before < 60
    collector.pump()
    assert "hour-1" not in collector.by_job  # nothing was published for it

    # 2. The successor answers it, then a ten-minute and another one-hour job, one at a time.
    with WorkerProcess(broker.bootstrap, tmp_path, topics, group) as successor:
        assert successor.proc is not None
        collector.wait_for({"hour-1"}, 600, successor)
        peaks = {}
        for job_id, clip, seconds in (("ten", ten, TEN_MIN_S), ("hour-2", hour, HOUR_S)):
            with _PeakRss(successor.proc.pid) as rss:
                post(broker.bootstrap, topics["input"], [_job(job_id, clip, 60.0)], Posted())
                collector.wait_for({job_id}, 600, successor)
            peaks[job_id] = rss.peak
            topic, doc = collector.one(job_id)
            assert topic == topics["output"], doc
            assert len(doc["segments"]) == round(seconds / 60.0)
    print(
        f"captioned before the kill: {done_before}/60; peak RSS of the worker and its "
        f"processes: ten minutes {peaks['ten'] / 2**20:.0f} MiB, one hour "
        f"{peaks['hour-2'] / 2**20:.0f} MiB"
    )
    assert peaks["hour-2"] - peaks["ten"] <= RSS_SLACK, peaks

    collector.pump()
    topic, doc = collector.one("hour-1")  # exactly one record
    collector.close()
    assert topic == topics["output"], doc
    segs = doc["segments"]
    assert [s["start_s"] for s in segs] == [60.0 * k for k in range(60)]
    assert all(s["error"] is None and s["text"] for s in segs)
    assert doc["summary"]
