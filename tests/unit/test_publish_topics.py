"""Publishing when a job's reply topic is missing on the broker: the job is dead-lettered as
`unknown_reply_topic`, and the results for other topics are not held up meanwhile.

kafka-python's `send` to a topic it has no metadata for blocks for `max_block_ms`, then raises
KafkaTimeoutError, which the worker retried until acknowledged: on one publishing thread every
other result queued behind it, for good. The producer here is a real one on the real broker,
with topic auto-creation off, as on a Kafka cluster that does not create topics on use (the
worker's own producer leaves it on, and the test broker then creates the topic on the first
send: tests/integration/test_reply_topics_e2e.py runs that case).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.structs import TopicPartition as KafkaTP
from mmworker_schemas import Result

from mmworker.config import WorkerConfig, load_config
from mmworker.devkit.broker import EmbeddedBroker
from mmworker.exits import ExitCode
from mmworker.health import Health
from mmworker.inflight import RecordHandler
from mmworker.jobs import JobRunner, Outcome
from mmworker.kafka_io import TopicCheck, ensure_topics, topic_exists
from mmworker.metrics import Metrics
from mmworker.offsets import OffsetTracker, TopicPartition
from mmworker.publishing import Publisher
from mmworker.records import Context
from mmworker.stopping import Stopping
from tests.unit.loopkit import Suspects

TP = TopicPartition("jobs", 0)
#: The producer's max_block_ms: how long a send to the missing topic blocks its thread a try.
BLOCK_MS = 3000
BAD, GOOD = 3, 5


def _config(broker: EmbeddedBroker, tag: str) -> WorkerConfig:
    out, dlq, missing = f"pub-{tag}.out", f"pub-{tag}.dlq", f"pub-{tag}.missing"
    cfg: WorkerConfig = load_config(
        kafka={"bootstrap_servers": broker.bootstrap, "output_topic": out,
               "dead_letter_topic": dlq, "reply_topics": [missing], "max_block_ms": BLOCK_MS},
    )  # fmt: skip
    ensure_topics(cfg.kafka, {out: 1, dlq: 1})
    return cfg


def _handler(
    broker: EmbeddedBroker, cfg: WorkerConfig, reply_topics: TopicCheck
) -> tuple[RecordHandler, Publisher, Stopping, OffsetTracker, Metrics]:
    """The worker's handling of records, its producer a real one."""
    (missing,) = cfg.kafka.reply_topics
    out = cfg.kafka.output_topic
    metrics = Metrics()
    runner = JobRunner(cfg, engine=None, media=None, metrics=metrics)  # type: ignore[arg-type]

    async def run(raw: bytes | None, ctx: Context, ts: int, deaths: int = 0) -> Outcome:
        job_id = json.loads(raw or b"{}")["job_id"]
        topic = missing if job_id.startswith("bad") else out
        return Outcome(topic, job_id, Result.model_construct(job_id=job_id, text="a caption"))

    runner.run = run  # type: ignore[method-assign]
    producer = KafkaProducer(
        bootstrap_servers=broker.bootstrap, acks="all", allow_auto_create_topics=False,
        max_block_ms=BLOCK_MS,
    )  # fmt: skip
    # kafka-python 3.0.12 does not hand the producer's setting on to its metadata requests,
    # which the test broker honours: without this it creates the topic on the first send.
    producer._metadata.config["allow_auto_create_topics"] = False
    publisher = Publisher(cfg.kafka, producer, reply_topics)
    tracker, stopping = OffsetTracker(), Stopping(Health(cfg.health))
    handler = RecordHandler(cfg, runner, metrics, "tiny", tracker, publisher, Suspects(), stopping)
    return handler, publisher, stopping, tracker, metrics


def _record(offset: int, job_id: str) -> Any:
    return SimpleNamespace(topic=TP.topic, partition=TP.partition, offset=offset, key=None,
                           value=json.dumps({"job_id": job_id}).encode(), timestamp=0)  # fmt: skip


