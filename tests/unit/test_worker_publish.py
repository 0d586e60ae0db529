"""What the worker does when the broker refuses a record for good (fake producer, no engine).

Retrying a non-retriable refusal forever would pin the partition's commit and, once
`max_in_flight` jobs pile up behind it, stop the whole worker; dropping it would lose the job.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from kafka.errors import KafkaTimeoutError, MessageSizeTooLargeError

from mmworker.config import WorkerConfig, load_config
from mmworker.jobs import JobRunner, Outcome
from mmworker.metrics import Metrics
from mmworker.offsets import TopicPartition
from mmworker.records import Context
from mmworker.worker import EXIT_DEAD_LETTER_REFUSED, EXIT_OK, Worker
from schemas import Result

OUTPUT, DLQ = "out", "dlq"
TP = TopicPartition("jobs", 0)


class _Future:
    def add_callback(self, fn: Any) -> None:
        fn("metadata")  # acknowledged at once

    def add_errback(self, fn: Any) -> None:
        del fn


class _Producer:
    """Raises `refuse[topic]`'s errors in turn (as kafka-python's send does), then accepts."""

    def __init__(self, refuse: dict[str, list[Exception]]) -> None:
        self.refuse = refuse
        self.sent: list[tuple[str, str, dict[str, Any]]] = []

    def send(self, topic: str, *, key: bytes, value: bytes, headers: Any) -> _Future:
        errors = self.refuse.get(topic)
        if errors:
            raise errors.pop(0)
        self.sent.append((topic, key.decode(), json.loads(value)))
        return _Future()


def _worker(producer: _Producer) -> tuple[Worker, Metrics]:
    cfg: WorkerConfig = load_config(kafka={"output_topic": OUTPUT, "dead_letter_topic": DLQ})
    metrics = Metrics()
    runner = JobRunner(cfg, engine=None, media=None, metrics=metrics)  # type: ignore[arg-type]
    result = Result.model_construct(job_id="job-1", text="a caption")

    async def run(raw: bytes | None, ctx: Context, ts: int) -> Outcome:
        return Outcome(OUTPUT, "job-1", result)

    runner.run = run  # type: ignore[method-assign]
    worker = Worker(cfg, runner, metrics, "tiny")
    worker._producer = producer
    worker.tracker.track(TP, 7)
    return worker, metrics


def _record() -> Any:
    return SimpleNamespace(topic=TP.topic, partition=TP.partition, offset=7, key=None,
                           value=b'{"job_id": "job-1"}', timestamp=0)  # fmt: skip


def test_refused_result_is_dead_lettered_and_the_offset_moves_on() -> None:
    producer = _Producer({OUTPUT: [MessageSizeTooLargeError("1.2 MB > max_request_size")]})
    worker, metrics = _worker(producer)
    asyncio.run(worker._handle(TP, _record()))

    ((topic, key, failure),) = producer.sent
    assert (topic, key) == (DLQ, "job-1")
    assert failure["code"] == "publish_failed" and failure["retryable"] is False
    assert "MessageSizeTooLargeError" in failure["message"] and OUTPUT in failure["message"]
    assert failure["source"] == {"topic": "jobs", "partition": 0, "offset": 7}
    assert worker.tracker.to_commit() == {TP: 8}
    assert worker.exit_code == EXIT_OK
    assert metrics.failures.labels("publish_failed")._value.get() == 1


def test_refusing_dead_letter_topic_stops_the_worker_uncommitted() -> None:
    too_big = MessageSizeTooLargeError("too big")
    worker, _ = _worker(_Producer({OUTPUT: [too_big], DLQ: [too_big]}))
    asyncio.run(worker._handle(TP, _record()))

    assert worker.exit_code == EXIT_DEAD_LETTER_REFUSED
    assert worker._stopping.is_set()
    assert worker.tracker.to_commit() == {}  # the job is redelivered after the fix


def test_retriable_errors_are_retried_until_acknowledged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    producer = _Producer({OUTPUT: [KafkaTimeoutError("metadata"), KafkaTimeoutError("again")]})
    worker, _ = _worker(producer)
    asyncio.run(worker._handle(TP, _record()))

    assert [t for t, _, _ in producer.sent] == [OUTPUT]
    assert worker.tracker.to_commit() == {TP: 8}


_real_sleep = asyncio.sleep


async def _no_sleep(delay: float) -> None:
    await _real_sleep(0)
