"""kafka-python plumbing: clients from the config, topic creation, awaitable sends.

kafka-python's consumer is not thread-safe, so the worker calls it from one dedicated thread; the
producer is thread-safe and its acknowledgements are bridged onto the event loop here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Executor
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic
from kafka.consumer.subscription_state import AsyncConsumerRebalanceListener
from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from kafka.errors import KafkaError, TopicAlreadyExistsError, UnknownTopicOrPartitionError
from kafka.structs import MemberState, OffsetAndMetadata
from kafka.structs import TopicPartition as KafkaTP

from mmworker.config import KafkaConfig
from mmworker.errors import ConfigError
from mmworker.offsets import TopicPartition

log = logging.getLogger(__name__)

_ASSIGNORS = {
    "cooperative-sticky": CooperativeStickyAssignor,
    "range": RangePartitionAssignor,
    "roundrobin": RoundRobinPartitionAssignor,
}


def make_consumer(cfg: KafkaConfig) -> KafkaConsumer:
    consumer = KafkaConsumer(
        group_id=cfg.group_id,
        enable_auto_commit=False,
        # 'earliest': a new group starts from the beginning, so no job posted before the first
        # worker joined is skipped.
        auto_offset_reset="earliest",
        session_timeout_ms=cfg.session_timeout_ms,
        heartbeat_interval_ms=cfg.heartbeat_interval_ms,
        max_poll_interval_ms=cfg.max_poll_interval_ms,
        max_poll_records=cfg.max_poll_records,
        fetch_max_bytes=cfg.fetch_max_bytes,
        max_partition_fetch_bytes=cfg.max_partition_fetch_bytes,
        # Cooperative (KIP-429) by default: an eager rebalance revokes every partition of every
        # member, and the jobs in flight on partitions that come straight back run twice.
        partition_assignment_strategy=[_ASSIGNORS[name] for name in cfg.assignors],
        **cfg.client_kwargs(),
    )
    keep_finished_joins(consumer)
    return consumer


def keep_finished_joins(consumer: KafkaConsumer) -> None:
    """Take the result of a group join that finished while no poll() was waiting for it.

    kafka-python 3.0.12 runs JoinGroup+SyncGroup as a task that a poll() awaits for at most
    its own timeout; when the round ends between two polls, the next poll sees the task done
    and sends a new JoinGroup instead of taking its assignment (coordinator/base.py:
    `if self._join_task is None or self._join_task.is_done`). A JoinGroup waits for every
    member (seconds), a poll here lasts 200 ms and work runs between polls, so a member could
    rejoin over and over: 11 JoinGroups in 15 s in a failing run, and a stop's final commit
    that never landed. This completes the finished round the way the library does after a
    round it awaited, then lets the library go on (a cooperative follow-up round, if any).
    Only a round nothing has overtaken: the member still rebalancing in the generation the
    round gave it, the coordinator still known. After a reset (the broker forgot the member,
    the coordinator went away) the library's own fresh join is right, and is left to run.
    Private API, hence here, next to the other uses of it."""
    coordinator = consumer._coordinator
    join_group = coordinator.join_group_async

    def finished_round() -> Any:
        task = coordinator._join_task
        if task is None or not task.is_done or not task.succeeded():
            return None
        with coordinator._lock:
            current = (
                coordinator.state is MemberState.REBALANCING
                and not coordinator._generation.is_lost()
                and coordinator.coordinator_id is not None
            )
        return task if current else None

    async def join_group_async(timeout_ms: int | None = None) -> bool:
        task = finished_round()
        if task is not None:
            coordinator._join_task = None
            with coordinator._lock:
                coordinator.rejoining = False
                coordinator.rejoin_needed = False
                coordinator.state = MemberState.STABLE
                coordinator._enable_heartbeat()
            generation = coordinator._generation
            await coordinator._on_join_complete_async(
                generation.generation_id, generation.member_id, generation.protocol, task.value
            )
        return bool(await join_group(timeout_ms=timeout_ms))

    coordinator.join_group_async = join_group_async


def make_producer(cfg: KafkaConfig) -> KafkaProducer:
    return KafkaProducer(
        acks="all",
        enable_idempotence=cfg.enable_idempotence,
        linger_ms=cfg.linger_ms,
        max_block_ms=cfg.max_block_ms,
        max_request_size=cfg.max_request_size,
        compression_type=cfg.compression_type,
        **cfg.client_kwargs(),
    )


def posting_producer(cfg: KafkaConfig) -> KafkaProducer:
    """The producer of the commands that post jobs (`submit`, `backfill`, `replay`): a short
    linger (they send in bursts and wait for every acknowledgement), no compression, and the
    worker's own acknowledgement and idempotence settings."""
    return KafkaProducer(
        acks="all",
        enable_idempotence=cfg.enable_idempotence,
        linger_ms=20,
        max_block_ms=cfg.max_block_ms,
        max_request_size=cfg.max_request_size,
        **cfg.client_kwargs(),
    )


