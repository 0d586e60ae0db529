"""What the worker does when the broker refuses a record for good (fake producer, no engine).

Retrying a non-retriable refusal forever would pin the partition's commit and, once
`max_in_flight` jobs pile up behind it, stop the whole worker; dropping it would lose the job.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
from kafka.errors import (
    InvalidTimestampError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    TopicAuthorizationFailedError,
)
from mmworker_schemas import Result

from mmworker.checkpoints import Checkpoints
from mmworker.config import WorkerConfig, load_config
from mmworker.devkit.broker import EmbeddedBroker
from mmworker.exits import ExitCode
from mmworker.flow import FlowLimits, still_full
from mmworker.health import Health
from mmworker.inflight import RecordHandler
from mmworker.jobs import JobRunner, Outcome
from mmworker.metrics import Metrics
from mmworker.offsets import OffsetTracker, TopicPartition
from mmworker.partitions import Partitions
from mmworker.publishing import RENEWALS_PER_RECORD, Publisher
from mmworker.records import Context
from mmworker.stopping import Stopping
from tests.unit.loopkit import Future, Producer, Suspects

OUTPUT, DLQ = "out", "dlq"
TP = TopicPartition("jobs", 0)


def _handler(producer: Producer) -> tuple[RecordHandler, Stopping, OffsetTracker, Metrics]:
    """The worker's handling of one record, with the producer given (no broker, no engine)."""
    cfg: WorkerConfig = load_config(kafka={"output_topic": OUTPUT, "dead_letter_topic": DLQ})
    return _handler_with(cfg, Publisher(cfg.kafka, producer))


def _handler_with(
    cfg: WorkerConfig, publisher: Publisher
) -> tuple[RecordHandler, Stopping, OffsetTracker, Metrics]:
    """A job whose run gives a caption for the configured output topic (no engine)."""
    metrics = Metrics()
    runner = JobRunner(cfg, engine=None, media=None, metrics=metrics)  # type: ignore[arg-type]
    result = Result.model_construct(job_id="job-1", text="a caption")
    output = cfg.kafka.output_topic

    async def run(raw: bytes | None, ctx: Context, ts: int, deaths: int = 0) -> Outcome:
        return Outcome(output, "job-1", result)

    runner.run = run  # type: ignore[method-assign]
    tracker, stopping = OffsetTracker(), Stopping(Health(cfg.health))
    handler = RecordHandler(cfg, runner, metrics, "tiny", tracker, publisher, Suspects(), stopping)
    tracker.track(TP, 7)
    return handler, stopping, tracker, metrics


def _record() -> Any:
    return SimpleNamespace(topic=TP.topic, partition=TP.partition, offset=7, key=None,
                           value=b'{"job_id": "job-1"}', timestamp=0)  # fmt: skip


@pytest.mark.parametrize("broker_side", [False, True], ids=["producer-check", "broker-answer"])
def test_refused_result_is_dead_lettered_and_the_offset_moves_on(broker_side: bool) -> None:
    too_big = MessageSizeTooLargeError("1.2 MB > max_request_size")
    producer = Producer({OUTPUT: [too_big]}, broker_side=broker_side)
    handler, stopping, tracker, metrics = _handler(producer)
    asyncio.run(handler.handle(TP, _record()))

    ((topic, key, failure),) = producer.sent
    assert (topic, key) == (DLQ, "job-1")
    assert failure["code"] == "publish_failed" and failure["retryable"] is False
    assert "MessageSizeTooLargeError" in failure["message"] and OUTPUT in failure["message"]
    assert failure["source"] == {"topic": "jobs", "partition": 0, "offset": 7}
    assert tracker.to_commit() == {TP: 8}
    assert stopping.exit_code == ExitCode.OK
    assert metrics.failures.labels("publish_failed")._value.get() == 1
    # Counted once, as what was delivered: a failure, not also a result.
    assert metrics.jobs.labels("failure")._value.get() == 1
    assert metrics.jobs.labels("result")._value.get() == 0


def test_refusing_dead_letter_topic_stops_the_worker_uncommitted() -> None:
    too_big = MessageSizeTooLargeError("too big")
    handler, stopping, tracker, _ = _handler(Producer({OUTPUT: [too_big], DLQ: [too_big]}))
    asyncio.run(handler.handle(TP, _record()))

    assert stopping.exit_code == ExitCode.PUBLISH_REFUSED
    assert stopping.requested
    assert tracker.to_commit() == {}  # the job is redelivered after the fix


