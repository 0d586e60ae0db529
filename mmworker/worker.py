"""The hot loop: poll → start a task per record → publish → mark done → commit.

Many jobs are in flight at once so vLLM's continuous batching always has work; offsets are committed
only up to the lowest job whose output the broker has not yet acknowledged (at-least-once).

"In flight" has one meaning: the live-task registry `_live`, keyed by partition and offset. A task
leaves it only when it has ended, also when it was cancelled for a revoked partition, so the
in-flight limit holds across rebalances. Every way a task can end is accounted for: a delivered
outcome, a cancellation, or a fatal stop with a documented exit code; none is silent.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from kafka.errors import (
    ClusterAuthorizationFailedError,
    IllegalStateError,
    InconsistentGroupProtocolError,
    InvalidTopicError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    TopicAuthorizationFailedError,
)

from mmworker import logs
from mmworker.config import KafkaConfig, WorkerConfig
from mmworker.errors import (
    ConfigError,
    EngineFatal,
    PublishRefused,
    TopicRefused,
    UnknownReplyTopic,
)
from mmworker.exits import ExitCode
from mmworker.health import Health
from mmworker.jobs import JobRunner, Outcome
from mmworker.kafka_io import (
    RebalanceListener,
    TopicCheck,
    close_consumer,
    commit_in_rebalance,
    commit_payload,
    ensure_suspects_topic,
    make_consumer,
    make_producer,
    may_have_records,
    poll,
    rebalance_pending,
    send,
    topic_exists,
    unparsed_highwater,
)
from mmworker.metrics import Metrics
from mmworker.offsets import OffsetTracker, TopicPartition
from mmworker.records import Context
from mmworker.recovery import EngineRecovery
from mmworker.schemas import Failure, SourceCoords
from mmworker.suspects import KafkaSuspects, Suspects

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Refusals of one record (its size): the job is dead-lettered and the partition moves on.
RECORD_REFUSALS = (MessageSizeTooLargeError, RecordListTooLargeError)
#: Refusals of a whole topic: every record would fail the same way, so the worker stops. Any
#: other error, retriable or not (kafka-python marks some transient producer errors, such as an
#: idempotent producer's epoch bump, non-retriable), is retried with backoff.
TOPIC_REFUSALS = (TopicAuthorizationFailedError, ClusterAuthorizationFailedError, InvalidTopicError)
#: Deadlines of the blocking client calls made while stopping or giving partitions up.
REVOKE_COMMIT_TIMEOUT_MS = 10_000
CLOSE_TIMEOUT_S = 10.0
#: A stop that falls into a rebalance waits this long for the group to settle, so that its
#: answered jobs can be committed (two cooperative rounds took 5-6 s on the test broker).
REJOIN_TIMEOUT_S = 15.0

_Key = tuple[TopicPartition, int]


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


class Worker:
    def __init__(
        self, cfg: WorkerConfig, runner: JobRunner, metrics: Metrics, model: str,
        clients: Clients | None = None, health: Health | None = None,
        recovery: EngineRecovery | None = None,
    ) -> None:  # fmt: skip
        """`recovery`: replace a dead engine in-process; None: stop (exit 3) at its death."""
        self._cfg = cfg
        self._recovery = recovery
        self._health = health or Health(cfg.health)
        self._owned: set[Any] = set()  # partitions assigned now (written on the Kafka thread)
        self._health.assigned = lambda: len(self._owned)
        self._runner = runner
        self._metrics = metrics
        self._model = model
        self._clients = clients or KafkaClients(cfg.kafka)
        self.tracker = OffsetTracker()
        self._live: dict[_Key, asyncio.Task[None]] = {}
        #: Most records one poll takes: a partition's share of max_in_flight while several may
        #: have records waiting, and no more than backfill jobs may still take (`_to_pause`).
        self._share = cfg.limits.max_in_flight
        self._backfill_cap = max(1, int(cfg.limits.max_in_flight * cfg.limits.backfill_share))
        self._last_live = float("-inf")  # when a live job last started
        self._kafka = ThreadPoolExecutor(1, thread_name_prefix="kafka")  # the consumer's thread
        # producer.send blocks while metadata is missing or the buffer is full (max_block_ms):
        # a thread for each topic the worker writes (each takes one at most, `_sending`) and one
        # for the producer's other calls, so a topic that cannot be written holds up no other.
        k = cfg.kafka
        written = {k.output_topic, k.dead_letter_topic, *k.reply_topics}
        self._publisher = ThreadPoolExecutor(len(written) + 1, thread_name_prefix="publish")
        self._sending: dict[str, asyncio.Lock] = {}
        self._reply_topics = TopicCheck(
            functools.partial(topic_exists, cfg.kafka, timeout_ms=cfg.kafka.max_block_ms)
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._consumer: Any = None
        self._producer: Any = None
        self._suspects: Suspects | None = None
        self._stopping = asyncio.Event()
        self._fatal: BaseException | None = None
        self._paused = False
        self._signals = 0
        self._unchecked: list[Any] = []  # assigned, paused until suspects are read (see below)
        self.exit_code = ExitCode.OK
        metrics.in_flight.set_function(lambda: len(self._live))

    def held(self) -> int:
        """Jobs not yet covered by a commit: live tasks plus answered-but-uncommitted ones, which
        bounds redelivery after a crash by `limits.max_in_flight`."""
        return len(self._live) + self.tracker.uncommitted()

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
            self._stop_fatally(ExitCode.INTERNAL, "the poll loop failed", exc)
        finally:
            await self._shut_down()
        return int(self.exit_code)

    async def _connect(self) -> None:
        k = self._cfg.kafka
        self._producer = await self._on_kafka(self._clients.producer)
        self._suspects = await self._on_kafka(self._clients.suspects, self._producer)
        await self._on_kafka(self._suspects.refresh)
        self._consumer = await self._on_kafka(self._clients.consumer)
        listener = RebalanceListener(self._on_revoked, self._on_lost, self._on_assigned)
        topics = [k.input_topic] + ([k.backfill_topic] if k.backfill_topic else [])
        await self._on_kafka(self._consumer.subscribe, topics, listener=listener)

    async def _consume(self) -> None:
        k, limits = self._cfg.kafka, self._cfg.limits
        next_commit = time.monotonic() + k.commit_interval_s
        while not self._stopping.is_set():
            await self._apply_backpressure()
            # One poll takes records from one partition's batch: at most a share, so that the
            # next poll, with that partition paused, brings another's (`_to_pause`).
            room = max(1, min(limits.max_in_flight - self.held(), self._share))
            try:
                batches = await self._on_kafka(poll, self._consumer, 200, room)
            except InconsistentGroupProtocolError as exc:
                raise ConfigError(
                    f"group {k.group_id!r} runs another rebalance protocol than kafka.assignors "
                    f"{list(k.assignors)}: kafka-python cannot mix cooperative and eager "
                    "assignors; stop the group's other members first, or use a new group_id"
                ) from exc
            for records in batches.values():
                for record in records:
                    self._start(record)
            if self._unchecked:
                await self._check_suspects()
            if time.monotonic() >= next_commit:
                await self._commit()
                await self._on_kafka(self._measure_lag)
                next_commit = time.monotonic() + k.commit_interval_s

    def _start(self, record: Any) -> None:
        tp = TopicPartition(record.topic, record.partition)
        key = (tp, record.offset)
        self.tracker.track(tp, record.offset)
        if record.topic != self._cfg.kafka.backfill_topic:
            self._last_live = time.monotonic()
        task = asyncio.create_task(self._handle(tp, record))
        self._live[key] = task
        task.add_done_callback(lambda t: self._forget_task(key, t))

    def _forget_task(self, key: _Key, task: asyncio.Task[None]) -> None:
        # A partition lost and assigned back in one poll restarts its offsets under the same
        # keys while the cancelled tasks are still ending: only remove the task that ended.
        if self._live.get(key) is task:
            del self._live[key]

    async def _handle(self, tp: TopicPartition, record: Any) -> None:
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
            assert self._suspects is not None
            self._observe_since(self._metrics.queue_wait_seconds, record.timestamp)
            while True:  # again after an engine death, on a new core, with the death counted
                deaths = self._suspects.deaths(source)
                try:
                    outcome = await self._runner.run(
                        record.value, ctx, record.timestamp or 0, deaths
                    )
                    break
                except EngineFatal as death:
                    if self._recovery is None or not await self._recovery.recover(
                        death, self._record_suspects
                    ):
                        raise
            try:
                await self._publish(outcome)
            except PublishRefused as exc:
                if outcome.kind != "result":
                    raise
                log.warning("result of %s refused (%s); dead-lettering it", ctx.source, exc)
                outcome = self._runner.refused(outcome, exc, record.value, ctx)
                await self._publish(outcome)
            self._count(outcome)
            self._observe_since(self._metrics.end_to_end_seconds, record.timestamp)
            self.tracker.done(tp, record.offset)
            if 0 < deaths < self._cfg.limits.max_engine_deaths:
                # It finished: innocent. A condemned one keeps its record, so that a redelivery
                # (the partition moved before the commit) is condemned again, not run again.
                await self._clear_suspect(source)
        except asyncio.CancelledError:
            raise
        except EngineFatal as exc:
            self._stop_fatally(ExitCode.ENGINE_DEAD, "engine is dead", exc)
        except (PublishRefused, TopicRefused) as exc:
            # Dropping the record would lose the job; retrying would stall the partition: stop,
            # uncommitted, and let the operator fix the topic.
            self._stop_fatally(ExitCode.PUBLISH_REFUSED, "the broker refuses our records", exc)
        except Exception as exc:
            log.exception("job at %s failed unexpectedly", source)
            self._stop_fatally(ExitCode.INTERNAL, f"job at {source} failed unexpectedly", exc)

    async def _clear_suspect(self, source: SourceCoords) -> None:
        assert self._suspects is not None
        try:
            await self._off_loop(self._suspects.clear, source)
        except KafkaError as exc:  # at worst it runs alone once more if redelivered
            log.warning("could not clear suspect %s: %s", source, exc)

    @staticmethod
    def _observe_since(histogram: Any, timestamp_ms: int | None) -> None:
        """Seconds since the broker's timestamp of the record; none when the record has none,
        and 0 for a producer clock ahead of ours."""
        if timestamp_ms and timestamp_ms > 0:
            histogram.observe(max(0.0, time.time() - timestamp_ms / 1000))

    def _measure_lag(self) -> None:
        """Per-partition lag: the high-water mark the last fetch brought back (no request of its
        own) minus this worker's last commit (`OffsetTracker.lag_bases`). A partition without
        a known mark yet (nothing fetched) or revoked meanwhile is left out."""
        bases = self.tracker.lag_bases()
        lag: dict[tuple[str, str], float] = {}
        for tp in list(self._owned):
            base = bases.get(TopicPartition(tp.topic, tp.partition))
            try:
                high = self._consumer.highwater(tp)
            except IllegalStateError:  # revoked between the listing and the read
                continue
            if high is not None and base is not None:
                lag[(tp.topic, str(tp.partition))] = max(0, high - base)
        self._metrics.set_consumer_lag(lag)

    def _stop_fatally(self, code: ExitCode, what: str, exc: BaseException) -> None:
        if self._fatal is None:
            self._health.stopping = True
            log.error("%s, stopping without further commits: %s", what, exc)
            self._fatal = exc
            self.exit_code = code
            self._stopping.set()

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

    async def _publish(self, outcome: Outcome) -> None:
        """Retry until the broker acknowledges: an unacknowledged output must never be committed.

        Raises `PublishRefused` for a record refused for its size, `UnknownReplyTopic` for a
        job's reply topic the broker does not have (asked before the first send, and again when
        a send could not get the topic's metadata), `TopicRefused` for a topic that refuses
        everything; see RECORD_REFUSALS and TOPIC_REFUSALS.
        """
        value = outcome.record.model_dump_json().encode()
        k = self._cfg.kafka
        reply = outcome.topic not in (k.output_topic, k.dead_letter_topic)
        lock = self._sending.setdefault(outcome.topic, asyncio.Lock())
        delay = 0.2
        while True:
            if reply and not await self._reply_topics.exists(outcome.topic):
                raise UnknownReplyTopic(
                    "the topic does not exist on the broker (kafka.reply_topics allows it: "
                    "create it, then replay the job)"
                )
            try:
                await send(self._producer, outcome.topic, outcome.key, value, outcome.kind,
                           self._publisher, lock)  # fmt: skip
                return
            except RECORD_REFUSALS as exc:
                raise PublishRefused(f"{type(exc).__name__}: {exc}") from exc
            except TOPIC_REFUSALS as exc:
                raise TopicRefused(f"{outcome.topic}: {type(exc).__name__}: {exc}") from exc
            except KafkaError as exc:
                if isinstance(exc, KafkaTimeoutError):  # no metadata: deleted since it was found?
                    self._reply_topics.forget(outcome.topic)
                log.warning(
                    "publish to %s failed (%s); retrying in %.1fs", outcome.topic, exc, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _apply_backpressure(self) -> None:
        """Pause all partitions while full, resume at half: polling goes on, keeping membership.
        Below that, lanes and fair shares decide (`_to_pause`)."""
        limit = self._cfg.limits.max_in_flight
        held = self.held()
        if not self._paused and held >= limit:
            self._paused = True
        elif self._paused and held <= limit // 2:
            self._paused = False
        await self._on_kafka(self._pause_only, Counter(tp for tp, _ in self._live))
        self._metrics.paused.set(1 if self._paused else 0)

    def _pause_only(self, live: Counter[TopicPartition]) -> None:
        """On the Kafka thread: pause exactly the partitions that should not be fetched now."""
        owned = self._consumer.assignment()
        want = set(owned) if self._paused else self._to_pause(owned, live)
        want.update(tp for tp in self._unchecked if tp in owned)  # until suspects are read
        now = self._consumer.paused()
        if want - now:
            self._consumer.pause(*(want - now))
        if (now - want) & owned:
            self._consumer.resume(*((now - want) & owned))

    def _to_pause(self, owned: set[Any], live: Counter[TopicPartition]) -> set[Any]:
        """Lanes first, then fair shares.

        Lanes: the backfill topic's partitions are paused while a live partition may have
        records waiting, and while backfill jobs hold their share of `max_in_flight`
        (`limits.backfill_share`; the rest stays free for live jobs), or, while live traffic is
        recent (`limits.live_idle_s`), `limits.backfill_beside_live` jobs: every request inside
        the engine slows each step of a live one, and the engine gate only keeps new backfill
        jobs out while a live one runs (`gate.EngineGate.foreground`).

        Fair shares: kafka-python's poll drains one partition's fetched batch before the next
        one's, so a full worker would serve partitions one after another. While several
        partitions may have records waiting (`kafka_io.may_have_records`), each gets an equal
        share of `max_in_flight`: a poll takes at most one share (`_share`), and a partition
        holding its share is paused while another one waiting holds less. One busy partition
        alone still gets the whole worker, a poll at a time."""
        limits, backfill_topic = self._cfg.limits, self._cfg.kafka.backfill_topic

        def held(tp: Any) -> int:
            return live[TopicPartition(tp.topic, tp.partition)]

        waiting = []
        unparsed = unparsed_highwater(self._consumer)
        for tp in owned:
            try:
                if may_have_records(self._consumer, tp, unparsed):
                    waiting.append(tp)
            except IllegalStateError:  # revoked meanwhile
                continue
        pause: set[Any] = set()
        room = limits.max_in_flight
        if backfill_topic is not None:
            backfill = {tp for tp in owned if tp.topic == backfill_topic}
            live_jobs = sum(n for tp, n in live.items() if tp.topic != backfill_topic)
            live_waiting = any(tp.topic != backfill_topic for tp in waiting)
            recent = live_jobs or time.monotonic() - self._last_live < limits.live_idle_s
            cap = min(
                self._backfill_cap, limits.backfill_beside_live if recent else limits.max_in_flight
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
        self._share = max(1, min(share, limits.max_in_flight // max(1, fetchable), room))
        if len(candidates) >= 2 and not all(held(tp) >= share for tp in candidates):
            pause |= {tp for tp in candidates if held(tp) >= share}
        return pause

    async def _commit(self) -> bool:
        """False when there was something to commit and the broker refused it."""
        if self._fatal is not None:
            return True
        offsets = self.tracker.to_commit()
        if not offsets:
            return True
        try:
            await self._on_kafka(self._consumer.commit, commit_payload(offsets))
        except KafkaError as exc:  # RebalanceInProgress, CommitFailed: the next round retries
            self._metrics.commit_errors.inc()
            log.info("commit deferred: %s", exc)
            return False
        self.tracker.committed(offsets)
        self._metrics.commits.inc()
        self._metrics.last_commit.set_to_current_time()
        return True

    async def _last_commit(self) -> None:
        """The stop's commit, with one more round if a rebalance refused it.

        A worker asked to stop while the group rebalances (another member just joined or left)
        gets RebalanceInProgress; there is no next round, so its answered jobs would be redone
        by the next owner. Polling with every partition paused takes part in the rebalance
        (the revoke callback commits what it gives up; new partitions arrive paused) without
        taking records, and the commit is tried again once the group is settled."""
        if await self._commit():
            return
        consumer = self._consumer
        deadline = time.monotonic() + REJOIN_TIMEOUT_S
        while time.monotonic() < deadline and self.tracker.to_commit():
            await self._on_kafka(lambda: consumer.pause(*consumer.assignment()))
            await self._on_kafka(poll, consumer, 200, 1)
            settled = not await self._on_kafka(rebalance_pending, consumer)
            if settled and await self._commit():
                return
        if self.tracker.to_commit():  # empty: revoked (and committed there) or lost meanwhile
            log.warning("stop: the final commit did not land; answered jobs will be redone")

    # Rebalance callbacks: they run on the Kafka thread, inside poll().

    async def _on_revoked(self, revoked: list[TopicPartition]) -> None:
        """Commit what is done for the partitions we give up (synchronously, with a deadline:
        the next owner starts from it), then stop their jobs: the next owner redoes them.
        Runs on kafka-python's network thread, which awaits it (kafka_io.RebalanceListener)."""
        offsets = self.tracker.to_commit(revoked) if self._fatal is None else {}
        try:
            if offsets:
                await commit_in_rebalance(self._consumer, offsets, REVOKE_COMMIT_TIMEOUT_MS)
                self.tracker.committed(offsets)
        except KafkaError as exc:
            self._metrics.commit_errors.inc()
            log.warning("commit on revoke failed (%s): those jobs will be redone", exc)
            offsets = {}
        finally:
            self._owned.difference_update(revoked)
            self._drop(revoked)
        log.info("revoked %s (committed %s)", revoked, offsets)

    def _on_lost(self, lost: list[TopicPartition]) -> None:
        """Membership is gone: another worker owns these now, so commit nothing."""
        self._owned.difference_update(lost)
        self._drop(lost)
        log.warning("lost %s", lost)

    def _on_assigned(self, assigned: list[Any]) -> None:
        """New partitions start paused, before this same poll fetches from them: the worker may
        be full (a cooperative rebalance adds partitions to a running assignment), and a
        partition may come from a worker whose engine just died, so the suspects topic is read
        first. That read blocks, so it happens after poll() returns (`_check_suspects`), not
        here on kafka-python's network thread, where it would hold up heartbeats."""
        self._owned.update(assigned)
        if assigned:
            self._consumer.pause(*assigned)
            self._unchecked.extend(assigned)

    async def _check_suspects(self) -> None:
        """Read the suspects topic for the partitions just assigned; the next round of
        `_apply_backpressure` then resumes them."""
        assert self._suspects is not None
        checked = list(self._unchecked)
        await self._on_kafka(self._suspects.refresh)
        self._unchecked = [tp for tp in self._unchecked if tp not in checked]

    def _drop(self, tps: list[TopicPartition]) -> None:
        self.tracker.forget(tps)
        gone = set(tps)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._cancel_where, lambda k: k[0] in gone)

    def _cancel_where(self, match: Callable[[_Key], bool]) -> None:
        for key, task in list(self._live.items()):
            if match(key):
                task.cancel()

    async def _shut_down(self) -> None:
        if isinstance(self._fatal, EngineFatal):
            await self._record_suspects()  # first: before anything could move a partition
        if self._fatal is None and self._live:
            grace = self._cfg.limits.shutdown_grace_s
            log.info("draining %d in-flight jobs (up to %.0fs)", len(self._live), grace)
            await asyncio.wait(set(self._live.values()), timeout=grace)
            if self._live:
                log.warning(
                    "shutdown grace (%.0fs) expired: abandoning %d jobs, uncommitted (they "
                    "will be redelivered)", grace, len(self._live),
                )  # fmt: skip
        tasks = list(self._live.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._consumer is not None:
            await self._bounded(self._last_commit(), REJOIN_TIMEOUT_S + CLOSE_TIMEOUT_S)
            await self._bounded(
                self._on_kafka(close_consumer, self._consumer, CLOSE_TIMEOUT_S * 1000)
            )
        if self._suspects is not None:
            await self._bounded(self._on_kafka(self._suspects.close))
        if self._producer is not None:
            await self._bounded(self._off_loop(self._producer.flush, CLOSE_TIMEOUT_S))
            await self._bounded(self._off_loop(self._producer.close, CLOSE_TIMEOUT_S))
        self._kafka.shutdown(wait=False)
        self._publisher.shutdown(wait=False)

    async def _record_suspects(self) -> None:
        """The jobs inside the engine when it died, for whoever runs them next (suspects.py);
        once per death: the runner forgets them here."""
        sources, self._runner.dead_with = self._runner.dead_with, None
        if not sources or self._suspects is None:
            return
        log.error(
            "engine died with %d jobs inside; recording them as suspects (they will run alone, "
            "and one inside at %d deaths is dead-lettered as engine_crash)",
            len(sources), self._cfg.limits.max_engine_deaths,
        )  # fmt: skip
        try:
            await self._off_loop(self._suspects.record_deaths, sources, self._cfg.worker_id)
        except KafkaError as exc:
            log.error("could not record suspects (%s): they will run in batches again", exc)

    async def _bounded(self, call: Awaitable[object], limit_s: float = CLOSE_TIMEOUT_S + 1) -> None:
        """A client call while stopping: it must not hold the exit forever, nor fail it."""
        try:
            await asyncio.wait_for(call, limit_s)
        except (TimeoutError, KafkaError, OSError) as exc:
            log.warning("while stopping: %s", exc or type(exc).__name__)

    async def _until_stopped(self, work: Awaitable[None]) -> bool:
        """Run start-up work, but give up on it when a stop is asked (a broker that does not
        answer must not hold SIGTERM for the client's whole connect timeout)."""
        job = asyncio.ensure_future(work)
        stop = asyncio.create_task(self._stopping.wait())
        await asyncio.wait({job, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if job.done():
            job.result()
            return not self._stopping.is_set()
        job.cancel()
        return False

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        def on_signal(signum: int) -> None:
            self._signals += 1
            if self._signals > 1:  # a fatal stop in progress is not a first signal
                log.warning("second %s: exiting now", signal.Signals(signum).name)
                os._exit(ExitCode.INTERRUPTED)
            log.info("%s: finishing in-flight jobs, then exiting", signal.Signals(signum).name)
            self._health.stopping = True
            self._stopping.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)

    async def _on_kafka(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._kafka, lambda: fn(*args, **kwargs))

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._publisher, lambda: fn(*args))