def post_acknowledged(
    producer: KafkaProducer,
    topic: str,
    records: list[tuple[bytes, bytes, list[tuple[str, bytes]]]],
    fix: str,
) -> None:
    """Send (key, value, headers) records and wait for every acknowledgement: the command-line
    tools that post (backfill, replay) record a job as posted only once the broker has it. A
    refusal is a one-line `ConfigError` naming the topic and `fix`."""
    try:
        futures = [producer.send(topic, key=k, value=v, headers=h or None) for k, v, h in records]
        producer.flush()
        for future in futures:
            future.get(timeout=30)
    except KafkaError as exc:
        raise ConfigError(
            f"cannot post to topic {topic!r} ({type(exc).__name__}: {exc}): {fix}"
        ) from exc


def check_brokers(
    cfg: KafkaConfig, timeout_s: float, source: str = "kafka.bootstrap_servers"
) -> None:
    """Reach the brokers within `timeout_s`, before anything slow starts, or raise a one-line
    `ConfigError` naming the servers, where the setting came from (`source`) and the fix.

    Why: kafka-python finds a missing broker only when a client first needs it, after the engine
    has loaded (minutes on a GPU), and then logs every reconnect and fails with a long traceback.
    A TCP connect to each bootstrap server says "refused" or "no such host" at once; a metadata
    request through kafka-python then checks what TCP cannot: that it is Kafka, and that TLS and
    SASL (`kafka.security_protocol`, ...) are accepted.
    """
    servers = [s.strip() for s in cfg.bootstrap_servers.split(",") if s.strip()]
    where = f"kafka.bootstrap_servers={cfg.bootstrap_servers!r} (from {source})"
    fix = (
        "start Kafka there, or point kafka.bootstrap_servers at your brokers "
        "(--bootstrap-servers, MMWORKER_KAFKA__BOOTSTRAP_SERVERS or [kafka] in the config file)"
    )
    deadline = time.monotonic() + timeout_s
    problems: list[str] = []
    reached = False
    for server in servers:
        host, sep, port = server.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"{where}: {server!r} is not host:port; write e.g. kafka-0:9092")
        try:
            remaining = max(0.1, deadline - time.monotonic())
            with socket.create_connection((host.strip("[]"), int(port)), timeout=remaining):
                reached = True
                break
        except socket.gaierror:
            problems.append(f"{server}: no such host")
        except TimeoutError:
            problems.append(f"{server}: no answer within {timeout_s:g}s")
        except OSError as exc:
            problems.append(f"{server}: {exc.strerror or type(exc).__name__}".lower())
    if not reached:
        raise ConfigError(f"cannot reach the Kafka brokers, {where}: {'; '.join(problems)}; {fix}")
    remaining = max(1.0, deadline - time.monotonic())
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            admin = KafkaAdminClient(
                **cfg.client_kwargs(),
                bootstrap_timeout_ms=int(remaining * 1000),
                request_timeout_ms=int(remaining * 1000),
                reconnect_backoff_max_ms=500,
            )
            admin.close()
        except (KafkaError, OSError, ValueError) as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    # In a thread of its own: kafka-python's bootstrap can wait past its own deadline (a TLS
    # handshake with a plaintext listener never completes), and this check must not.
    thread = threading.Thread(target=probe, name="check-brokers", daemon=True)
    with _kafka_quiet():
        thread.start()
        thread.join(remaining + 1.0)
    if outcome and outcome[0] is None:
        return
    detail = "no answer"
    if outcome and outcome[0] is not None:
        name, text = type(outcome[0]).__name__, str(outcome[0])
        detail = text if text.startswith(name) else f"{name}: {text}".rstrip(": ")
    raise ConfigError(
        f"reached {where} over TCP, but it gave no Kafka answer within {timeout_s:g}s with "
        f"kafka.security_protocol={cfg.security_protocol} ({detail}): check that it is a Kafka "
        "listener and the TLS/SASL settings (kafka.security_protocol, kafka.sasl_*, kafka.ssl_*)"
    )