def test_a_topic_refusing_everything_stops_the_worker_instead_of_dead_lettering() -> None:
    """Dead-lettering every result of a stream the worker may not write would be the wrong fix."""
    producer = Producer({OUTPUT: [TopicAuthorizationFailedError("no ACL")]}, broker_side=True)
    handler, stopping, tracker, _ = _handler(producer)
    asyncio.run(handler.handle(TP, _record()))

    assert producer.sent == []
    assert stopping.exit_code == ExitCode.PUBLISH_REFUSED
    assert tracker.to_commit() == {}


def test_retriable_errors_are_retried_until_acknowledged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    # KafkaError itself is flagged non-retriable, yet kafka-python hands it to the healthy
    # records of a batch that held one bad record: resending works.
    errors: list[Exception] = [KafkaTimeoutError("metadata"), KafkaError("batch sibling")]
    producer = Producer({OUTPUT: errors}, broker_side=True)
    handler, _, tracker, _ = _handler(producer)
    asyncio.run(handler.handle(TP, _record()))

    assert [t for t, _, _ in producer.sent] == [OUTPUT]
    assert tracker.to_commit() == {TP: 8}


_real_sleep = asyncio.sleep


async def _no_sleep(delay: float) -> None:
    await _real_sleep(0)


def test_assigned_partitions_start_paused_until_the_suspects_are_read() -> None:
    """Inside poll, before that same poll fetches: the worker may be full, and a partition may
    come from a worker whose engine just died (its suspects must be known first). The round of
    backpressure after the check resumes them, unless the worker is full."""
    paused_now: set[Any] = set()
    paused: list[Any] = []
    resumed: list[Any] = []

    def pause(*tps: Any) -> None:
        paused.extend(tps)
        paused_now.update(tps)

    def resume(*tps: Any) -> None:
        resumed.extend(tps)
        paused_now.difference_update(tps)

    from kafka.structs import TopicPartition as KTP

    J1, J2, J3 = (KTP("jobs", n) for n in (1, 2, 3))
    cfg = load_config()
    suspects = Suspects()
    owned = {J1, J2}
    consumer = SimpleNamespace(
        pause=pause, resume=resume, assignment=lambda: set(owned),
        paused=lambda: set(paused_now), highwater=lambda tp: None,
    )  # fmt: skip
    limits = FlowLimits.from_config(cfg.limits)
    checkpoints = Checkpoints(
        consumer, OffsetTracker(), Metrics(), Stopping(Health(cfg.health)), ThreadPoolExecutor(1)
    )
    partitions = Partitions(consumer, checkpoints, lambda tps: None, limits, None)
    never = float("-inf")  # no live job started yet
    partitions.on_assigned([J1, J2])
    assert paused == [J1, J2] and resumed == []
    partitions.fetch_only(False, {}, never)  # not checked yet: they stay paused
    assert resumed == []
    partitions.check_suspects(suspects)
    assert suspects.refreshes == 1
    partitions.fetch_only(False, {}, never)
    assert sorted(resumed) == [J1, J2]
    # While the worker is full, they stay paused after the check.
    full = still_full(False, held=limits.max_in_flight, limit=limits.max_in_flight)
    owned.add(J3)
    partitions.on_assigned([J3])
    partitions.check_suspects(suspects)
    partitions.fetch_only(full, {}, never)
    assert J3 in paused_now and J3 not in resumed


def test_a_send_that_cannot_get_metadata_fails_at_max_block_ms_and_the_loop_keeps_running(
) -> None:  # fmt: skip
    """The real kafka-python producer against a broker that accepts connections and never
    answers: `producer.send` blocks on metadata. It must give up at `kafka.max_block_ms` (not
    kafka-python's 60 s), with a KafkaError the worker retries, and block the publish thread,
    not the event loop that feeds the engine."""
    from kafka import KafkaProducer

    from mmworker.kafka_io import send
    from tests.conftest import SilentBroker

    max_block_ms = 1500
    with SilentBroker() as silent:
        cfg = load_config(kafka={"bootstrap_servers": silent.bootstrap,
                                 "max_block_ms": max_block_ms})  # fmt: skip
        assert cfg.kafka.max_block_ms == max_block_ms
        # As make_producer builds it, minus the bootstrap check a silent broker fails at once.
        producer = KafkaProducer(
            bootstrap_servers=silent.bootstrap, max_block_ms=cfg.kafka.max_block_ms,
            api_version=(2, 8),
        )  # fmt: skip
        publisher = ThreadPoolExecutor(1)

        async def scenario() -> tuple[float, int, BaseException | None]:
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.05)
                    ticks += 1

            ticker = asyncio.create_task(tick())
            t0 = time.monotonic()
            error: BaseException | None = None
            try:
                await send(producer, OUTPUT, "job-1", b"{}", "result", publisher)
            except KafkaError as exc:
                error = exc
            took = time.monotonic() - t0
            ticker.cancel()
            return took, ticks, error

        try:
            took, ticks, error = asyncio.run(scenario())
        finally:
            producer.close(timeout=0)
            publisher.shutdown(wait=False)
    assert isinstance(error, KafkaTimeoutError), error
    assert max_block_ms / 1000 - 0.1 <= took < max_block_ms / 1000 + 2, took
    # The loop ran all along: about one tick per 50 ms of the block.
    assert ticks >= int(took / 0.05) // 2, (ticks, took)


