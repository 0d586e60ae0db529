"""The backfill command's clients close cleanly: an interrupt stays an interrupt, and a reader's
close does not cancel its own metadata request (issue #35 item 5).

The producer close must not turn an interrupt into a crash.

One CI run: a SIGINT landed inside kafka-python's `send` and left a batch that never completed;
the `close(timeout=5)` in the command's cleanup then raised `KafkaTimeoutError`, which replaced
the `Interrupted` being handled, so the command crashed instead of exiting 130 ("run the same
command to resume"). A frozen broker (SIGSTOP) leaves a batch unacknowledged the same way."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaProducer
from kafka.errors import KafkaTimeoutError

from mmworker.backfill import SETTLE_MS, Collector, State, close_producer, close_reader
from mmworker.config import KafkaConfig, WorkerConfig
from mmworker.devkit.broker import EmbeddedBroker
from mmworker.kafka_io import ensure_topics

pytestmark = pytest.mark.integration


def _producer_with_an_unacknowledged_batch(broker: EmbeddedBroker, topic: str) -> KafkaProducer:
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all", linger_ms=0)
    producer.send(topic, b"before").get(timeout=30)  # connected, metadata known
    assert broker.pid is not None
    os.kill(broker.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10  # SIGSTOP takes effect asynchronously
    while "T (stopped)" not in Path(f"/proc/{broker.pid}/status").read_text():
        assert time.monotonic() < deadline, "the broker did not stop"
        time.sleep(0.05)
    producer.send(topic, b"never acknowledged")
    return producer


@pytest.mark.timeout(120)
def test_a_producer_close_that_times_out_is_reported_not_raised(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with EmbeddedBroker() as broker:
        topic = f"close-{uuid.uuid4().hex[:6]}"
        ensure_topics(KafkaConfig(bootstrap_servers=broker.bootstrap), {topic: 1})
        assert broker.pid is not None
        try:
            # Control: kafka-python's own close raises in this state.
            control = _producer_with_an_unacknowledged_batch(broker, topic)
            with pytest.raises(KafkaTimeoutError):
                control.close(timeout=1)
            os.kill(broker.pid, signal.SIGCONT)
            producer = _producer_with_an_unacknowledged_batch(broker, topic)
            close_producer(producer)  # returns: the caller's exit code stands
        finally:
            os.kill(broker.pid, signal.SIGCONT)
    err = capsys.readouterr().err
    assert "closed the producer with unacknowledged records" in err, err
    assert "posted again on resume" in err, err


def test_other_close_errors_still_raise() -> None:
    class Broken:
        def close(self, timeout: float) -> None:
            raise RuntimeError("not a timeout")

    with pytest.raises(RuntimeError, match="not a timeout"):
        close_producer(Broken())


def _reader_with_a_metadata_request_in_flight(broker: EmbeddedBroker, cfg: WorkerConfig) -> Any:
    """A collector's consumer whose metadata request the broker has received but not answered
    (frozen); the broker answers 0.5 s later, like a busy one."""
    collector = Collector(cfg, [cfg.kafka.output_topic, cfg.kafka.dead_letter_topic], "x", State())
    consumer = collector._consumer
    time.sleep(0.3)  # past the client's retry backoff since its last metadata request
    assert broker.pid is not None
    os.kill(broker.pid, signal.SIGSTOP)
    consumer._cluster.request_update()
    deadline = time.monotonic() + 10
    while not consumer._cluster.metadata_refresh_in_progress:
        assert time.monotonic() < deadline, "no metadata request went out"
        time.sleep(0.005)
    threading.Timer(0.5, os.kill, (broker.pid, signal.SIGCONT)).start()
    return consumer


@pytest.mark.timeout(120)
def test_a_reader_closes_without_cancelling_its_metadata_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue #35 item 5: a finished backfill's re-run logged `ERROR kafka.cluster: Metadata
    refresh: failed Cancelled` (and at times an AttributeError traceback from kafka-python's
    I/O thread) because the collector's consumer was closed while its metadata request was in
    flight. Here that request is in flight every time."""
    with EmbeddedBroker() as broker:
        topics = {
            "out": f"close-out-{uuid.uuid4().hex[:6]}",
            "dlq": f"close-dlq-{uuid.uuid4().hex[:6]}",
        }
        kafka = KafkaConfig(bootstrap_servers=broker.bootstrap, output_topic=topics["out"],
                            dead_letter_topic=topics["dlq"])  # fmt: skip
        ensure_topics(kafka, {topics["out"]: 2, topics["dlq"]: 1})
        cfg = WorkerConfig(kafka=kafka)
        assert broker.pid is not None
        try:
            with caplog.at_level(logging.ERROR, logger="kafka"):
                # Control: kafka-python's own close cancels the request and logs an error.
                _reader_with_a_metadata_request_in_flight(broker, cfg).close()
                time.sleep(0.6)
                assert "Metadata refresh: failed Cancelled" in caplog.text, caplog.text
                caplog.clear()
                consumer = _reader_with_a_metadata_request_in_flight(broker, cfg)
                started = time.monotonic()
                close_reader(consumer)
                took = time.monotonic() - started
                time.sleep(0.6)
        finally:
            os.kill(broker.pid, signal.SIGCONT)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors
    assert 0.2 < took < SETTLE_MS / 1000, took  # it waited for the answer, not for the cap