@contextlib.contextmanager
def _kafka_quiet() -> Iterator[None]:
    """kafka-python logs every failed attempt; the check reports the outcome once itself."""
    logger = logging.getLogger("kafka")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


#: The suspects topic keeps the latest record per key and drops tombstones (suspects.py).
SUSPECTS_TOPIC_CONFIG = {"cleanup.policy": "compact"}


def ensure_worker_topics(cfg: KafkaConfig, partitions: int) -> None:
    """The worker's own topics: input, output and reply topics with `partitions`, dead-letter 1,
    and the compacted suspects topic."""
    topics = {cfg.input_topic: partitions, cfg.output_topic: partitions, cfg.dead_letter_topic: 1}
    if cfg.backfill_topic is not None:
        topics[cfg.backfill_topic] = partitions
    ensure_topics(cfg, {name: partitions for name in cfg.reply_topics} | topics)
    ensure_topics(cfg, {cfg.suspects_topic: 1}, configs=SUSPECTS_TOPIC_CONFIG)


def ensure_suspects_topic(cfg: KafkaConfig) -> None:
    """The worker needs its suspects topic to start: created if missing (and allowed)."""
    try:
        ensure_topics(cfg, {cfg.suspects_topic: 1}, configs=SUSPECTS_TOPIC_CONFIG)
    except KafkaError as exc:
        raise ConfigError(
            f"the suspects topic {cfg.suspects_topic!r} is missing and could not be created "
            f"({type(exc).__name__}); create it with cleanup.policy=compact, or set "
            "kafka.suspects_topic"
        ) from exc


def ensure_topics(
    cfg: KafkaConfig, topics: dict[str, int], replication: int = 1,
    configs: dict[str, str] | None = None,
) -> None:  # fmt: skip
    """Create missing topics (demo, tests, first deployment); existing ones are left alone."""
    admin = KafkaAdminClient(**cfg.client_kwargs())
    try:
        existing = set(admin.list_topics())
        new = [
            NewTopic(
                name,
                num_partitions=parts,
                replication_factor=replication,
                topic_configs=configs or {},
            )
            for name, parts in topics.items()
            if name not in existing
        ]
        if new:
            try:
                admin.create_topics(new)
            except TopicAlreadyExistsError:
                log.debug("topics created concurrently by another client")
    finally:
        admin.close()


def topic_exists(cfg: KafkaConfig, topic: str, timeout_ms: int) -> bool | None:
    """Whether the broker has `topic`, asked with a metadata request that does not create it (a
    producer's does, where the broker allows it): None when the broker gave no answer for it
    (unreachable, not authorized), for the caller to send anyway and retry as it would."""
    try:
        admin = KafkaAdminClient(
            **cfg.client_kwargs(), request_timeout_ms=timeout_ms, bootstrap_timeout_ms=timeout_ms
        )
    except (KafkaError, OSError) as exc:
        log.info("cannot ask the broker whether topic %r exists: %r", topic, exc)
        return None
    try:
        described = admin.describe_topics([topic])
    except (KafkaError, OSError) as exc:
        log.info("cannot ask the broker whether topic %r exists: %r", topic, exc)
        return None
    finally:
        admin.close()
    code = next((d["error_code"] for d in described if d["name"] == topic), None)
    if code == 0:
        return True
    return False if code == UnknownTopicOrPartitionError.errno else None


