"""Helpers for tests that run a real `mmworker run` process against the real broker."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil
from kafka import KafkaConsumer, KafkaProducer
from kafka.structs import TopicPartition

from mmworker.config import KafkaConfig
from mmworker.devkit.demo import worker_command
from mmworker.kafka_io import ensure_topics

PARTITIONS = 3


def process_tree(pid: int) -> list[psutil.Process]:
    """Every descendant of `pid`, taken before a signal: what must be gone after it."""
    return psutil.Process(pid).children(recursive=True)


def describe(proc: psutil.Process) -> str:
    """Name and command line of `proc`; empty for a child that exited (or is a zombie) since
    the tree was taken, which start-up's short-lived helpers (`uname`, compilers) often are."""
    try:
        return f"{proc.name()} {' '.join(proc.cmdline())}"
    except psutil.Error:
        return ""


def is_engine_core(proc: psutil.Process) -> bool:
    """vLLM renames its engine-core process (VLLM::EngineCore)."""
    return "EngineCore" in describe(proc)


def still_alive(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The ones of `procs` still running after `timeout` seconds (zombies count as gone)."""
    _gone, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


def make_topics(bootstrap: str, prefix: str) -> dict[str, str]:
    tag = uuid.uuid4().hex[:6]
    topics = {k: f"{prefix}-{tag}.{k}" for k in ("input", "output", "dlq", "replies")}
    cfg = KafkaConfig(bootstrap_servers=bootstrap)  # type: ignore[call-arg]
    ensure_topics(cfg, {topic: 1 if k == "dlq" else PARTITIONS for k, topic in topics.items()})
    return topics


class WorkerProcess:
    """A real worker subprocess; its log goes to a file the test prints on failure."""

    def __init__(
        self, bootstrap: str, workdir: Path, topics: dict[str, str], group: str,
        extra: dict[str, object] | None = None, env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.log_path = workdir / f"worker-{uuid.uuid4().hex[:6]}.log"
        self.cmd = worker_command(bootstrap, workdir, topics, group, extra)
        self.proc: subprocess.Popen[bytes] | None = None
        self.env = env or {}

    def __enter__(self) -> WorkerProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        with self.log_path.open("wb") as log:
            # Own process group: a SIGKILL then takes the engine core with it, as a container
            # runtime would, instead of leaving an orphaned engine behind.
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def signal(self, sig: signal.Signals) -> None:
        """SIGKILL hits the whole group (a crash); other signals only the worker, like `kill`."""
        assert self.proc is not None
        if sig == signal.SIGKILL:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


def wait_for_log(worker: WorkerProcess, text: str, timeout: float) -> None:
    """Until the worker has logged `text`; fails at once if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in worker.log_path.read_text(errors="replace"):
            return
        assert worker.proc is not None
        if worker.proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not logged\n{worker.log()}")


def metric_sum(port: int, name: str) -> float:
    """A metric scraped from a worker, summed over its series (the supervisor of several
    processes serves one per process)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


@dataclass
class Posted:
    """What a test sent: job_id → (partition, offset), for the end-of-partition checks."""

    where: dict[str, tuple[int, int]] = field(default_factory=dict)

    def ends(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for partition, offset in self.where.values():
            out[partition] = max(out.get(partition, 0), offset + 1)
        return out


def post(bootstrap: str, topic: str, jobs: list[tuple[str, bytes]], posted: Posted) -> None:
    producer = KafkaProducer(bootstrap_servers=[bootstrap], acks="all", max_request_size=8 << 20)
    futures = [(key, producer.send(topic, key=key.encode(), value=value)) for key, value in jobs]
    producer.flush()
    for key, fut in futures:
        meta = fut.get(timeout=30)
        posted.where[key] = (meta.partition, meta.offset)
    producer.close()


class Collector:
    """Reads the output and dead-letter topics from the start, grouping records by job_id.

    `from_now`: from their current ends instead, so that a test on a worker other tests share
    (the session's `service` worker) sees only the records that came after it began."""

    def __init__(self, bootstrap: str, topics: list[str], from_now: bool = False) -> None:
        self.by_job: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
        #: Each job's first answer's broker timestamp (ms since the epoch; the worker's clock).
        self.first_ts_ms: dict[str, int] = {}
        self._consumer = KafkaConsumer(
            bootstrap_servers=[bootstrap], group_id=None, enable_auto_commit=False,
            auto_offset_reset="earliest",
        )  # fmt: skip
        parts = [TopicPartition(t, p) for t in topics
                 for p in (self._consumer.partitions_for_topic(t) or {0})]  # fmt: skip
        self._consumer.assign(parts)
        if from_now:
            self._consumer.seek_to_end(*parts)
            for tp in parts:  # resolve the ends now, not at the first poll
                self._consumer.position(tp)
        else:
            self._consumer.seek_to_beginning(*parts)

    def pump(self, timeout_ms: int = 500) -> None:
        for records in self._consumer.poll(timeout_ms=timeout_ms).values():
            for r in records:
                doc = json.loads(r.value)
                job_id = str(doc.get("job_id") or r.key.decode())
                self.by_job[job_id].append((r.topic, doc))
                self.first_ts_ms.setdefault(job_id, r.timestamp)

    def wait_for(
        self, job_ids: set[str], timeout: float, worker: WorkerProcess | None = None
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pump()
            if job_ids <= set(self.by_job):
                return
            if worker is not None and worker.proc is not None and worker.proc.poll() is not None:
                break
        missing = sorted(job_ids - set(self.by_job))
        log = worker.log() if worker else ""
        raise AssertionError(f"no answer for {len(missing)} jobs, e.g. {missing[:5]}\n{log}")

    def one(self, job_id: str) -> tuple[str, dict[str, Any]]:
        records = self.by_job[job_id]
        assert len(records) == 1, f"{job_id}: {len(records)} records"
        return records[0]

    def close(self) -> None:
        self._consumer.close()


def committed(bootstrap: str, group: str, topic: str) -> dict[int, int | None]:
    consumer = KafkaConsumer(
        bootstrap_servers=[bootstrap], group_id=group, enable_auto_commit=False
    )
    try:
        return {p: consumer.committed(TopicPartition(topic, p)) for p in range(PARTITIONS)}
    finally:
        consumer.close()


def wait_committed(
    bootstrap: str, group: str, topic: str, ends: dict[int, int], timeout: float = 60
) -> dict[int, int | None]:
    deadline = time.monotonic() + timeout
    while True:
        got = committed(bootstrap, group, topic)
        if all(got.get(p) == end for p, end in ends.items()) or time.monotonic() > deadline:
            return got
        time.sleep(0.5)
