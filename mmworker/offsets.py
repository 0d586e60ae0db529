"""Per-partition offset bookkeeping for at-least-once delivery with out-of-order completion.

Jobs finish in any order (a small image overtakes a long video), but Kafka commits one offset per
partition meaning "everything before this is done". So the committable offset is the lowest offset
still in flight, or one past the highest finished offset when nothing is in flight. An offset is
marked done only after its result or failure has been acknowledged by the broker.
"""

from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass, field
from typing import NamedTuple


class TopicPartition(NamedTuple):
    """Same shape as kafka-python's TopicPartition, so either can be used as a key."""

    topic: str
    partition: int


@dataclass
class _PartitionState:
    pending: list[int] = field(default_factory=list)  # min-heap of offsets in flight
    finished: set[int] = field(default_factory=set)  # done but behind a pending offset
    next_commit: int | None = None  # offset to commit (next to consume); None: nothing yet
    committed: int | None = None  # last offset we committed


class OffsetTracker:
    """Thread-safe: jobs finish on the event loop, rebalance callbacks run on the Kafka thread."""

    def __init__(self) -> None:
        self._parts: dict[TopicPartition, _PartitionState] = {}
        self._lock = threading.Lock()

    def track(self, tp: TopicPartition, offset: int) -> None:
        with self._lock:
            state = self._parts.setdefault(tp, _PartitionState())
            heapq.heappush(state.pending, offset)

    def done(self, tp: TopicPartition, offset: int) -> bool:
        """Mark an offset finished; False when its partition was revoked meanwhile."""
        with self._lock:
            state = self._parts.get(tp)
            if state is None:
                return False
            state.finished.add(offset)
            while state.pending and state.pending[0] in state.finished:
                head = heapq.heappop(state.pending)
                state.finished.discard(head)
                state.next_commit = head + 1
            return True

    def in_flight(self) -> int:
        with self._lock:
            return sum(len(s.pending) for s in self._parts.values())

    def in_flight_for(self, tps: list[TopicPartition]) -> int:
        with self._lock:
            return sum(len(self._parts[tp].pending) for tp in tps if tp in self._parts)

    def to_commit(self, tps: list[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Offsets that advanced since the last commit (the caller commits, then confirms)."""
        with self._lock:
            items = (
                self._parts.items()
                if tps is None
                else [(tp, self._parts[tp]) for tp in tps if tp in self._parts]
            )
            return {
                tp: s.next_commit
                for tp, s in items
                if s.next_commit is not None and s.next_commit != s.committed
            }

    def committed(self, offsets: dict[TopicPartition, int]) -> None:
        with self._lock:
            for tp, offset in offsets.items():
                if tp in self._parts:
                    self._parts[tp].committed = offset

    def forget(self, tps: list[TopicPartition]) -> None:
        """Drop partitions we no longer own; their late completions are ignored."""
        with self._lock:
            for tp in tps:
                self._parts.pop(tp, None)

    def owned(self) -> list[TopicPartition]:
        with self._lock:
            return list(self._parts)