@pytest.mark.parametrize(
    "refusal",
    [MessageSizeTooLargeError("1.2 MB > max.message.bytes"), KafkaError("UnknownServerError")],
    ids=["record-too-large", "other-non-retriable"],
)
def test_a_producer_given_up_after_a_broker_refusal_is_replaced_and_the_partition_flows(
    broker: EmbeddedBroker, refusal: KafkaError
) -> None:
    """The real kafka-python idempotent producer on the real broker. When a broker refuses a
    record that cannot be split or retried (over a topic's max.message.bytes; an unknown
    server error), kafka-python's Sender puts the producer in its fatal state, and every later
    send fails with that error: the dead letter for the refused result failed too, and the
    worker exited 4 into the same record at each restart. The test broker enforces no record
    size, so the refusal's effect on the producer is caused the way the Sender causes it (its
    transaction manager's transition to the fatal state); all that follows is real."""
    from kafka import KafkaConsumer

    from mmworker.kafka_io import ensure_topics, make_producer
    from mmworker.publishing import RenewableProducer

    tag = uuid.uuid4().hex[:6]
    output, dlq = f"out-{tag}", f"dlq-{tag}"
    cfg = load_config(kafka={"bootstrap_servers": broker.bootstrap, "output_topic": output,
                             "dead_letter_topic": dlq})  # fmt: skip
    ensure_topics(cfg.kafka, {output: 1, dlq: 1})
    producer = RenewableProducer(lambda: make_producer(cfg.kafka))
    first = producer.current
    first.send(output, b"warm-up").get(10)  # a producer id and sequence of its own
    first._transaction_manager.transition_to_fatal_error(refusal)  # as the Sender does
    handler, stopping, tracker, _ = _handler_with(cfg, Publisher(cfg.kafka, producer))
    asyncio.run(handler.handle(TP, _record()))

    assert stopping.exit_code == ExitCode.OK, stopping
    assert tracker.to_commit() == {TP: 8}
    assert producer.current is not first
    consumer = KafkaConsumer(bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=5000)  # fmt: skip
    consumer.subscribe([output, dlq])
    got = [(r.topic, r.value) for r in consumer]
    consumer.close()
    answers = [(t, json.loads(v)) for t, v in got if v != b"warm-up"]
    if isinstance(refusal, MessageSizeTooLargeError):  # the result itself is dead-lettered
        ((topic, failure),) = answers
        assert (topic, failure["code"]) == (dlq, "publish_failed"), answers
    else:  # any other refusal is retried, on the new producer: the result goes out
        ((topic, result),) = answers
        assert (topic, result["job_id"]) == (output, "job-1"), answers
    producer.close(1)


class _GivesUpOnResults(Producer):
    """kafka-python's idempotent producer when the broker refuses a result for a reason other
    than its size (InvalidTimestampError, an unknown server error): the refusal puts it in its
    fatal state, and a new producer does the same with that record."""

    made = 0

    def __init__(self) -> None:
        super().__init__()
        type(self).made += 1
        self.fatal: BaseException | None = None
        self._transaction_manager = self

    def has_fatal_error(self) -> bool:
        return self.fatal is not None

    @property
    def last_error(self) -> BaseException | None:
        return self.fatal

    def send(self, topic: str, *, key: bytes, value: bytes, headers: Any = None) -> Any:
        if self.fatal is not None:
            raise self.fatal
        if topic == OUTPUT:
            self.fatal = InvalidTimestampError("timestamp out of range")
            raise self.fatal
        return super().send(topic, key=key, value=value, headers=headers)


def _handle_through_renewed_producers(kind: type[_GivesUpOnResults]) -> list[_GivesUpOnResults]:
    """One record handled through a RenewableProducer that makes `kind`; every producer made,
    after the handler finished with exit OK and the record's offset committable."""
    from mmworker.publishing import RenewableProducer

    producers: list[_GivesUpOnResults] = []

    def make() -> _GivesUpOnResults:
        producers.append(kind())
        return producers[-1]

    cfg: WorkerConfig = load_config(kafka={"output_topic": OUTPUT, "dead_letter_topic": DLQ})
    handler, stopping, tracker, _ = _handler_with(
        cfg, Publisher(cfg.kafka, RenewableProducer(make))
    )
    asyncio.run(asyncio.wait_for(handler.handle(TP, _record()), 30))
    assert stopping.exit_code == ExitCode.OK, stopping
    assert tracker.to_commit() == {TP: 8}
    return producers