class TopicCheck:
    """`topic_exists` for the reply topics jobs name, remembered: a topic found stays found
    (until `forget`: a send to it could not get metadata), a missing one is asked about again
    after `recheck_s`, so that one created meanwhile is used and a stream of jobs naming a
    missing topic costs one request an interval, not one a job."""

    def __init__(self, lookup: Callable[[str], bool | None], recheck_s: float = 10.0) -> None:
        self._lookup = lookup
        self._recheck_s = recheck_s
        self._found: set[str] = set()
        self._missing: dict[str, float] = {}  # topic → when it was found missing (monotonic)
        self._asking: dict[str, asyncio.Lock] = {}

    async def exists(self, topic: str) -> bool:
        """False only when the broker said the topic does not exist; an unanswered question is
        True (the send goes ahead, retried as any other)."""
        if topic in self._found:
            return True
        async with self._asking.setdefault(topic, asyncio.Lock()):  # one question at a time
            missing_since = self._missing.get(topic)
            if topic in self._found:
                return True
            if missing_since is not None and time.monotonic() - missing_since < self._recheck_s:
                return False
            answer = await asyncio.to_thread(self._lookup, topic)
            if answer is False:
                self._missing[topic] = time.monotonic()
                return False
            self._missing.pop(topic, None)
            if answer:
                self._found.add(topic)
            return True

    def forget(self, topic: str) -> None:
        self._found.discard(topic)
        self._missing.pop(topic, None)


def record_headers(kind: str) -> list[tuple[str, bytes]]:
    """What every record the worker writes carries: its kind (result, failure, ...)."""
    return [("mmworker-record", kind.encode())]


