"""Flow control as a decision on plain values: which partitions not to fetch from, and how many
records one poll may take. No client, clock or state in here, so every rule is testable on its
own (tests/unit/test_flow.py); `partitions.Partitions.fetch_only` applies the decision.

Three rules, in order:

- Backpressure: while the worker holds `max_in_flight` jobs every partition is paused, until it
  holds half (`still_full`); polling goes on meanwhile, so the group keeps its member.
- Lanes: the backfill topic's partitions are paused while a live partition may have records
  waiting, and while backfill jobs hold their share of `max_in_flight` (`limits.backfill_share`;
  the rest stays free for live jobs), or, while live traffic is recent (`limits.live_idle_s`),
  `limits.backfill_beside_live` jobs: every request inside the engine slows each step of a live
  one, and the engine gate only keeps new backfill jobs out while a live one runs
  (`gate.EngineGate.foreground`).
- Fair shares: kafka-python's poll drains one partition's fetched batch before the next one's,
  so a full worker would serve partitions one after another. While several partitions may have
  records waiting (`kafka_io.may_have_records`), each gets an equal share of `max_in_flight`: a
  poll takes at most one share, and a partition holding its share is paused while another one
  waiting holds less. One busy partition alone still gets the whole worker, a poll at a time.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from mmworker.config import LimitsConfig


class Partition(Protocol):
    """kafka-python's TopicPartition or ours (`offsets.TopicPartition`): equal and hashed alike,
    both being (topic, partition) tuples."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...


P = TypeVar("P", bound=Partition)


@dataclass(frozen=True)
class FlowLimits:
    """The settings the decision reads (`limits.*`), with the backfill lane's cap worked out."""

    max_in_flight: int
    #: Most backfill jobs held at once: `max_in_flight * backfill_share`, at least one.
    backfill_cap: int
    backfill_beside_live: int
    live_idle_s: float

    @classmethod
    def from_config(cls, limits: LimitsConfig) -> FlowLimits:
        return cls(
            max_in_flight=limits.max_in_flight,
            backfill_cap=max(1, int(limits.max_in_flight * limits.backfill_share)),
            backfill_beside_live=limits.backfill_beside_live,
            live_idle_s=limits.live_idle_s,
        )


@dataclass(frozen=True)
class Plan:
    """Partitions not to fetch from now, and the most records the next poll may take."""

    pause: frozenset[Partition]
    share: int


def still_full(was_full: bool, held: int, limit: int) -> bool:
    """Full at `limit` held jobs, and until they are down to half: resuming at the first free
    slot would pause and resume every partition at each job's end."""
    if not was_full:
        return held >= limit
    return held > limit // 2


def plan_pauses(
    owned: Collection[P],
    waiting: Collection[P],
    live: Mapping[tuple[str, int], int],
    limits: FlowLimits,
    backfill_topic: str | None,
    since_live_s: float,
) -> Plan:
    """Lanes first, then fair shares (see the module's docstring), for a worker that is not full.

    `owned`: the partitions assigned; `waiting`: those of them that may have records not handed
    out yet; `live`: jobs in flight per (topic, partition); `since_live_s`: seconds since a job
    of a live (not backfill) topic last started."""

    def held(tp: Partition) -> int:
        return live.get((tp.topic, tp.partition), 0)

    pause: set[Partition] = set()
    room = limits.max_in_flight
    if backfill_topic is not None:
        backfill = {tp for tp in owned if tp.topic == backfill_topic}
        live_jobs = sum(n for (topic, _), n in live.items() if topic != backfill_topic)
        live_waiting = any(tp.topic != backfill_topic for tp in waiting)
        recent = live_jobs > 0 or since_live_s < limits.live_idle_s
        cap = min(
            limits.backfill_cap, limits.backfill_beside_live if recent else limits.max_in_flight
        )
        backfill_room = cap - sum(held(tp) for tp in backfill)
        if live_waiting or backfill_room <= 0:
            pause |= backfill
        else:
            room = backfill_room
    candidates = [tp for tp in waiting if tp not in pause]
    share = limits.max_in_flight // max(1, len(candidates))
    # A poll takes no more than one fetchable partition's part even while only one is known
    # to have records: the others' responses may be a fetch behind (a worker waking up to
    # full partitions), and the loop polls again at once if they are not.
    fetchable = sum(1 for tp in owned if tp not in pause)
    poll_share = max(1, min(share, limits.max_in_flight // max(1, fetchable), room))
    if len(candidates) >= 2 and not all(held(tp) >= share for tp in candidates):
        pause |= {tp for tp in candidates if held(tp) >= share}
    return Plan(frozenset(pause), poll_share)