def test_a_result_every_new_producer_gives_up_on_is_dead_lettered_not_sent_forever() -> None:
    """It renewed producers without pause or end (thousands a second), was never
    dead-lettered, and its partition's commit stayed where it was."""
    producers = _handle_through_renewed_producers(_GivesUpOnResults)
    (failure,) = [doc for p in producers for doc in p.on(DLQ)]
    assert failure["code"] == "publish_failed" and "InvalidTimestampError" in failure["message"]
    # the first, one new per refusal, and one that sent it alone
    assert len(producers) == RENEWALS_PER_RECORD + 2


class _GivesUpOnOthers(_GivesUpOnResults):
    """A producer that another record in flight put in its fatal state: this one fails with
    that record's error, although the broker would take it."""

    def send(self, topic: str, *, key: bytes, value: bytes, headers: Any = None) -> Any:
        if self.fatal is None and type(self).made <= RENEWALS_TO_FAIL:
            self.fatal = InvalidTimestampError("another record's timestamp is out of range")
        if self.fatal is not None:
            raise self.fatal
        return Producer.send(self, topic, key=key, value=value, headers=headers)


#: The first producer and each renewal: every one given up by the others in flight.
RENEWALS_TO_FAIL = RENEWALS_PER_RECORD + 1


def test_a_result_only_in_flight_when_others_were_refused_is_published_not_dead_lettered() -> None:
    """A fatal state fails every record in flight with the refused one's error. A result that
    happened to renew the producer twice was dead-lettered as publish_failed: its real answer
    was lost. Sent alone on a producer of its own, it goes through."""
    _GivesUpOnOthers.made = 0
    producers = _handle_through_renewed_producers(_GivesUpOnOthers)
    assert [doc for p in producers for doc in p.on(DLQ)] == []
    (result,) = [doc for p in producers for doc in p.on(OUTPUT)]
    assert result["text"] and len(producers) == RENEWALS_TO_FAIL + 1
    assert producers[-1].closed  # the one that sent it alone


class _ProbeTimesOut(_GivesUpOnResults):
    """Producers given up by others in flight, except the first one that sends the record
    alone: it gets no answer in time (a transient error, no fatal state)."""

    def __init__(self) -> None:
        super().__init__()
        self.index = type(self).made  # 1 for the first producer made

    def send(self, topic: str, *, key: bytes, value: bytes, headers: Any = None) -> Any:
        n = self.index
        if n == RENEWALS_TO_FAIL + 1:  # the first probe
            return Future(KafkaTimeoutError("no answer in time"))
        if self.fatal is None and n <= RENEWALS_TO_FAIL + 2:
            self.fatal = InvalidTimestampError("another record's timestamp is out of range")
        if self.fatal is not None:
            raise self.fatal
        return Producer.send(self, topic, key=key, value=value, headers=headers)


def test_a_send_alone_that_gets_no_answer_is_retried_not_taken_for_a_refusal() -> None:
    """A probe's own failure says nothing about the record: back off, send again, and ask
    again alone."""
    _ProbeTimesOut.made = 0
    producers = _handle_through_renewed_producers(_ProbeTimesOut)
    assert [doc for p in producers for doc in p.on(DLQ)] == []
    (result,) = [doc for p in producers for doc in p.on(OUTPUT)]
    assert result["text"] and len(producers) == RENEWALS_TO_FAIL + 3
    assert producers[RENEWALS_TO_FAIL].closed and producers[-1].closed  # both probes


def test_a_new_producer_that_cannot_reach_the_brokers_is_asked_for_again_later() -> None:
    """Building it raised out of the publisher's retry loop: the worker stopped, exit 5."""
    from mmworker.publishing import RenewableProducer

    attempts: list[int] = []

    def make() -> Producer:
        attempts.append(1)
        if len(attempts) == 2:
            raise KafkaTimeoutError("Unable to bootstrap from ['broker:9092']")
        return Producer()

    producer = RenewableProducer(make)
    producer.current._transaction_manager = SimpleNamespace(  # given up
        has_fatal_error=lambda: True, last_error=InvalidTimestampError("out of range")
    )
    assert producer.renew_if_given_up() is False  # the brokers are gone: it stays as it is
    assert producer.renew_if_given_up() is True
    assert len(attempts) == 3
