"""A worker that stops while a rebalance waits for it must not wedge its consumer group.

On the Tansu broker a LeaveGroup sent by a member that has not rejoined a pending rebalance
leaves the members that did rejoin without an answer, for good (a CI run lost a whole test to
it: one worker died of an engine crash just as the other joined). `close_consumer` skips the
LeaveGroup in that state; the session timeout then frees the group, as on Apache Kafka.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from kafka import KafkaConsumer

from mmworker.config import KafkaConfig
from mmworker.devkit.broker import EmbeddedBroker
from mmworker.kafka_io import close_consumer, ensure_topics

pytestmark = pytest.mark.integration

SESSION_MS = 6000


def _consumer(bootstrap: str, topic: str, group: str) -> KafkaConsumer:
    return KafkaConsumer(
        topic, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
        auto_offset_reset="earliest", session_timeout_ms=SESSION_MS, heartbeat_interval_ms=1000,
        max_poll_interval_ms=60_000,
    )  # fmt: skip


def _poll_until_assigned(consumer: KafkaConsumer, timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        consumer.poll(timeout_ms=200)
        if consumer.assignment():
            return time.monotonic() - t0
    return None


@pytest.mark.timeout(120)
def test_a_member_stopping_during_a_pending_rebalance_does_not_wedge_the_group(
    broker: EmbeddedBroker,
) -> None:
    topic, group = f"leave-{uuid.uuid4().hex[:6]}", f"leave-{uuid.uuid4().hex[:6]}"
    ensure_topics(KafkaConfig(bootstrap_servers=broker.bootstrap), {topic: 3})
    first = _consumer(broker.bootstrap, topic, group)
    assert _poll_until_assigned(first, 60) is not None
    # `first` stops polling (its engine died); `second` joins, which starts a rebalance that
    # waits for `first` to rejoin.
    second = _consumer(broker.bootstrap, topic, group)
    joined: list[float | None] = []
    joiner = threading.Thread(target=lambda: joined.append(_poll_until_assigned(second, 60)))
    joiner.start()
    try:
        deadline = time.monotonic() + 30
        while not first._coordinator.rejoin_needed and time.monotonic() < deadline:
            time.sleep(0.1)
        assert first._coordinator.rejoin_needed, "the broker never asked the first member to rejoin"
        close_consumer(first, 5000)
        joiner.join(70)
        assert joined and joined[0] is not None, "the second member was never assigned"
        assert sorted(tp.partition for tp in second.assignment()) == [0, 1, 2]
        # About the session timeout plus a join round; far from the 60 s a wedge would take.
        assert joined[0] < 40, joined
    finally:
        joiner.join(70)
        second.close(False, 5000)