async def send(
    producer: KafkaProducer, topic: str, key: str, value: bytes, kind: str,
    executor: Executor | None = None, lock: asyncio.Lock | None = None,
) -> None:  # fmt: skip
    """Send and wait for the broker's acknowledgement without blocking the event loop.

    `producer.send` itself may block (missing metadata, a full buffer: up to `max_block_ms`), so
    it is called on `executor` when one is given, holding `lock` meanwhile: with one lock per
    topic, a topic that cannot be written takes at most one of the executor's threads.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def ok(meta: Any) -> None:
        loop.call_soon_threadsafe(_settle, done, meta, None)

    def failed(exc: BaseException) -> None:
        loop.call_soon_threadsafe(_settle, done, None, exc)

    def submit() -> Any:
        return producer.send(topic, key=key.encode(), value=value, headers=record_headers(kind))

    if executor is None:
        future = submit()
    else:
        async with lock or contextlib.nullcontext():
            future = await loop.run_in_executor(executor, submit)
    future.add_callback(ok)
    future.add_errback(failed)
    await done


def _settle(fut: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def commit_payload(offsets: dict[TopicPartition, int]) -> dict[KafkaTP, OffsetAndMetadata]:
    return {
        KafkaTP(tp.topic, tp.partition): OffsetAndMetadata(o, "", -1) for tp, o in offsets.items()
    }


async def commit_in_rebalance(
    consumer: Any, offsets: dict[TopicPartition, int], timeout_ms: int
) -> None:
    """A blocking commit from inside a rebalance callback.

    kafka-python 3.0 runs rebalance listeners on its own network thread, where `commit()` refuses
    to block (`RuntimeError: Cannot block on net.run() from the IO thread`). An async listener
    may await the coroutine `commit()` itself runs there; it is private API of the pinned
    kafka-python release (3.0.12), which is why it lives here, in one place.
    """
    await consumer._coordinator._commit_offsets_sync_async(
        commit_payload(offsets), timeout_ms=timeout_ms
    )


def poll(consumer: Any, timeout_ms: int, max_records: int) -> dict[Any, list[Any]]:
    """`consumer.poll`, with a repair of kafka-python 3.0.12's fetcher first.

    When a partition is paused, the fetcher parks the records it holds for it and stops fetching
    it until they are handed back; it hands them back only into an empty slot, `None`, but a
    slot drained by poll keeps an exhausted (falsy) object. So a partition paused while its
    batch was being drained and resumed later is never fetched again: with per-partition pauses
    (fair shares, `flow.plan_pauses`) whole partitions stalled for good on the real broker
    (tests/unit/test_worker_fairness.py). Emptying the drained slot lets the parked records
    back in. Private API of the pinned release, hence here, in one place."""
    fetcher = getattr(consumer, "_fetcher", None)
    slot = getattr(fetcher, "_next_partition_records", None)
    if slot is not None and not slot:
        fetcher._next_partition_records = None  # type: ignore[union-attr]
    return consumer.poll(timeout_ms, max_records=max_records)  # type: ignore[no-any-return]


def unparsed_highwater(consumer: Any) -> dict[Any, int]:
    """High-water marks carried by fetch responses the fetcher holds but has not parsed yet.

    kafka-python updates `highwater()` only when poll reaches a partition's response, after the
    batches queued ahead of it; a live record's response behind a backfill batch would then go
    unseen until that batch is drained. The responses of paused partitions count too: the
    fetcher sets them aside (`_paused_completed_fetches`) until the partition resumes, and a
    worker that pauses every partition while full would otherwise see, once it has room, only
    the partition it was draining as having records, and serve partitions one after another
    (tests/integration/test_backfill_e2e.py, fairness). Reads the fetcher's queues: private
    API of the pinned release, hence here."""
    fetcher = getattr(consumer, "_fetcher", None)
    marks: dict[Any, int] = {}
    parked = getattr(fetcher, "_paused_completed_fetches", None) or {}
    for completed in [*getattr(fetcher, "_completed_fetches", ()), *list(parked.values())]:
        high = getattr(completed.partition_data, "high_watermark", -1)
        if high is not None and high >= 0:
            tp = completed.topic_partition
            marks[tp] = max(marks.get(tp, high), high)
    return marks


def queued_answers(consumer: Any) -> set[Any]:
    """The partitions with a fetch answer queued in the fetcher, not parsed yet: they are not
    fetched again until poll reaches it. The answers set aside for paused partitions are left
    out: those wait for the partition to resume, whatever the broker holds meanwhile. Private
    API of the pinned release, hence here."""
    fetcher = getattr(consumer, "_fetcher", None)
    return {completed.topic_partition for completed in getattr(fetcher, "_completed_fetches", ())}


def ask_end_offsets(consumer: Any, partitions: list[Any], timeout_ms: int) -> Any:
    """Send a ListOffsets request (latest) for the partitions and return at once: kafka-python's
    Future, settled on its network thread (`end_offsets_answered` reads it).

    Not `KafkaConsumer.end_offsets`: that blocks the thread that polls until the answer comes or
    the time is up (on Apache Kafka a request waits behind the connection's long-polling fetch),
    and it raises KeyError for a partition whose leader is unknown (left out of the request,
    then read from the answer). Private API of the pinned release, hence here."""
    from kafka.protocol.consumer import OffsetSpec

    fetcher = consumer._fetcher
    latest = dict.fromkeys(partitions, OffsetSpec.LATEST)
    return fetcher._manager.call_soon(fetcher._fetch_offsets_by_times_async, latest, timeout_ms)


def end_offsets_answered(asked: Any) -> dict[Any, int] | None:
    """What an `ask_end_offsets` got: None while it is unanswered, {} if it failed, else the
    end offset of each partition the broker answered for."""
    if not asked.is_done:
        return None
    if asked.exception is not None:
        log.debug("end offsets not read: %r", asked.exception)
        return {}
    return {tp: answer.offset for tp, answer in asked.value.items() if answer.offset >= 0}


def may_have_records(consumer: Any, tp: Any, unparsed: dict[Any, int] | None = None) -> bool:
    """Whether the partition may have records this consumer has not handed out yet: its
    high-water mark (`unparsed_highwater` included) past its position, or either not known
    yet.

    The position is read from the subscription state, not `KafkaConsumer.position()`: that one
    refreshes committed offsets and resets positions first (round trips, and a timeout error on
    a partition just assigned), where this check must be a read that cannot fail."""
    known = consumer.highwater(tp)
    pending = (unparsed or {}).get(tp)
    high = pending if known is None else max(known, pending or known)
    if high is None:
        return True
    state = getattr(consumer, "_subscription", None)
    try:
        position = state.position(tp) if state is not None else None
    except KeyError:  # revoked meanwhile
        return False
    offset = getattr(position, "offset", position)
    return offset is None or high > offset


# The heartbeat `close_consumer` sends before leaving waits at most this long for its answer.
PROBE_MS = 2000


def close_consumer(consumer: KafkaConsumer, timeout_ms: int) -> None:
    """Close without committing; leave the group only if this member is not behind a rebalance.

    When the coordinator has started a rebalance this member has not rejoined yet (a worker that
    stops right after another one joined), a LeaveGroup sent now wedges the group for good on the
    Tansu broker: the members that did rejoin never get an answer, retries included (seen in CI;
    tests/integration/test_group_leave.py checks the way out). Skipping the LeaveGroup then costs
    at most one session timeout on Apache Kafka, where the coordinator drops the silent member.
    The client learns of a rebalance only from its next heartbeat, up to one heartbeat interval
    after the join that started it (a CI run lost a test in that window), so one heartbeat is
    sent now, before deciding. Reads kafka-python's coordinator state, private API of the pinned
    release, hence here."""
    if rebalance_pending(consumer) or not heartbeat_now(consumer, min(timeout_ms, PROBE_MS)):
        log.info(
            "a rebalance is pending or the coordinator did not answer: closing without "
            "LeaveGroup (the session times out)"
        )
        consumer._coordinator.reset_generation()
    consumer.close(False, timeout_ms)


def heartbeat_now(consumer: KafkaConsumer, timeout_ms: int) -> bool:
    """One heartbeat, sent and answered now: False when the coordinator answered that a
    rebalance is in progress (kafka-python's handler then sets `rejoin_needed`), or answered
    with another error, or not within `timeout_ms` (a broker that cannot answer a heartbeat
    will not answer a LeaveGroup either, so the close skips that wait too). True, without a
    request, for a member with nothing to leave."""
    coordinator = consumer._coordinator
    if coordinator.coordinator_unknown() or not coordinator._generation.has_member_id():
        return True
    manager = coordinator._manager

    async def beat() -> None:
        await manager.wait_for(manager.call_soon(coordinator._send_heartbeat_request), timeout_ms)

    try:
        manager.run(beat)
    except KafkaError as exc:
        log.info("heartbeat before leaving the group: %r", exc)
        return False
    return True


def rebalance_pending(consumer: KafkaConsumer) -> bool:
    """The coordinator has started a rebalance this member has not rejoined yet (a commit now
    gets RebalanceInProgress). kafka-python's coordinator state, private API, hence here."""
    return bool(consumer._coordinator.rejoin_needed)


class RebalanceListener(AsyncConsumerRebalanceListener):  # type: ignore[misc]
    """Its callbacks run on kafka-python's network thread, inside `poll()`: they must not block
    it (heartbeats), so the revoke callback is a coroutine that kafka-python awaits there."""

    def __init__(
        self,
        on_revoked: Callable[[list[TopicPartition]], Awaitable[None]],
        on_lost: Callable[[list[TopicPartition]], None],
        on_assigned: Callable[[list[KafkaTP]], None] | None = None,
    ) -> None:
        self._on_revoked = on_revoked
        self._on_lost = on_lost
        self._on_assigned = on_assigned

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self._on_revoked([TopicPartition(tp.topic, tp.partition) for tp in revoked])

    async def on_partitions_assigned(self, assigned: Any) -> None:
        log.info("assigned %s", sorted((tp.topic, tp.partition) for tp in assigned))
        if self._on_assigned is not None:
            self._on_assigned(list(assigned))  # kafka-python's own partitions: pause() takes them

    async def on_partitions_lost(self, lost: Any) -> None:
        self._on_lost([TopicPartition(tp.topic, tp.partition) for tp in lost])
