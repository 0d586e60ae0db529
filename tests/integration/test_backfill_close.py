"""The backfill command's producer close must not turn an interrupt into a crash.

One CI run: a SIGINT landed inside kafka-python's `send` and left a batch that never completed;
the `close(timeout=5)` in the command's cleanup then raised `KafkaTimeoutError`, which replaced
the `Interrupted` being handled, so the command crashed instead of exiting 130 ("run the same
command to resume"). A frozen broker (SIGSTOP) leaves a batch unacknowledged the same way."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from kafka import KafkaProducer
from kafka.errors import KafkaTimeoutError

from mmworker.backfill import close_producer
from mmworker.config import KafkaConfig
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
