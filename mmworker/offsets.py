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
    uncommitted: list[int] = field(default_factory=list)  # done, contiguous, not yet committed
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
                state.uncommitted.append(head)
                state.next_commit = head + 1
            return True

    def uncommitted(self) -> int:
        """Jobs answered but not yet covered by a commit (redelivered after a crash), whether
        committable now or finished behind a still-running one."""
        with self._lock:
            return sum(len(s.uncommitted) + len(s.finished) for s in self._parts.values())

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
                state = self._parts.get(tp)
                if state is not None:
                    state.committed = offset
                    state.uncommitted = [o for o in state.uncommitted if o >= offset]

    def lag_bases(self) -> dict[TopicPartition, int]:
        """Per partition, the offset lag counts from: the last commit, or before the first one
        the lowest offset seen (where the group's last commit left it)."""
        with self._lock:
            bases = {}
            for tp, s in self._parts.items():
                seen = [*s.uncommitted[:1], *s.pending[:1], *sorted(s.finished)[:1]]
                base = s.committed if s.committed is not None else min(seen, default=None)
                if base is not None:
                    bases[tp] = base
            return bases

    def forget(self, tps: list[TopicPartition]) -> None:
        """Drop partitions we no longer own; their late completions are ignored."""
        with self._lock:
            for tp in tps:
                self._parts.pop(tp, None)
