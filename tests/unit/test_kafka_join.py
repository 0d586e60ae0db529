"""A group join that ends between two polls is kept, on the real broker with the real client.

kafka-python 3.0.12 throws such a round away and sends a new JoinGroup, so a member whose
polls are short next to a join (the worker's are 200 ms; a join waits seconds for the other
members) can rejoin round after round. `kafka_io.keep_finished_joins` takes the finished
round's assignment instead. Without it this test's member did not settle within its deadline
(checked by hand)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from kafka import KafkaConsumer
from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor

from mmworker.config import load_config
from mmworker.devkit.broker import EmbeddedBroker
from mmworker.kafka_io import ensure_topics, keep_finished_joins, make_consumer, rebalance_pending
from tests.conftest import GROUP_SETTINGS

#: Each poll is far shorter than the gap after it, so a join round almost always ends while no
#: poll waits for it: the case the library mishandles.
POLL_MS = 20
GAP_S = 1.0


@pytest.mark.timeout(120)
def test_a_join_that_ends_between_polls_settles_the_group(broker: EmbeddedBroker) -> None:
    tag = uuid.uuid4().hex[:6]
    cfg = load_config(
        kafka={"bootstrap_servers": broker.bootstrap, "group_id": f"join-{tag}",
               "input_topic": f"join-{tag}.in", **GROUP_SETTINGS},
    )  # fmt: skip
    topic = cfg.kafka.input_topic
    ensure_topics(cfg.kafka, {topic: 2})

    member = make_consumer(cfg.kafka)
    member.subscribe([topic])
    deadline = time.monotonic() + 30
    while len(member.assignment()) < 2 and time.monotonic() < deadline:
        member.poll(200)
    assert len(member.assignment()) == 2, "the first member never got both partitions"

    stop = threading.Event()
    newcomer_owned: list[int] = []

    def newcomer() -> None:  # polls back to back: its joins are always awaited
        c = KafkaConsumer(
            topic, bootstrap_servers=broker.bootstrap, group_id=cfg.kafka.group_id,
            enable_auto_commit=False, partition_assignment_strategy=[CooperativeStickyAssignor],
            **GROUP_SETTINGS,
        )  # fmt: skip
        keep_finished_joins(c)
        while not stop.is_set():
            c.poll(100)
            newcomer_owned[:] = sorted(tp.partition for tp in c.assignment())
        c.close(autocommit=False)

    joiner = threading.Thread(target=newcomer)
    joiner.start()
    try:
        rounds, settled_after = 0, None
        began = time.monotonic()
        deadline = began + 40
        while time.monotonic() < deadline:
            member.poll(POLL_MS)
            rounds += 1
            mine = sorted(tp.partition for tp in member.assignment())
            if (len(mine) == 1 and len(newcomer_owned) == 1 and mine != newcomer_owned
                    and not rebalance_pending(member)):  # fmt: skip
                settled_after = time.monotonic() - began
                break
            time.sleep(GAP_S)
        assert settled_after is not None, (
            f"no settled split after {rounds} polls: member owns "
            f"{sorted(tp.partition for tp in member.assignment())}, newcomer {newcomer_owned}, "
            f"rebalance pending {rebalance_pending(member)}"
        )
    finally:
        stop.set()
        joiner.join()
        member.close(autocommit=False)
