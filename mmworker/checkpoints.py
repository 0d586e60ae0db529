"""Commits: what the group records as done, so that a restart or another member goes on from it.

An offset is committed only up to the lowest job whose outcome the broker has not acknowledged
(`offsets.OffsetTracker`), each `kafka.commit_interval_s`, for the partitions given up in a
rebalance (the next owner starts from it), and once more at a stop; never after a fatal stop.

Threads: `commit` and `last_commit` run on the event loop, their client calls on the Kafka
thread; `commit_revoked` on kafka-python's network thread, inside poll(); `measure_lag` on the
Kafka thread."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Any, TypeVar

from kafka.errors import IllegalStateError, KafkaError

from mmworker.kafka_io import commit_in_rebalance, commit_payload, poll, rebalance_pending
from mmworker.metrics import Metrics
from mmworker.offsets import OffsetTracker, TopicPartition
from mmworker.stopping import Stopping

#: The worker's own name, whichever of its parts logs: operators filter its lines on it.
log = logging.getLogger("mmworker.worker")

T = TypeVar("T")

#: Deadline of the blocking commit made while giving partitions up.
REVOKE_COMMIT_TIMEOUT_MS = 10_000
#: A stop that falls into a rebalance waits this long for the group to settle, so that its
#: answered jobs can be committed (two cooperative rounds took 5-6 s on the test broker).
REJOIN_TIMEOUT_S = 15.0


class Checkpoints:
    def __init__(
        self, consumer: Any, tracker: OffsetTracker, metrics: Metrics, stopping: Stopping,
        kafka_thread: Executor,
    ) -> None:  # fmt: skip
        """`kafka_thread`: the one thread every call of `consumer` is made on."""
        self._consumer = consumer
        self._tracker = tracker
        self._metrics = metrics
        self._stopping = stopping
        self._kafka_thread = kafka_thread

    async def commit(self) -> bool:
        """False when there was something to commit and the broker refused it."""
        if self._stopping.error is not None:
            return True
        offsets = self._tracker.to_commit()
        if not offsets:
            return True
        try:
            await self._on_kafka(self._consumer.commit, commit_payload(offsets))
        except KafkaError as exc:  # RebalanceInProgress, CommitFailed: the next round retries
            self._metrics.commit_errors.inc()
            log.info("commit deferred: %s", exc)
            return False
        self._tracker.committed(offsets)
        self._metrics.commits.inc()
        self._metrics.last_commit.set_to_current_time()
        return True

    async def last_commit(self) -> None:
        """The stop's commit, with one more round if a rebalance refused it.

        A worker asked to stop while the group rebalances (another member just joined or left)
        gets RebalanceInProgress; there is no next round, so its answered jobs would be redone
        by the next owner. Polling with every partition paused takes part in the rebalance
        (the revoke callback commits what it gives up; new partitions arrive paused) without
        taking records, and the commit is tried again once the group is settled."""
        if await self.commit():
            return
        consumer = self._consumer
        deadline = time.monotonic() + REJOIN_TIMEOUT_S
        while time.monotonic() < deadline and self._tracker.to_commit():
            await self._on_kafka(lambda: consumer.pause(*consumer.assignment()))
            await self._on_kafka(poll, consumer, 200, 1)
            settled = not await self._on_kafka(rebalance_pending, consumer)
            if settled and await self.commit():
                return
        if self._tracker.to_commit():  # empty: revoked (and committed there) or lost meanwhile
            log.warning("stop: the final commit did not land; answered jobs will be redone")

    async def commit_revoked(self, revoked: list[TopicPartition]) -> dict[TopicPartition, int]:
        """Commit what is done on the partitions given up, synchronously, with a deadline (the
        next owner starts from it; kafka-python's network thread, which awaits this, must not
        be held longer: heartbeats wait on it). Returns what was committed: nothing when the
        broker did not answer in time, or after a fatal stop."""
        offsets = self._tracker.to_commit(revoked) if self._stopping.error is None else {}
        try:
            if offsets:
                await commit_in_rebalance(self._consumer, offsets, REVOKE_COMMIT_TIMEOUT_MS)
                self._tracker.committed(offsets)
        except KafkaError as exc:
            self._metrics.commit_errors.inc()
            log.warning("commit on revoke failed (%s): those jobs will be redone", exc)
            return {}
        return offsets

    def measure_lag(self, owned: Iterable[Any]) -> None:
        """Per-partition lag: the high-water mark the last fetch brought back (no request of its
        own) minus this worker's last commit (`OffsetTracker.lag_bases`). A partition without
        a known mark yet (nothing fetched) or revoked meanwhile is left out."""
        bases = self._tracker.lag_bases()
        lag: dict[tuple[str, str], float] = {}
        for tp in list(owned):
            base = bases.get(TopicPartition(tp.topic, tp.partition))
            try:
                high = self._consumer.highwater(tp)
            except IllegalStateError:  # revoked between the listing and the read
                continue
            if high is not None and base is not None:
                lag[(tp.topic, str(tp.partition))] = max(0, high - base)
        self._metrics.set_consumer_lag(lag)

    async def _on_kafka(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._kafka_thread, lambda: fn(*args))
