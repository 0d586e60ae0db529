"""The private parts of kafka-python this project reads, checked on real client objects of the
pinned release.

Why: a few repairs and reads need kafka-python's internals (the fetch-stall repair, the
heartbeat before leaving, reading positions without round trips, DescribeGroups without the
permission bits Tansu garbles). Several read them through `getattr(..., None)`, so a release that
renamed one would make the repair do nothing, silently. Each path here is one test, named after
the attribute, so an upgrade that drops one fails loudly and says which. Adding a new private read
means adding its path here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

from mmworker.devkit.broker import EmbeddedBroker

pytestmark = pytest.mark.integration

#: (client, dotted path, used by): every private attribute the runtime reads.
CONTRACT = [
    ("consumer", "_coordinator._commit_offsets_sync_async", "kafka_io.commit_in_rebalance"),
    ("consumer", "_coordinator.reset_generation", "kafka_io.close_consumer"),
    ("consumer", "_coordinator.coordinator_unknown", "kafka_io.heartbeat_now"),
    ("consumer", "_coordinator._generation.has_member_id", "kafka_io.heartbeat_now"),
    ("consumer", "_coordinator._manager.wait_for", "kafka_io.heartbeat_now"),
    ("consumer", "_coordinator._manager.call_soon", "kafka_io.heartbeat_now"),
    ("consumer", "_coordinator._send_heartbeat_request", "kafka_io.heartbeat_now"),
    ("consumer", "_coordinator.rejoin_needed", "kafka_io.rebalance_pending"),
    ("consumer", "_fetcher._next_partition_records", "kafka_io.poll (fetch-stall repair)"),
    ("consumer", "_fetcher._completed_fetches", "kafka_io.unparsed_highwater"),
    ("consumer", "_fetcher._paused_completed_fetches", "kafka_io.unparsed_highwater"),
    ("consumer", "_subscription.position", "kafka_io.may_have_records"),
    ("consumer", "_client.cluster.topic_id", "client._Reader (recreated topics)"),
    ("consumer", "_manager._conns", "backfill.Collector.connected"),
    ("consumer", "_manager.run", "backfill.close_reader"),
    ("consumer", "_manager.wait_for", "backfill.close_reader"),
    ("consumer", "_cluster._refresh_future", "backfill.close_reader"),
    ("consumer", "_net.stop", "backfill.close_reader"),
    ("admin", "_find_coordinator_id", "group_members.describe_members"),
    ("admin", "_manager.send", "group_members.describe_members"),
    ("admin", "_manager.run", "group_members.describe_members"),
]


@pytest.fixture(scope="module")
def clients(broker: EmbeddedBroker) -> Iterator[dict[str, Any]]:
    consumer = KafkaConsumer(
        bootstrap_servers=[broker.bootstrap], group_id="contract", enable_auto_commit=False
    )
    admin = KafkaAdminClient(bootstrap_servers=[broker.bootstrap])
    producer = KafkaProducer(bootstrap_servers=[broker.bootstrap])
    try:
        yield {"consumer": consumer, "admin": admin, "producer": producer}
    finally:
        consumer.close()
        admin.close()
        producer.close()


@pytest.mark.parametrize(
    ("client", "path", "used_by"), CONTRACT, ids=[f"{c}.{p}" for c, p, _ in CONTRACT]
)
def test_the_pinned_kafka_python_has_it(
    clients: dict[str, Any], client: str, path: str, used_by: str
) -> None:
    obj = clients[client]
    walked = client
    for name in path.split("."):
        assert hasattr(obj, name), f"kafka-python has no {walked}.{name} any more ({used_by})"
        obj = getattr(obj, name)
        walked += f".{name}"


def test_a_completed_fetch_carries_its_high_watermark() -> None:
    """`unparsed_highwater` reads `completed.partition_data.high_watermark` from the fetcher's
    parked fetches: the tuple must still have that field, and kafka-python's own fetcher still
    read the mark from it (so the field of the response is still named so)."""
    import inspect

    from kafka.consumer import fetcher

    assert "partition_data" in fetcher.CompletedFetch._fields
    assert "partition_data.high_watermark" in inspect.getsource(fetcher.Fetcher)
