"""The partitions this worker owns, and which of them it fetches from now.

kafka-python tells of rebalances through callbacks it runs inside poll(), on its network thread
(`kafka_io.RebalanceListener`): the revoked partitions' finished jobs are committed there
(`checkpoints.Checkpoints.commit_revoked`), and revoked or lost partitions' jobs are given up:
their next owner redoes them. New partitions start paused until the suspects topic is read
(`check_suspects`); after that, flow control (`flow`) decides what is fetched.

Threads: `on_revoked`, `on_lost` and `on_assigned` run on kafka-python's network thread,
inside poll(); `fetch_only` and `check_suspects` on the Kafka thread (the one that polls), so
none of them runs while another does."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from kafka.errors import IllegalStateError

from mmworker.checkpoints import Checkpoints
from mmworker.flow import FlowLimits, Plan, plan_pauses
from mmworker.kafka_io import (
    RebalanceListener,
    ask_end_offsets,
    end_offsets_answered,
    may_have_records,
    queued_answers,
    unparsed_highwater,
)
from mmworker.offsets import TopicPartition
from mmworker.suspects import Suspects

#: The worker's own name, whichever of its parts logs: operators filter its lines on it.
log = logging.getLogger("mmworker.worker")

#: How often, at most, the partitions whose news is stuck in the fetcher's queue are asked for
#: their end offsets (`Partitions._waiting`), and how long one ask may wait for its answer (on
#: kafka-python's network thread: nothing waits for it meanwhile).
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_MS = 5000


class Partitions:
    def __init__(
        self, consumer: Any, checkpoints: Checkpoints,
        give_up: Callable[[list[TopicPartition]], None], limits: FlowLimits,
        backfill_topic: str | None,
    ) -> None:  # fmt: skip
        """`give_up`: forget the partitions' offsets and cancel their jobs (called on the
        network thread)."""
        self._consumer = consumer
        self._checkpoints = checkpoints
        self._give_up = give_up
        self._limits = limits
        self._backfill_topic = backfill_topic
        #: Assigned now: what the lag gauge and /readyz count.
        self.owned: set[Any] = set()
        #: Assigned, and paused until the suspects topic has been read (`check_suspects`).
        self.unchecked: list[Any] = []
        #: End offsets asked of the broker (`_waiting`), when they were last asked, and the
        #: ask not answered yet.
        self._ends: dict[Any, int] = {}
        self._asked_at = -PROBE_INTERVAL_S
        self._asking: Any = None

    def listener(self) -> RebalanceListener:
        return RebalanceListener(self.on_revoked, self.on_lost, self.on_assigned)

    async def on_revoked(self, revoked: list[TopicPartition]) -> None:
        """Commit what is done for the partitions we give up, then stop their jobs: the next
        owner redoes them. kafka-python's network thread awaits this."""
        committed: dict[TopicPartition, int] = {}
        try:
            committed = await self._checkpoints.commit_revoked(revoked)
        finally:
            self.owned.difference_update(revoked)
            self._give_up(revoked)
        log.info("revoked %s (committed %s)", revoked, committed)

    def on_lost(self, lost: list[TopicPartition]) -> None:
        """Membership is gone: another worker owns these now, so commit nothing."""
        self.owned.difference_update(lost)
        self._give_up(lost)
        log.warning("lost %s", lost)

    def on_assigned(self, assigned: list[Any]) -> None:
        """New partitions start paused, before this same poll fetches from them: the worker may
        be full (a cooperative rebalance adds partitions to a running assignment), and a
        partition may come from a worker whose engine just died, so the suspects topic is read
        first. That read blocks, so it happens after poll() returns (`check_suspects`), not
        here on kafka-python's network thread, where it would hold up heartbeats."""
        self.owned.update(assigned)
        if assigned:
            self._consumer.pause(*assigned)
            self.unchecked.extend(assigned)

    def check_suspects(self, suspects: Suspects) -> None:
        """Read the suspects topic for the partitions just assigned; the next `fetch_only` then
        resumes them."""
        checked = list(self.unchecked)
        suspects.refresh()
        self.unchecked = [tp for tp in self.unchecked if tp not in checked]

    def fetch_only(
        self, full: bool, live: Mapping[tuple[str, int], int], last_live: float
    ) -> Plan | None:
        """Pause exactly the partitions that should not be fetched now: all of them while the
        worker is `full` (then no plan is made: None), else those `flow.plan_pauses` names;
        and the unchecked ones either way. `live`: jobs in flight per partition; `last_live`:
        when a live job last started (monotonic)."""
        owned = self._consumer.assignment()
        plan = None
        if full:
            want = set(owned)
        else:
            waiting = self._waiting(owned)
            since_live = time.monotonic() - last_live
            plan = plan_pauses(owned, waiting, live, self._limits, self._backfill_topic, since_live)
            want = set(plan.pause)
        want.update(tp for tp in self.unchecked if tp in owned)  # until suspects are read
        now = self._consumer.paused()
        if want - now:
            self._consumer.pause(*(want - now))
        if (now - want) & owned:
            self._consumer.resume(*((now - want) & owned))
        return plan

    def _waiting(self, owned: set[Any]) -> list[Any]:
        """The owned partitions that may have records not handed out yet.

        What the fetcher knows of a partition can be old: after a stall (the worker frozen,
        the Kafka thread held up) the first fetch response brings one partition's new records
        together with the others' answers from before they filled, saying "empty". Queued
        behind the first partition's batch, those answers keep their partitions from being
        fetched again until the batch is drained, so fair shares see one partition waiting and
        hand it the whole worker (tests/unit/test_worker_fairness.py, the stall). While some
        partition has records and others have only such a queued answer, their end offsets
        are asked of the broker, at most once a `PROBE_INTERVAL_S`; the answer counts from the
        first call after it came."""
        if self._asking is not None and (answer := end_offsets_answered(self._asking)) is not None:
            self._asking = None
            self._ends.update(answer)
        marks = unparsed_highwater(self._consumer)
        self._ends = {tp: end for tp, end in self._ends.items() if tp in owned}
        for tp, end in self._ends.items():
            marks[tp] = max(marks.get(tp, end), end)
        waiting = [tp for tp in owned if self._may_have_records(tp, marks)]
        now = time.monotonic()
        if waiting and self._asking is None and now - self._asked_at >= PROBE_INTERVAL_S:
            stuck = queued_answers(self._consumer)
            queued = [tp for tp in owned if tp in stuck and tp not in waiting]
            if queued:
                self._asked_at = now
                self._asking = ask_end_offsets(self._consumer, queued, PROBE_TIMEOUT_MS)
        return waiting

    def _may_have_records(self, tp: Any, marks: dict[Any, int]) -> bool:
        try:
            return may_have_records(self._consumer, tp, marks)
        except IllegalStateError:  # revoked meanwhile
            return False
