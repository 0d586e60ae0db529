"""`partitions.Partitions._waiting`: which partitions may have records, when what the fetcher
knows of some is an old answer stuck in its queue (the broker-level case, a worker woken from a
stall, is in tests/unit/test_worker_fairness.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from kafka.errors import KafkaTimeoutError

from mmworker import partitions as partitions_module
from mmworker.checkpoints import Checkpoints
from mmworker.flow import FlowLimits
from mmworker.offsets import TopicPartition
from mmworker.partitions import PROBE_INTERVAL_S, Partitions

P0, P1, P2 = (TopicPartition("jobs", p) for p in range(3))


class Consumer:
    """What `_waiting` reads of kafka-python's consumer: fetched high-water marks, positions,
    the fetcher's queue of unparsed answers, and `end_offsets`."""

    def __init__(self, known: dict[Any, int], positions: dict[Any, int]) -> None:
        self.known = known
        self.positions = positions
        self.ends: dict[Any, int] = {}
        self.asked: list[list[Any]] = []
        self.error: Exception | None = None
        self._fetcher = SimpleNamespace(_completed_fetches=[], _paused_completed_fetches={})
        self._subscription = SimpleNamespace(
            position=lambda tp: SimpleNamespace(offset=self.positions[tp])
        )

    def queue(self, tp: Any, high: int) -> None:
        """An answer for `tp` the fetcher holds but has not parsed: "high-water mark `high`"."""
        data = SimpleNamespace(high_watermark=high)
        self._fetcher._completed_fetches.append(
            SimpleNamespace(topic_partition=tp, partition_data=data)
        )

    def highwater(self, tp: Any) -> int | None:
        return self.known.get(tp)

    def end_offsets(self, tps: list[Any], timeout_ms: int) -> dict[Any, int]:
        self.asked.append(sorted(tps))
        if self.error is not None:
            raise self.error
        return {tp: self.ends[tp] for tp in tps}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(partitions_module.time, "monotonic", lambda: now[0])
    return now


def owner(consumer: Consumer) -> Partitions:
    limits = FlowLimits(max_in_flight=64, backfill_cap=32, backfill_beside_live=4, live_idle_s=5)
    return Partitions(consumer, Checkpoints.__new__(Checkpoints), lambda tps: None, limits, None)


def woken() -> Consumer:
    """Partition 0's new records fetched; 1 and 2 answered "empty" before they filled (their
    answers queued behind 0's batch), and since then 1 has 100 records, 2 none."""
    consumer = Consumer(known={P0: 101, P1: 1, P2: 1}, positions={P0: 1, P1: 1, P2: 1})
    consumer.queue(P1, 1)
    consumer.queue(P2, 1)
    consumer.ends = {P1: 101, P2: 1}
    return consumer


def test_partitions_behind_a_stuck_answer_are_asked_for_their_end_offsets(
    clock: list[float],
) -> None:
    consumer = woken()
    assert sorted(owner(consumer)._waiting({P0, P1, P2})) == [P0, P1]
    assert consumer.asked == [[P1, P2]]


def test_the_broker_is_asked_at_most_once_an_interval_and_its_answer_kept(
    clock: list[float],
) -> None:
    consumer = woken()
    parts = owner(consumer)
    parts._waiting({P0, P1, P2})
    consumer.ends[P2] = 50  # filled since: not known until the next ask
    clock[0] += PROBE_INTERVAL_S / 2
    assert sorted(parts._waiting({P0, P1, P2})) == [P0, P1]  # the kept answer for 1
    assert len(consumer.asked) == 1
    clock[0] += PROBE_INTERVAL_S / 2
    assert sorted(parts._waiting({P0, P1, P2})) == [P0, P1, P2]
    assert consumer.asked == [[P1, P2], [P2]]  # 1 is waiting already: not asked again


def test_once_the_queue_is_parsed_nothing_more_is_asked(clock: list[float]) -> None:
    """A busy partition beside idle ones: their answers, once parsed, are news again."""
    consumer = woken()
    consumer.ends[P1] = 1  # 1 stayed empty too
    parts = owner(consumer)
    assert parts._waiting({P0, P1, P2}) == [P0]
    consumer._fetcher._completed_fetches.clear()
    for _ in range(3):
        clock[0] += PROBE_INTERVAL_S
        assert parts._waiting({P0, P1, P2}) == [P0]
    assert consumer.asked == [[P1, P2]]


def test_nothing_is_asked_while_no_partition_has_records_ahead_of_the_queue(
    clock: list[float],
) -> None:
    """With nothing waiting, the next poll parses the queued answers and fetches again."""
    consumer = woken()
    consumer.known[P0] = 1
    assert owner(consumer)._waiting({P0, P1, P2}) == []
    consumer._fetcher._completed_fetches.clear()
    consumer.known[P0] = 101
    assert owner(consumer)._waiting({P0, P1, P2}) == [P0]
    assert consumer.asked == []


def test_a_broker_that_does_not_answer_leaves_the_fetchers_view(clock: list[float]) -> None:
    consumer = woken()
    consumer.error = KafkaTimeoutError("no answer in 200 ms")
    assert owner(consumer)._waiting({P0, P1, P2}) == [P0]
    assert consumer.asked == [[P1, P2]]


def test_the_answers_of_partitions_given_up_are_forgotten(clock: list[float]) -> None:
    consumer = woken()
    parts = owner(consumer)
    parts._waiting({P0, P1, P2})
    consumer.positions[P1] = 0  # owned again later, from an older commit
    consumer._fetcher._completed_fetches.clear()
    assert parts._waiting({P0, P2}) == [P0]
    assert P1 not in parts._ends
