"""The hot loop: poll → start a task per record → publish → mark done → commit.

Many jobs are in flight at once so vLLM's continuous batching always has work; offsets are committed
only up to the lowest job whose output the broker has not yet acknowledged (at-least-once).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kafka.errors import (
    ClusterAuthorizationFailedError,
    InconsistentGroupProtocolError,
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    TopicAuthorizationFailedError,
)

from mmworker.config import WorkerConfig
from mmworker.errors import ConfigError, EngineFatal, PublishRefused, TopicRefused, WorkerError
from mmworker.jobs import JobRunner, Outcome
from mmworker.kafka_io import RebalanceListener, commit_payload, make_consumer, make_producer, send
from mmworker.metrics import Metrics
from mmworker.offsets import OffsetTracker, TopicPartition
from mmworker.records import Context
from schemas import Failure, SourceCoords

log = logging.getLogger(__name__)

EXIT_OK, EXIT_ENGINE_DEAD, EXIT_PUBLISH_REFUSED, EXIT_INTERRUPTED = 0, 3, 4, 130

#: Refusals of one record (its size): the job is dead-lettered and the partition moves on.
RECORD_REFUSALS = (MessageSizeTooLargeError, RecordListTooLargeError)
#: Refusals of a whole topic: every record would fail the same way, so the worker stops. Any
#: other error, retriable or not (kafka-python marks some transient producer errors, such as an
#: idempotent producer's epoch bump, non-retriable), is retried with backoff.
TOPIC_REFUSALS = (TopicAuthorizationFailedError, ClusterAuthorizationFailedError, InvalidTopicError)


class Worker:
    def __init__(self, cfg: WorkerConfig, runner: JobRunner, metrics: Metrics, model: str) -> None:
        self._cfg = cfg
        self._runner = runner
        self._metrics = metrics
        self._model = model
        self.tracker = OffsetTracker()
        self._kafka = ThreadPoolExecutor(1, thread_name_prefix="kafka")  # the consumer's one thread
        self._consumer: Any = None
        self._producer: Any = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self._fatal: WorkerError | None = None
        self._paused = False
        self.exit_code = EXIT_OK

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._install_signals(loop)
        k = self._cfg.kafka
        self._producer = make_producer(k)
        self._consumer = await self._on_kafka(make_consumer, k)
        listener = RebalanceListener(self._on_revoked, self._on_lost, self._on_assigned)
        await self._on_kafka(self._consumer.subscribe, [k.input_topic], listener=listener)
        next_commit = time.monotonic() + k.commit_interval_s
        while not self._stopping.is_set():
            await self._apply_backpressure()
            room = max(1, self._cfg.limits.max_in_flight - self.tracker.in_flight())
            try:
                batches = await self._on_kafka(self._consumer.poll, 200, room)
            except InconsistentGroupProtocolError as exc:
                raise ConfigError(
                    f"group {k.group_id!r} runs another rebalance protocol than kafka.assignors "
                    f"{list(k.assignors)}: kafka-python cannot mix cooperative and eager "
                    "assignors; stop the group's other members first, or use a new group_id"
                ) from exc
            for records in batches.values():
                for record in records:
                    self._start(record)
            if time.monotonic() >= next_commit:
                await self._commit()
                next_commit = time.monotonic() + k.commit_interval_s
        return await self._shut_down()

    def _start(self, record: Any) -> None:
        tp = TopicPartition(record.topic, record.partition)
        self.tracker.track(tp, record.offset)
        self._metrics.in_flight.inc()
        task = asyncio.create_task(self._handle(tp, record))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, tp: TopicPartition, record: Any) -> None:
        ctx = Context(
            SourceCoords(topic=tp.topic, partition=tp.partition, offset=record.offset),
            # Only a key short enough to reuse as the dead-letter record's key.
            record.key.decode(errors="replace") if record.key and len(record.key) <= 256 else None,
            self._cfg.worker_id, self._model, self._cfg.engine.model_revision,
        )  # fmt: skip
        try:
            outcome = await self._runner.run(record.value, ctx, record.timestamp or 0)
            try:
                await self._publish(outcome)
            except PublishRefused as exc:
                if outcome.kind != "result":
                    raise
                log.warning("result of %s refused (%s); dead-lettering it", ctx.source, exc)
                outcome = self._runner.refused(outcome, exc, record.value, ctx)
                await self._publish(outcome)
            self._count(outcome)
            self.tracker.done(tp, record.offset)
        except EngineFatal as exc:
            self._stop_fatally(EXIT_ENGINE_DEAD, "engine is dead", exc)
        except (PublishRefused, TopicRefused) as exc:
            # Dropping the record would lose the job; retrying would stall the partition: stop,
            # uncommitted, and let the operator fix the topic.
            self._stop_fatally(EXIT_PUBLISH_REFUSED, "the broker refuses our records", exc)
        finally:
            self._metrics.in_flight.dec()

    def _stop_fatally(self, code: int, what: str, exc: WorkerError) -> None:
        if self._fatal is None:
            log.error("%s, stopping without further commits: %s", what, exc)
            self._fatal = exc
            self.exit_code = code
            self._stopping.set()

    def _count(self, outcome: Outcome) -> None:
        """Outcomes are counted once delivered, so a refused result is not also a result."""
        self._metrics.jobs.labels(outcome.kind).inc()
        if isinstance(outcome.record, Failure):
            self._metrics.failures.labels(outcome.record.code.value).inc()

    async def _publish(self, outcome: Outcome) -> None:
        """Retry until the broker acknowledges: an unacknowledged output must never be committed.

        Raises `PublishRefused` for a record refused for its size, `TopicRefused` for a topic
        that refuses everything; see RECORD_REFUSALS and TOPIC_REFUSALS.
        """
        value = outcome.record.model_dump_json().encode()
        delay = 0.2
        while True:
            try:
                await send(self._producer, outcome.topic, outcome.key, value, outcome.kind)
                return
            except RECORD_REFUSALS as exc:
                raise PublishRefused(f"{type(exc).__name__}: {exc}") from exc
            except TOPIC_REFUSALS as exc:
                raise TopicRefused(f"{outcome.topic}: {type(exc).__name__}: {exc}") from exc
            except KafkaError as exc:
                log.warning(
                    "publish to %s failed (%s); retrying in %.1fs", outcome.topic, exc, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _apply_backpressure(self) -> None:
        """Pause all partitions while full, resume at half: polling goes on, keeping membership."""
        limit = self._cfg.limits.max_in_flight
        held = self.tracker.in_flight()
        if not self._paused and held >= limit:
            await self._on_kafka(lambda: self._consumer.pause(*self._consumer.assignment()))
            self._paused = True
        elif self._paused and held <= limit // 2:
            await self._on_kafka(lambda: self._consumer.resume(*self._consumer.paused()))
            self._paused = False
        self._metrics.paused.set(1 if self._paused else 0)

    async def _commit(self) -> None:
        if self._fatal is not None:
            return
        offsets = self.tracker.to_commit()
        if not offsets:
            return
        try:
            await self._on_kafka(self._consumer.commit, commit_payload(offsets))
        except KafkaError as exc:  # RebalanceInProgress, CommitFailed: the next round retries
            self._metrics.commit_errors.inc()
            log.info("commit deferred: %s", exc)
            return
        self.tracker.committed(offsets)
        self._metrics.commits.inc()

    def _on_revoked(self, revoked: list[TopicPartition]) -> None:
        """Commit what is done for the partitions we give up, then stop tracking them."""
        offsets = self.tracker.to_commit(revoked) if self._fatal is None else {}
        if offsets:
            self._consumer.commit_async(commit_payload(offsets))
            self.tracker.committed(offsets)
        self.tracker.forget(revoked)
        log.info("revoked %s (committed %s)", revoked, offsets)

    def _on_assigned(self, assigned: list[Any]) -> None:
        """Runs inside poll: a partition assigned while paused (a cooperative rebalance adds it to
        a running assignment) starts paused, before that same poll fetches from it."""
        if self._paused and assigned:
            self._consumer.pause(*assigned)

    def _on_lost(self, lost: list[TopicPartition]) -> None:
        """Membership is gone: another worker owns these now, so commit nothing."""
        self.tracker.forget(lost)
        log.warning("lost %s", lost)

    async def _shut_down(self) -> int:
        if self._fatal is None and self._tasks:
            grace = self._cfg.limits.shutdown_grace_s
            log.info("draining %d in-flight jobs (up to %.0fs)", len(self._tasks), grace)
            await asyncio.wait(set(self._tasks), timeout=grace)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._commit()
        await self._on_kafka(self._consumer.close, False)
        self._producer.flush()
        self._producer.close()
        self._kafka.shutdown(wait=True)
        return self.exit_code

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        def on_signal(signum: int) -> None:
            if self._stopping.is_set():
                log.warning("second %s: exiting now", signal.Signals(signum).name)
                os._exit(EXIT_INTERRUPTED)
            log.info("%s: finishing in-flight jobs, then exiting", signal.Signals(signum).name)
            self._stopping.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)

    async def _on_kafka(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._kafka, lambda: fn(*args, **kwargs))
