"""`mmworker demo`: the whole loop on one machine with nothing configured.

Embedded broker → a real `mmworker run` process on the tiny random-weight model → sample image and
video jobs (plus two bad ones) → captions and failures printed → SIGTERM → clean exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from kafka import KafkaConsumer, KafkaProducer
from mmworker_schemas import GenerationParams, Job, MediaRef

from mmworker.config import KafkaConfig
from mmworker.devkit.broker import EmbeddedBroker
from mmworker.devkit.samples import sample_image, sample_video
from mmworker.kafka_io import ensure_topics
from mmworker.tools import summarise

TOPICS = {"input": "demo.jobs", "output": "demo.results", "dlq": "demo.dead-letter"}
DEADLINE_S = 600.0


def worker_command(
    bootstrap: str,
    workdir: Path,
    topics: dict[str, str] | None = None,
    group: str | None = None,
    extra: dict[str, object] | None = None,
) -> list[str]:
    """The CPU/tiny-model settings a test or demo worker runs with."""
    topics = topics or TOPICS
    sets: dict[str, object] = {
        "kafka.input_topic": topics["input"],
        "kafka.output_topic": topics["output"],
        "kafka.dead_letter_topic": topics["dlq"],
        "kafka.session_timeout_ms": 6000,
        "kafka.heartbeat_interval_ms": 1000,
        "kafka.commit_interval_s": 0.5,
        "engine.max_model_len": 4096,
        "preprocess.allowed_roots": [str(workdir)],
        "preprocess.workers": 1,
        "limits.max_attempts": 2,
        "limits.retry_backoff_s": 0.2,
        **(extra or {}),
    }
    group = group or f"demo-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "mmworker", "run", "--bootstrap-servers", bootstrap,
           "--model", "tiny", "--group-id", group,
           "--cache-dir", str(workdir / "features"), "--create-topics", "3"]  # fmt: skip
    for key, value in sets.items():
        cmd += ["--set", f"{key}={json.dumps(value)}"]
    return cmd


def _jobs(workdir: Path) -> list[tuple[str, bytes]]:
    video = workdir / "ball.mp4"
    video.write_bytes(sample_video())
    # Sampled, not greedy: a random-weight model's greedy output is one token repeated.
    gen = GenerationParams(max_tokens=24, temperature=1.0, seed=7)
    image = Job(job_id="demo-image", media=[MediaRef(data=sample_image())], generation=gen)
    clip = Job(job_id="demo-video", media=[MediaRef(uri=video.as_uri())], generation=gen)
    again = Job(job_id="demo-video-again", media=[MediaRef(uri=video.as_uri())], generation=gen)
    forbidden = Job(job_id="demo-forbidden", media=[MediaRef(uri="file:///etc/passwd")])
    return [
        ("demo-image", image.model_dump_json().encode()),
        ("demo-video", clip.model_dump_json().encode()),
        ("demo-forbidden", forbidden.model_dump_json().encode()),
        ("demo-bad-json", b'{"job_id": "demo-bad-json", "media": ['),
        ("demo-video-again", again.model_dump_json().encode()),
    ]


def run_demo(keep_going: bool = False) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="mmworker-demo-"))
    print("mmworker demo: the model has RANDOM WEIGHTS (built here, no download), so captions are")
    print(
        "gibberish; everything else — broker, engine, preprocessing, cache — is the real thing.\n"
    )
    with EmbeddedBroker() as broker:
        kafka = KafkaConfig(bootstrap_servers=broker.bootstrap)
        ensure_topics(kafka, {TOPICS["input"]: 3, TOPICS["output"]: 3, TOPICS["dlq"]: 1})
        print(f"broker (Tansu, embedded) on {broker.bootstrap}; starting the worker ...")
        # Own process group, so an abort below also ends the engine core the worker started.
        worker = subprocess.Popen(worker_command(broker.bootstrap, workdir), start_new_session=True)
        try:
            return _exchange(broker.bootstrap, workdir, worker)
        finally:
            if worker.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
            if keep_going:
                print(f"kept the worker's directory (features, sample video): {workdir}")
            else:
                import shutil

                shutil.rmtree(workdir, ignore_errors=True)


def _exchange(bootstrap: str, workdir: Path, worker: subprocess.Popen[bytes]) -> int:
    producer = KafkaProducer(bootstrap_servers=[bootstrap], acks="all")
    jobs = _jobs(workdir)
    # The repeat goes last and after a pause, so it finds the first video's features cached.
    for key, value in jobs[:-1]:
        producer.send(TOPICS["input"], key=key.encode(), value=value)
    producer.flush()
    consumer = KafkaConsumer(
        TOPICS["output"], TOPICS["dlq"], bootstrap_servers=[bootstrap],
        auto_offset_reset="earliest", enable_auto_commit=False, group_id=None,
        consumer_timeout_ms=1000,
    )  # fmt: skip
    waiting = {key for key, _ in jobs}
    repeat_sent = False
    deadline = time.monotonic() + DEADLINE_S
    while waiting and time.monotonic() < deadline and worker.poll() is None:
        for record in consumer:
            print(summarise(record.topic, json.loads(record.value), record.key), flush=True)
            waiting.discard(record.key.decode())
        if not repeat_sent and "demo-video" not in waiting:
            key, value = jobs[-1]
            producer.send(TOPICS["input"], key=key.encode(), value=value)
            producer.flush()
            repeat_sent = True
    consumer.close()
    producer.close()
    if waiting:
        print(f"\nno answer for {sorted(waiting)} (worker exit {worker.poll()})", file=sys.stderr)
        return 1
    worker.send_signal(signal.SIGTERM)
    code = worker.wait(timeout=120)
    print(f"\nall {len(jobs)} jobs answered; worker stopped on SIGTERM with exit code {code}")
    return 0 if code == 0 else 1
