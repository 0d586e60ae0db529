"""The jobs in flight: one asyncio task per record, run to a delivered outcome.

"In flight" has one meaning: the live-task registry (`LiveJobs`), keyed by partition and offset.
A task leaves it only when it has ended, also when it was cancelled for a revoked partition, so
the in-flight limit holds across rebalances. The limit counts the tasks not ended yet
(`LiveJobs.running`); the registry's size, which the metrics thread reads, may still include one
that has just ended, for a loop iteration. Every way a task can end is accounted for
(`RecordHandler.handle`): a delivered outcome, a cancellation, or a fatal stop with a documented
exit code; none is silent.

Threads: the event loop only, but for the metrics thread's `len(LiveJobs)`; kafka-python's
network thread reaches `LiveJobs.cancel` through `loop.call_soon_threadsafe` (`worker.Worker`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Coroutine
from typing import Any

from kafka.errors import KafkaError
from mmworker_schemas import Failure, SourceCoords

from mmworker import logs
from mmworker.config import WorkerConfig
from mmworker.errors import EngineFatal, PublishRefused, TopicRefused
from mmworker.exits import ExitCode
from mmworker.jobs import JobRunner, Outcome
from mmworker.metrics import Metrics
from mmworker.offsets import OffsetTracker, TopicPartition
from mmworker.publishing import Publisher
from mmworker.records import Context
from mmworker.recovery import EngineRecovery
from mmworker.stopping import Stopping
from mmworker.suspects import Suspects

#: The worker's own name, whichever of its parts logs: operators filter its lines on it.
log = logging.getLogger("mmworker.worker")

Key = tuple[TopicPartition, int]


class LiveJobs:
    """The registry of running job tasks."""

    def __init__(self) -> None:
        self._tasks: dict[Key, asyncio.Task[None]] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    def running(self) -> int:
        """Tasks not ended yet, on the event loop only (`len` is the one the metrics thread
        may read). One that has just ended leaves the registry in its done callback, a loop
        iteration later; meanwhile `OffsetTracker.uncommitted` counts its answered offset too,
        and `Worker.held` read one job too many. (A suspect's job, which clears its record
        after it is answered, is still counted twice while it does: the safe direction.)"""
        return sum(not task.done() for task in self._tasks.values())

    def start(self, key: Key, job: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(job)
        self._tasks[key] = task
        task.add_done_callback(lambda t: self._forget(key, t))

    def _forget(self, key: Key, task: asyncio.Task[None]) -> None:
        # A partition lost and assigned back in one poll restarts its offsets under the same
        # keys while the cancelled tasks are still ending: only remove the task that ended.
        if self._tasks.get(key) is task:
            del self._tasks[key]

    def per_partition(self) -> Counter[tuple[str, int]]:
        return Counter((tp.topic, tp.partition) for tp, _ in self._tasks)

    def cancel(self, partitions: set[TopicPartition]) -> None:
        """Cancel the jobs of partitions given up: their next owner redoes them."""
        for (tp, _), task in list(self._tasks.items()):
            if tp in partitions:
                task.cancel()

    async def drain(self, grace_s: float) -> None:
        """Wait up to `grace_s` for the jobs to end (a stop as asked), then cancel the rest."""
        if self._tasks:
            log.info("draining %d in-flight jobs (up to %.0fs)", len(self._tasks), grace_s)
            await asyncio.wait(set(self._tasks.values()), timeout=grace_s)
            if self._tasks:
                log.warning(
                    "shutdown grace (%.0fs) expired: abandoning %d jobs, uncommitted (they "
                    "will be redelivered)", grace_s, len(self._tasks),
                )  # fmt: skip
        await self.cancel_all()

    async def cancel_all(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class RecordHandler:
    """One record's job, from the runner to an acknowledged outcome marked done."""

    def __init__(
        self, cfg: WorkerConfig, runner: JobRunner, metrics: Metrics, model: str,
        tracker: OffsetTracker, publisher: Publisher, suspects: Suspects, stopping: Stopping,
        recovery: EngineRecovery | None = None,
    ) -> None:  # fmt: skip
        """`recovery`: replace a dead engine in-process; None: stop (exit 3) at its death."""
        self._cfg = cfg
        self._runner = runner
        self._metrics = metrics
        self._model = model
        self._tracker = tracker
        self._publisher = publisher
        self._suspects = suspects
        self._stopping = stopping
        self._recovery = recovery
        if recovery is not None:
            recovery.write_suspects = self.record_suspects

    async def handle(self, tp: TopicPartition, record: Any) -> None:
        """Runs one job to a delivered outcome. Every exit is accounted for: done, cancelled
        (partition revoked, shutdown), or a fatal stop of the worker."""
        source = SourceCoords(topic=tp.topic, partition=tp.partition, offset=record.offset)
        logs.bind_job(topic=tp.topic, partition=tp.partition, offset=record.offset)
        try:
            ctx = Context(
                source,
                # Only a key short enough to reuse as the dead-letter record's key.
                record.key.decode(errors="replace")
                if record.key and len(record.key) <= 256 else None,
                self._cfg.worker_id, self._model, self._cfg.engine.model_revision,
            )  # fmt: skip
            _observe_since(self._metrics.queue_wait_seconds, record.timestamp)
            while True:  # again after an engine death, on a new core, with the death counted
                deaths = self._suspects.deaths(source)
                try:
                    outcome = await self._runner.run(
                        record.value, ctx, record.timestamp or 0, deaths
                    )
                    break
                except EngineFatal as death:
                    if self._recovery is None or not await self._recovery.recover(
                        death, self.record_suspects
                    ):
                        raise
            try:
                await self._publisher.publish(outcome)
            except PublishRefused as exc:
                if outcome.kind != "result":
                    raise
                log.warning("result of %s refused (%s); dead-lettering it", ctx.source, exc)
                outcome = self._runner.refused(outcome, exc, record.value, ctx)
                await self._publisher.publish(outcome)
            self._count(outcome)
            _observe_since(self._metrics.end_to_end_seconds, record.timestamp)
            self._tracker.done(tp, record.offset)
            if 0 < deaths < self._cfg.limits.max_engine_deaths:
                # It finished: innocent. A condemned one keeps its record, so that a redelivery
                # (the partition moved before the commit) is condemned again, not run again.
                await self._clear_suspect(source)
        except asyncio.CancelledError:
            raise
        except EngineFatal as exc:
            self._stopping.fatally(ExitCode.ENGINE_DEAD, "engine is dead", exc)
        except (PublishRefused, TopicRefused) as exc:
            # Dropping the record would lose the job; retrying would stall the partition: stop,
            # uncommitted, and let the operator fix the topic.
            self._stopping.fatally(ExitCode.PUBLISH_REFUSED, "the broker refuses our records", exc)
        except Exception as exc:
            log.exception("job at %s failed unexpectedly", source)
            self._stopping.fatally(ExitCode.INTERNAL, f"job at {source} failed unexpectedly", exc)

    async def record_suspects(self) -> None:
        """The jobs inside the engine when it died, for whoever runs them next (suspects.py);
        once per death: the runner forgets them here."""
        sources, self._runner.dead_with = self._runner.dead_with, None
        if not sources:
            return
        log.error(
            "engine died with %d jobs inside; recording them as suspects (they will run alone, "
            "and one inside at %d deaths is dead-lettered as engine_crash)",
            len(sources), self._cfg.limits.max_engine_deaths,
        )  # fmt: skip
        try:
            await self._publisher.call(self._suspects.record_deaths, sources, self._cfg.worker_id)
        except KafkaError as exc:
            log.error("could not record suspects (%s): they will run in batches again", exc)

    async def _clear_suspect(self, source: SourceCoords) -> None:
        try:
            await self._publisher.call(self._suspects.clear, source)
        except KafkaError as exc:  # at worst it runs alone once more if redelivered
            log.warning("could not clear suspect %s: %s", source, exc)

    def _count(self, outcome: Outcome) -> None:
        """Outcomes are counted once delivered, so a refused result is not also a result."""
        self._metrics.jobs.labels(outcome.kind).inc()
        if isinstance(outcome.record, Failure):
            self._metrics.failures.labels(outcome.record.code.value).inc()
            logs.bind_job(job_id=outcome.record.job_id, code=outcome.record.code.value)
            log.warning(
                "dead-lettered %s job_id=%s code=%s: %s", outcome.record.source,
                outcome.record.job_id, outcome.record.code.value, outcome.record.message,
            )  # fmt: skip


def _observe_since(histogram: Any, timestamp_ms: int | None) -> None:
    """Seconds since the broker's timestamp of the record; none when the record has none, and
    0 for a producer clock ahead of ours."""
    if timestamp_ms and timestamp_ms > 0:
        histogram.observe(max(0.0, time.time() - timestamp_ms / 1000))