def _read(bootstrap: str, topic: str, count: int) -> list[dict[str, Any]]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    consumer.assign([KafkaTP(topic, 0)])
    consumer.seek_to_beginning()
    docs: list[dict[str, Any]] = []
    deadline = time.monotonic() + 20
    while len(docs) < count and time.monotonic() < deadline:
        for records in consumer.poll(500).values():
            docs += [json.loads(r.value) for r in records]
    consumer.close()
    return docs


@pytest.mark.timeout(120)
def test_a_missing_reply_topic_is_dead_lettered_and_holds_up_no_other_topic(
    broker: EmbeddedBroker,
) -> None:
    tag = uuid.uuid4().hex[:6]
    cfg = _config(broker, tag)
    (missing,) = cfg.kafka.reply_topics
    asked: list[str] = []

    def lookup(topic: str) -> bool | None:
        """The first answer is stale (the topic was there when first asked, deleted since):
        every send to it then blocks on metadata, which is the case the thread bound covers."""
        asked.append(topic)
        return True if len(asked) == 1 else topic_exists(cfg.kafka, topic, BLOCK_MS)

    handler, publisher, stopping, tracker, metrics = _handler(broker, cfg, TopicCheck(lookup))
    done: dict[str, float] = {}

    async def handle(offset: int, job_id: str) -> None:
        await handler.handle(TP, _record(offset, job_id))
        done[job_id] = time.monotonic()

    async def scenario() -> None:
        bad = [asyncio.create_task(handle(i, f"bad-{i}")) for i in range(BAD)]
        await asyncio.sleep(0.3)  # their sends are blocked on the missing topic's metadata
        t0 = time.monotonic()
        good = [asyncio.create_task(handle(BAD + i, f"good-{i}")) for i in range(GOOD)]
        await asyncio.wait_for(asyncio.gather(*good), 30)
        good_s = max(done[f"good-{i}"] - t0 for i in range(GOOD))
        # Before: queued behind the blocked sends, the first not before BLOCK_MS (and in a loop).
        assert good_s < BLOCK_MS / 1000 * 2 / 3, f"results waited {good_s:.1f}s behind a topic"
        try:
            await asyncio.wait_for(asyncio.gather(*bad), 30)
        except TimeoutError:
            raise AssertionError("the jobs naming the missing topic never ended") from None

    for offset in range(BAD + GOOD):
        tracker.track(TP, offset)
    try:
        asyncio.run(scenario())
    finally:
        publisher.producer.close(5)
        publisher.shutdown()

    failures = _read(broker.bootstrap, cfg.kafka.dead_letter_topic, BAD)
    assert sorted(f["job_id"] for f in failures) == [f"bad-{i}" for i in range(BAD)]
    for failure in failures:
        assert failure["code"] == "unknown_reply_topic" and failure["retryable"] is False
        assert missing in failure["message"]
    results = _read(broker.bootstrap, cfg.kafka.output_topic, GOOD)
    assert sorted(r["job_id"] for r in results) == [f"good-{i}" for i in range(GOOD)]
    assert tracker.to_commit() == {TP: BAD + GOOD}
    assert stopping.exit_code == ExitCode.OK
    assert metrics.failures.labels("unknown_reply_topic")._value.get() == BAD
    assert topic_exists(cfg.kafka, missing, BLOCK_MS) is False  # not created by the worker


def test_the_topic_check_asks_once_an_interval_and_keeps_what_it_found() -> None:
    answers = {"there": True, "gone": False, "silent": None}
    asked: list[str] = []

    def lookup(topic: str) -> bool | None:
        asked.append(topic)
        time.sleep(0.05)  # a round trip: the concurrent questions below share it
        return answers[topic]

    async def scenario() -> None:
        check = TopicCheck(lookup, recheck_s=0.3)
        assert await asyncio.gather(*(check.exists("gone") for _ in range(20))) == [False] * 20
        assert await check.exists("there") and await check.exists("there")
        assert await check.exists("silent") and await check.exists("silent")  # unanswered: send
        assert asked == ["gone", "there", "silent", "silent"]
        await asyncio.sleep(0.35)
        answers["gone"] = True  # created meanwhile
        assert await check.exists("gone")
        check.forget("there")  # a send to it could not get metadata
        assert await check.exists("there")
        assert asked[4:] == ["gone", "there"]

    asyncio.run(scenario())
