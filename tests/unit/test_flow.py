"""Flow control's decision on plain values: which partitions not to fetch, and how many records a
poll may take (mmworker.flow). The worker applying it against the real broker and client:
test_worker_fairness.py, test_worker_lanes.py."""

from __future__ import annotations

import math

from mmworker.flow import FlowLimits, plan_pauses, still_full
from mmworker.offsets import TopicPartition

LIVE, BACKFILL = "jobs", "jobs.backfill"
L0, L1, L2, L3 = (TopicPartition(LIVE, p) for p in range(4))
B0, B1 = TopicPartition(BACKFILL, 0), TopicPartition(BACKFILL, 1)
#: No live job ever started.
NEVER = math.inf


def _limits(max_in_flight: int = 32, backfill_cap: int = 16, beside_live: int = 3) -> FlowLimits:
    return FlowLimits(max_in_flight, backfill_cap, beside_live, live_idle_s=5.0)


def _held(**per: int) -> dict[tuple[str, int], int]:
    """Jobs in flight by partition name: l0=3 is 3 jobs of live partition 0, b1 of backfill 1."""
    topics = {"l": LIVE, "b": BACKFILL}
    return {(topics[name[0]], int(name[1:])): n for name, n in per.items()}


def test_full_at_the_limit_and_free_again_only_at_half() -> None:
    assert not still_full(False, held=31, limit=32)
    assert still_full(False, held=32, limit=32)
    assert still_full(True, held=17, limit=32)  # below the limit, not yet down to half
    assert not still_full(True, held=16, limit=32)
    assert not still_full(False, held=17, limit=32)  # not full: the way up has no lag


def test_one_partition_waiting_gets_the_whole_worker_a_share_at_a_time() -> None:
    owned = [L0, L1, L2, L3]
    plan = plan_pauses(owned, [L0], _held(l0=20), _limits(), None, NEVER)
    assert plan.pause == frozenset()  # never paused for holding more than a share alone
    # The others' responses may be a fetch behind: one poll takes one fetchable partition's part.
    assert plan.share == 32 // 4


def test_a_partition_holding_its_share_is_paused_while_another_waiting_holds_less() -> None:
    owned = [L0, L1, L2, L3]
    plan = plan_pauses(owned, [L0, L1], _held(l0=16, l1=2), _limits(), None, NEVER)
    assert plan.pause == {L0}
    assert plan.share == 8


def test_no_partition_is_paused_when_every_waiting_one_holds_its_share() -> None:
    owned = [L0, L1]
    plan = plan_pauses(owned, [L0, L1], _held(l0=16, l1=20), _limits(), None, NEVER)
    assert plan.pause == frozenset()
    assert plan.share == 16


def test_backfill_is_paused_while_a_live_partition_has_records_waiting() -> None:
    owned = [L0, B0, B1]
    plan = plan_pauses(owned, [L0, B0], {}, _limits(), BACKFILL, NEVER)
    assert plan.pause == {B0, B1}
    assert plan.share == 32  # the live partition, the only one left to fetch, gets it all


def test_quiet_backfill_takes_its_share_and_no_more() -> None:
    owned = [L0, B0, B1]
    below = plan_pauses(owned, [B0, B1], _held(b0=5, b1=5), _limits(), BACKFILL, NEVER)
    assert below.pause == frozenset()
    assert below.share == 6  # what the lane's cap (16) leaves: a poll takes no more
    at_cap = plan_pauses(owned, [B0, B1], _held(b0=8, b1=8), _limits(), BACKFILL, NEVER)
    assert at_cap.pause == {B0, B1}


def test_beside_recent_live_traffic_backfill_holds_only_backfill_beside_live() -> None:
    owned = [L0, B0]
    recent = plan_pauses(owned, [B0], _held(b0=2), _limits(), BACKFILL, since_live_s=1.0)
    assert recent.pause == frozenset() and recent.share == 1  # room for 3 - 2
    full = plan_pauses(owned, [B0], _held(b0=3), _limits(), BACKFILL, since_live_s=1.0)
    assert full.pause == {B0}
    # A live job in flight counts as recent traffic, however long ago it started.
    running = plan_pauses(owned, [B0], _held(b0=3, l0=1), _limits(), BACKFILL, NEVER)
    assert running.pause == {B0}
    # Quiet for live_idle_s: the lane's own cap again.
    quiet = plan_pauses(owned, [B0], _held(b0=3), _limits(), BACKFILL, since_live_s=6.0)
    assert quiet.pause == frozenset() and quiet.share == 13


def test_backfill_beside_live_never_raises_the_lane_above_its_share() -> None:
    owned = [B0]
    small = _limits(max_in_flight=4, backfill_cap=2, beside_live=10)
    plan = plan_pauses(owned, [B0], _held(b0=1), small, BACKFILL, since_live_s=0.0)
    assert plan.pause == frozenset() and plan.share == 1
    assert plan_pauses(owned, [B0], _held(b0=2), small, BACKFILL, 0.0).pause == {B0}


def test_a_poll_may_always_take_one_record() -> None:
    owned = [L0, L1, L2, L3]
    plan = plan_pauses(owned, [L0, L1], _held(l0=40, l1=40), _limits(max_in_flight=2), None, NEVER)
    assert plan.share == 1


def test_kafka_pythons_partitions_and_ours_are_the_same_keys() -> None:
    from kafka.structs import TopicPartition as KafkaTP

    owned = [KafkaTP(LIVE, 0), KafkaTP(LIVE, 1)]
    plan = plan_pauses(owned, owned, _held(l0=16, l1=1), _limits(), None, NEVER)
    assert plan.pause == {KafkaTP(LIVE, 0)}


def test_the_decision_changes_nothing_it_is_given() -> None:
    owned, waiting, live = [L0, L1, B0], [L0, L1, B0], _held(l0=20, l1=1, b0=2)
    before = (list(owned), list(waiting), dict(live))
    first = plan_pauses(owned, waiting, live, _limits(), BACKFILL, 1.0)
    assert plan_pauses(owned, waiting, live, _limits(), BACKFILL, 1.0) == first
    assert (owned, waiting, live) == before


def test_limits_from_the_configuration() -> None:
    from mmworker.config import load_config

    cfg = load_config(limits={"max_in_flight": 10, "backfill_share": 0.25})
    limits = FlowLimits.from_config(cfg.limits)
    assert (limits.max_in_flight, limits.backfill_cap) == (10, 2)
    tiny = load_config(limits={"max_in_flight": 2, "backfill_share": 0.1})
    assert FlowLimits.from_config(tiny.limits).backfill_cap == 1  # at least one
