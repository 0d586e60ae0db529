"""kafka-python against the real embedded broker: group, manual commits, resume after restart."""

from __future__ import annotations

import socket
import uuid

import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.structs import OffsetAndMetadata, TopicPartition

from mmworker.config import KafkaConfig
from mmworker.devkit.broker import EmbeddedBroker
from mmworker.kafka_io import ensure_topics
from tests.conftest import GROUP_SETTINGS

pytestmark = pytest.mark.integration


def _consumer(broker: EmbeddedBroker, topic: str, group: str) -> KafkaConsumer:
    return KafkaConsumer(
        topic,
        bootstrap_servers=[broker.bootstrap],
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        **GROUP_SETTINGS,
    )


def _drain(consumer: KafkaConsumer, want: int, rounds: int = 60) -> list[bytes]:
    got: list[bytes] = []
    for _ in range(rounds):
        for records in consumer.poll(timeout_ms=500).values():
            got.extend(r.value for r in records)
        if len(got) >= want:
            break
    return got


def test_group_commit_and_resume_after_restart(broker: EmbeddedBroker) -> None:
    topic, group = f"smoke-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    ensure_topics(KafkaConfig(bootstrap_servers=broker.bootstrap), {topic: 1})  # type: ignore[call-arg]
    producer = KafkaProducer(bootstrap_servers=[broker.bootstrap], acks="all")
    for i in range(10):
        producer.send(topic, key=b"k", value=f"m{i}".encode())
    producer.flush()

    first = _consumer(broker, topic, group)
    seen = _drain(first, 10)
    assert seen[:10] == [f"m{i}".encode() for i in range(10)]
    # Commit only the first 4: a restarted member must resume at m4, not at the end.
    first.commit({TopicPartition(topic, 0): OffsetAndMetadata(4, "", -1)})
    first.close(autocommit=False)

    second = _consumer(broker, topic, group)
    resumed = _drain(second, 6)
    second.close(autocommit=False)
    assert resumed[:6] == [f"m{i}".encode() for i in range(4, 10)]


def test_broker_stops_on_exit() -> None:
    with EmbeddedBroker() as b:
        port = b.port
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
