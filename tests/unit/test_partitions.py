"""`partitions.Partitions._waiting`: which partitions may have records, when what the fetcher
knows of some is an old answer stuck in its queue (the broker-level case, a worker woken from a
stall, is in tests/unit/test_worker_fairness.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from kafka.errors import KafkaTimeoutError
from kafka.future import Future
from kafka.structs import OffsetAndTimestamp

from mmworker import partitions as partitions_module
from mmworker.checkpoints import Checkpoints
from mmworker.flow import FlowLimits
from mmworker.offsets import TopicPartition
from mmworker.partitions import PROBE_INTERVAL_S, Partitions

P0, P1, P2 = (TopicPartition("jobs", p) for p in range(3))


class Consumer:
    """What `_waiting` reads of kafka-python's consumer: fetched high-water marks, positions,
    the fetcher's queue of unparsed answers, and the ListOffsets requests its network thread
    sends (`kafka_io.ask_end_offsets`), answered at once unless `hold` is set."""

    def __init__(self, known: dict[Any, int], positions: dict[Any, int]) -> None:
        self.known = known
        self.positions = positions
        self.ends: dict[Any, int] = {}
        self.asked: list[list[Any]] = []
        self.error: Exception | None = None
        self.hold = False
        self.pending: list[tuple[Future, list[Any]]] = []
        self._fetcher = SimpleNamespace(
            _completed_fetches=[], _paused_completed_fetches={},
            _manager=SimpleNamespace(call_soon=self._call_soon),
            _fetch_offsets_by_times_async=object(),
        )  # fmt: skip
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

    def _call_soon(self, fn: Any, latest: dict[Any, int], timeout_ms: int) -> Future:
        assert fn is self._fetcher._fetch_offsets_by_times_async
        asked = sorted(latest)
        self.asked.append(asked)
        future = Future()
        self.pending.append((future, asked))
        if not self.hold:
            self.answer()
        return future

    def answer(self) -> None:
        for future, asked in self.pending:
            if self.error is not None:
                future.failure(self.error)
            else:  # a partition whose leader is unknown is left out of the answer
                future.success({tp: OffsetAndTimestamp(self.ends[tp], -1, -1)
                                for tp in asked if tp in self.ends})  # fmt: skip
        self.pending.clear()


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
    consumer.hold = True
    parts = owner(consumer)
    assert parts._waiting({P0, P1, P2}) == [P0]  # asked; the poll goes on meanwhile
    assert consumer.asked == [[P1, P2]]
    assert parts._waiting({P0, P1, P2}) == [P0]  # not answered yet, not asked again
    consumer.answer()
    assert sorted(parts._waiting({P0, P1, P2})) == [P0, P1]
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
    assert sorted(parts._waiting({P0, P1, P2})) == [P0, P1]  # asked again, for 2 only
    assert consumer.asked == [[P1, P2], [P2]]
    assert sorted(parts._waiting({P0, P1, P2})) == [P0, P1, P2]


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


def test_answers_set_aside_for_paused_partitions_call_for_no_ask(clock: list[float]) -> None:
    """A paused partition's answer waits for it to resume (the backfill lane, paused while live
    partitions have records): asking for it would change nothing, every second."""
    consumer = woken()
    consumer._fetcher._completed_fetches.clear()
    consumer._fetcher._paused_completed_fetches = {
        P1: SimpleNamespace(topic_partition=P1, partition_data=SimpleNamespace(high_watermark=1))
    }
    assert owner(consumer)._waiting({P0, P1, P2}) == [P0]
    assert consumer.asked == []


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


def test_a_failed_or_partial_answer_leaves_the_fetchers_view(clock: list[float]) -> None:
    """A broker that does not answer in time, or a partition whose leader is unknown (left out
    of the answer: kafka-python's own `end_offsets` raised KeyError there)."""
    consumer = woken()
    consumer.error = KafkaTimeoutError("no answer in 5000 ms")
    parts = owner(consumer)
    assert parts._waiting({P0, P1, P2}) == [P0]
    assert parts._waiting({P0, P1, P2}) == [P0]
    consumer.error = None
    del consumer.ends[P1]
    clock[0] += PROBE_INTERVAL_S
    assert parts._waiting({P0, P1, P2}) == [P0]
    assert parts._waiting({P0, P1, P2}) == [P0]
    assert consumer.asked == [[P1, P2], [P1, P2]]


def test_the_answers_of_partitions_given_up_are_forgotten(clock: list[float]) -> None:
    consumer = woken()
    parts = owner(consumer)
    parts._waiting({P0, P1, P2})
    assert sorted(parts._waiting({P0, P1, P2})) == [P0, P1]
    assert parts._waiting({P0, P2}) == [P0]
    assert P1 not in parts._ends
