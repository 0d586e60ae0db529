"""A worker that stops while a rebalance waits for it must not wedge its consumer group.

On the Tansu broker a LeaveGroup sent by a member that has not rejoined a pending rebalance
leaves the members that did rejoin without an answer, for good (a CI run lost a whole test to
it: one worker died of an engine crash just as the other joined). `close_consumer` skips the
LeaveGroup in that state; the session timeout then frees the group, as on Apache Kafka. A member
learns of the rebalance only from its next heartbeat, so `close_consumer` sends one first: the
second test closes inside that window, with kafka-python's own close as the control.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import pytest
from kafka import KafkaConsumer
from kafka.coordinator.base import MemberState

from mmworker.config import KafkaConfig
from mmworker.devkit.broker import EmbeddedBroker
from mmworker.kafka_io import close_consumer, ensure_topics, heartbeat_now

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


def _assigned_member(broker: EmbeddedBroker, prefix: str, partitions: int) -> KafkaConsumer:
    """The first member of a new group on a new topic, once it holds every partition."""
    topic, group = f"{prefix}-{uuid.uuid4().hex[:6]}", f"{prefix}-{uuid.uuid4().hex[:6]}"
    ensure_topics(KafkaConfig(bootstrap_servers=broker.bootstrap), {topic: partitions})
    member = _consumer(broker.bootstrap, topic, group)
    assert _poll_until_assigned(member, 60) is not None
    return member


def _second(first: KafkaConsumer) -> KafkaConsumer:
    """Another member for `first`'s group and topic."""
    (topic,) = first.subscription()
    return _consumer(first.config["bootstrap_servers"], topic, first.config["group_id"])


@pytest.mark.timeout(120)
def test_a_member_stopping_during_a_pending_rebalance_does_not_wedge_the_group(
    broker: EmbeddedBroker,
) -> None:
    first = _assigned_member(broker, "leave", 3)
    # `first` stops polling (its engine died); `second` joins, which starts a rebalance that
    # waits for `first` to rejoin.
    second = _second(first)
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


def _join_and_close_unseen(
    broker: EmbeddedBroker, close: Callable[[KafkaConsumer], None]
) -> float | None:
    """`first` holds the group with its heartbeats paused (the interval between two of them);
    `second` joins, which starts a rebalance `first` has not heard of; `first` closes with
    `close`. How long `second` then waited for its assignment (None: not within 25 s)."""
    first = _assigned_member(broker, "unseen", 3)
    first._coordinator._disable_heartbeat()
    time.sleep(0.5)  # a heartbeat already in flight comes back
    second = _second(first)
    joined: list[float | None] = []
    joiner = threading.Thread(target=lambda: joined.append(_poll_until_assigned(second, 25)))
    joiner.start()
    try:
        deadline = time.monotonic() + 10
        while second._coordinator.state != MemberState.REBALANCING and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # its JoinGroup reaches the coordinator (0.3 s was tight on a busy host)
        assert not first._coordinator.rejoin_needed, "the first member heard of the rebalance"
        close(first)
        joiner.join(40)
        return joined[0] if joined else None
    finally:
        joiner.join(40)
        second.close(False, 5000)


@pytest.mark.timeout(180)
def test_a_member_stopping_before_its_heartbeat_hears_of_the_rebalance_does_not_wedge_it(
    broker: EmbeddedBroker,
) -> None:
    # Control: kafka-python's close sends the LeaveGroup and the group never settles.
    assert _join_and_close_unseen(broker, lambda c: c.close(False, 5000)) is None
    waited = _join_and_close_unseen(broker, lambda c: close_consumer(c, 5000))
    # About the session timeout plus a join round.
    assert waited is not None and waited < 20, waited


def test_a_heartbeat_now_tells_whether_the_coordinator_answers(broker: EmbeddedBroker) -> None:
    member = _assigned_member(broker, "beat", 1)
    try:
        assert heartbeat_now(member, 2000)
        assert not member._coordinator.rejoin_needed
    finally:
        member.close(False, 5000)
