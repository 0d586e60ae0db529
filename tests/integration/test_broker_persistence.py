"""The embedded broker kept in a local S3 store: stopped and started again on the same port, it
still has every topic, record and committed offset (what the restart tests of tail, backfill and
the worker need to claim that nothing was lost)."""

from __future__ import annotations

import time

import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.structs import TopicPartition

from mmworker.config import KafkaConfig
from mmworker.devkit.broker import EmbeddedBroker
from mmworker.devkit.object_store import ObjectStore
from mmworker.kafka_io import ensure_topics

pytestmark = pytest.mark.integration


def _consume(bootstrap: str, want: int) -> list[bytes]:
    consumer = KafkaConsumer(
        bootstrap_servers=[bootstrap], group_id="persist", enable_auto_commit=False,
        auto_offset_reset="earliest", session_timeout_ms=6000, heartbeat_interval_ms=1000,
    )  # fmt: skip
    consumer.subscribe(["persist.t"])
    got: list[bytes] = []
    deadline = time.monotonic() + 60
    while len(got) < want and time.monotonic() < deadline:
        for records in consumer.poll(500, max_records=want - len(got)).values():
            got.extend(r.value for r in records)
    consumer.commit()
    consumer.close()
    return got


@pytest.mark.parametrize("kept", [True, False], ids=["s3-store", "in-memory-control"])
def test_a_restarted_broker_keeps_topics_records_and_offsets_only_with_a_store(kept: bool) -> None:
    with ObjectStore() as store:
        broker = EmbeddedBroker(store=store if kept else None).start()
        try:
            ensure_topics(KafkaConfig(bootstrap_servers=broker.bootstrap), {"persist.t": 1})
            producer = KafkaProducer(bootstrap_servers=[broker.bootstrap], acks="all")
            for i in range(20):
                producer.send("persist.t", value=b"%d" % i)
            producer.flush()
            producer.close()
            assert _consume(broker.bootstrap, 10) == [b"%d" % i for i in range(10)]
            broker.stop()
            broker.start()  # same port, at once
            probe = KafkaConsumer(bootstrap_servers=[broker.bootstrap], group_id="persist")
            committed = probe.committed(TopicPartition("persist.t", 0))
            topics = probe.topics()
            probe.close()
            if kept:
                assert committed == 10 and "persist.t" in topics
                assert _consume(broker.bootstrap, 10) == [b"%d" % i for i in range(10, 20)]
            else:  # the control: memory forgets
                assert committed is None and "persist.t" not in topics
        finally:
            broker.stop()
