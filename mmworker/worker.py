"""The hot loop: poll → start a task per record → publish → mark done → commit.

Many jobs are in flight at once so vLLM's continuous batching always has work; offsets are committed
only up to the lowest job whose output the broker has not yet acknowledged (at-least-once).

The loop is here; its parts are modules of their own:
- `inflight`: one task per record, run to a delivered outcome, and the registry of those tasks;
- `publishing`: results and dead letters, retried until the broker acknowledges them;
- `checkpoints`: commits, each interval, for the partitions given up, and at the stop;
- `partitions`: the rebalance callbacks, and which partitions are fetched, as `flow` decides;
- `stopping`: whether and why the worker stops, and its exit code.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kafka.errors import InconsistentGroupProtocolError, KafkaError

from mmworker.checkpoints import REJOIN_TIMEOUT_S, Checkpoints
from mmworker.config import KafkaConfig, WorkerConfig
from mmworker.errors import ConfigError, EngineFatal
from mmworker.exits import ExitCode
from mmworker.flow import FlowLimits, still_full
from mmworker.health import Health
from mmworker.inflight import LiveJobs, RecordHandler
from mmworker.jobs import JobRunner
from mmworker.kafka_io import (
    close_consumer,
    ensure_suspects_topic,
    make_consumer,
    make_producer,
    poll,
)
from mmworker.metrics import Metrics
from mmworker.offsets import OffsetTracker, TopicPartition
from mmworker.partitions import Partitions
from mmworker.publishing import Publisher, RenewableProducer
from mmworker.recovery import EngineRecovery
from mmworker.stopping import Stopping
from mmworker.suspects import KafkaSuspects, Suspects

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Deadline of each blocking client call made while stopping.
CLOSE_TIMEOUT_S = 10.0
#: Pause before polling again after a retriable client error (brokers gone, a request timed out).
POLL_RETRY_S = 0.5


class Clients(Protocol):
    """The Kafka clients the loop talks to; the unit tests pass fakes."""

    def consumer(self) -> Any: ...
    def producer(self) -> Any: ...
    def suspects(self, producer: Any) -> Suspects: ...


class KafkaClients:
    def __init__(self, cfg: KafkaConfig) -> None:
        self._cfg = cfg

    def consumer(self) -> Any:
        return make_consumer(self._cfg)

    def producer(self) -> Any:
        return make_producer(self._cfg)

    def suspects(self, producer: Any) -> Suspects:
        ensure_suspects_topic(self._cfg)
        return KafkaSuspects(self._cfg, producer)


@dataclass(frozen=True)
class _Stream:
    """What consuming needs, made once every client is there (`Worker._connect`)."""

    consumer: Any
    checkpoints: Checkpoints
    partitions: Partitions
    handler: RecordHandler


class Worker:
    """Threads: every method runs on the event loop, except `_give_up` (kafka-python's network
    thread); each call of the consumer is made on one Kafka thread (`_on_kafka`), inside whose
    poll() kafka-python runs the rebalance callbacks (`partitions.Partitions`)."""

    def __init__(
        self, cfg: WorkerConfig, runner: JobRunner, metrics: Metrics, model: str,
        clients: Clients | None = None, health: Health | None = None,
        recovery: EngineRecovery | None = None,
    ) -> None:  # fmt: skip
        """`recovery`: replace a dead engine in-process; None: stop (exit 3) at its death."""
        self._cfg = cfg
        self._runner = runner
        self._metrics = metrics
        self._model = model
        self._recovery = recovery
        self._health = health or Health(cfg.health)
        self._clients = clients or KafkaClients(cfg.kafka)
        self.tracker = OffsetTracker()
        self._stopping = Stopping(self._health)
        self._live = LiveJobs()
        self._flow = FlowLimits.from_config(cfg.limits)
        self._full = False  # every partition paused until half the jobs are done (`flow`)
        self._share = cfg.limits.max_in_flight  # most records one poll takes (`flow.Plan`)
        self._last_live = float("-inf")  # when a live job last started
        self._kafka = ThreadPoolExecutor(1, thread_name_prefix="kafka")  # the consumer's thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        # The clients, as `_connect` makes them (each closed at the stop if it was made).
        self._publisher: Publisher | None = None
        self._suspects: Suspects | None = None
        self._stream: _Stream | None = None
        self._health.assigned = lambda: len(self._stream.partitions.owned) if self._stream else 0
        metrics.in_flight.set_function(lambda: len(self._live))

    @property
    def exit_code(self) -> ExitCode:
        return self._stopping.exit_code

    @property
    def fatal(self) -> BaseException | None:
        """The error that stopped the worker without draining (see `exits.ExitCode`)."""
        return self._stopping.error

    @property
    def in_flight(self) -> int:
        """Job tasks running now (also `mmworker_in_flight`)."""
        return len(self._live)

    def held(self) -> int:
        """Jobs not yet covered by a commit: live tasks plus answered-but-uncommitted ones, which
        bounds redelivery after a crash by `limits.max_in_flight`."""
        return self._live.running() + self.tracker.uncommitted()

    def request_stop(self) -> None:
        """As SIGTERM: take no new records, finish the jobs in flight (up to
        `limits.shutdown_grace_s`), commit, and let `run` return 0."""
        self._stopping.request()

    async def run(self) -> int:
        self._loop = asyncio.get_running_loop()
        self._install_signals(self._loop)
        try:
            if await self._until_stopped(self._connect()):
                await self._consume()
        except ConfigError:
            raise
        except Exception as exc:
            log.exception("the poll loop failed")
            self._stopping.fatally(ExitCode.INTERNAL, "the poll loop failed", exc)
        finally:
            await self._shut_down()
        return int(self.exit_code)

    async def _connect(self) -> None:
        k = self._cfg.kafka
        producer = await self._on_kafka(RenewableProducer, self._clients.producer)
        self._publisher = Publisher(k, producer)
        self._suspects = await self._on_kafka(self._clients.suspects, self._publisher.producer)
        await self._on_kafka(self._suspects.refresh)
        consumer = await self._on_kafka(self._clients.consumer)
        checkpoints = Checkpoints(
            consumer, self.tracker, self._metrics, self._stopping, self._kafka
        )
        partitions = Partitions(consumer, checkpoints, self._give_up, self._flow, k.backfill_topic)
        handler = RecordHandler(
            self._cfg, self._runner, self._metrics, self._model, self.tracker, self._publisher,
            self._suspects, self._stopping, self._recovery,
        )  # fmt: skip
        self._stream = _Stream(consumer, checkpoints, partitions, handler)
        topics = [k.input_topic] + ([k.backfill_topic] if k.backfill_topic else [])
        await self._on_kafka(consumer.subscribe, topics, listener=partitions.listener())

    async def _consume(self) -> None:
        assert self._stream is not None and self._suspects is not None
        stream, k, limits = self._stream, self._cfg.kafka, self._cfg.limits
        next_commit = time.monotonic() + k.commit_interval_s
        while not self._stopping.requested:
            await self._throttle(stream.partitions)
            if self._stopping.requested:  # asked while throttled, or a job's fatal end: no poll
                break
            # One poll takes records from one partition's batch: at most a share, so that the
            # next poll, with that partition paused, brings another's (`flow`).
            room = max(1, min(limits.max_in_flight - self.held(), self._share))
            try:
                batches = await self._on_kafka(poll, stream.consumer, 200, room)
            except InconsistentGroupProtocolError as exc:
                raise ConfigError(
                    f"group {k.group_id!r} runs another rebalance protocol than kafka.assignors "
                    f"{list(k.assignors)}: kafka-python cannot mix cooperative and eager "
                    "assignors; stop the group's other members first, or use a new group_id"
                ) from exc
            except KafkaError as exc:
                if not exc.retriable:
                    raise
                # kafka-python can raise a lost connection out of poll while the brokers are
                # gone (ECONNREFUSED during a broker restart stopped the worker, exit 5); the
                # outage is the broker watch's to report, and a later poll reconnects.
                log.debug("poll failed, polling again: %r", exc)
                await asyncio.sleep(POLL_RETRY_S)
                continue
            for records in batches.values():
                for record in records:
                    self._start(record, stream.handler)
            if stream.partitions.unchecked:
                await self._on_kafka(stream.partitions.check_suspects, self._suspects)
            if time.monotonic() >= next_commit:
                await stream.checkpoints.commit()
                await self._on_kafka(stream.checkpoints.measure_lag, stream.partitions.owned)
                next_commit = time.monotonic() + k.commit_interval_s

    def _start(self, record: Any, handler: RecordHandler) -> None:
        tp = TopicPartition(record.topic, record.partition)
        self.tracker.track(tp, record.offset)
        if record.topic != self._cfg.kafka.backfill_topic:
            self._last_live = time.monotonic()
        self._live.start((tp, record.offset), handler.handle(tp, record))

    async def _throttle(self, partitions: Partitions) -> None:
        """Pause all partitions while full, resume at half: polling goes on, keeping membership.
        Below that, lanes and fair shares decide (`flow.plan_pauses`)."""
        self._full = still_full(self._full, self.held(), self._cfg.limits.max_in_flight)
        plan = await self._on_kafka(
            partitions.fetch_only, self._full, self._live.per_partition(), self._last_live
        )
        if plan is not None:
            self._share = plan.share
        self._metrics.paused.set(1 if self._full else 0)

    def _give_up(self, tps: list[TopicPartition]) -> None:
        """On kafka-python's network thread: partitions revoked or lost; their next owner
        redoes their jobs."""
        self.tracker.forget(tps)
        gone = set(tps)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._live.cancel, gone)

    async def _shut_down(self) -> None:
        stream = self._stream
        if self.fatal is None:
            await self._live.drain(self._cfg.limits.shutdown_grace_s)  # the engine may die in it
        if isinstance(self.fatal, EngineFatal) and stream is not None:
            await stream.handler.record_suspects()  # first: before anything could move a partition
        if self.fatal is not None:
            await self._live.cancel_all()
        if stream is not None:
            await self._bounded(
                stream.checkpoints.last_commit(), REJOIN_TIMEOUT_S + CLOSE_TIMEOUT_S
            )
            await self._bounded(
                self._on_kafka(close_consumer, stream.consumer, CLOSE_TIMEOUT_S * 1000)
            )
        if self._suspects is not None:
            await self._bounded(self._on_kafka(self._suspects.close))
        if self._publisher is not None:
            producer = self._publisher.producer
            await self._bounded(self._publisher.call(producer.flush, CLOSE_TIMEOUT_S))
            await self._bounded(self._publisher.call(producer.close, CLOSE_TIMEOUT_S))
            self._publisher.shutdown()
        self._kafka.shutdown(wait=False)

    async def _bounded(self, call: Awaitable[object], limit_s: float = CLOSE_TIMEOUT_S + 1) -> None:
        """A client call while stopping: it must not hold the exit forever, nor fail it."""
        try:
            async with asyncio.timeout(limit_s):  # not wait_for: see `mmworker.gate.shared`
                await call
        except (TimeoutError, KafkaError, OSError) as exc:
            log.warning("while stopping: %s", exc or type(exc).__name__)

    async def _until_stopped(self, work: Awaitable[None]) -> bool:
        """Run start-up work, but give up on it when a stop is asked (a broker that does not
        answer must not hold SIGTERM for the client's whole connect timeout)."""
        job = asyncio.ensure_future(work)
        stop = asyncio.create_task(self._stopping.asked.wait())
        await asyncio.wait({job, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if job.done():
            job.result()
            return not self._stopping.requested
        job.cancel()
        return False

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        def on_signal(signum: int) -> None:
            self._signals += 1
            if self._signals > 1:  # a fatal stop in progress is not a first signal
                log.warning("second %s: exiting now", signal.Signals(signum).name)
                os._exit(ExitCode.INTERRUPTED)
            log.info("%s: finishing in-flight jobs, then exiting", signal.Signals(signum).name)
            self._stopping.request()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)

    async def _on_kafka(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._kafka, lambda: fn(*args, **kwargs))
