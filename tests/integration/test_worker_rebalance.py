"""A rebalance on the real broker, with the real kafka-python client: the worker commits what
it finished on the partitions it gives up and keeps running (the engine is scripted: the client's
threading rules are what is under test, and a fake consumer cannot show them)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor
from kafka.structs import TopicPartition
from mmworker.schemas import SourceCoords

from mmworker.config import load_config
from mmworker.devkit.broker import EmbeddedBroker
from mmworker.exits import ExitCode
from mmworker.kafka_io import ensure_worker_topics
from mmworker.metrics import Metrics
from mmworker.worker import Worker
from tests.conftest import GROUP_SETTINGS
from tests.unit.loopkit import ScriptedRunner

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
def test_giving_partitions_to_a_new_member_commits_them_and_keeps_running(
    broker: EmbeddedBroker,
) -> None:
    tag = uuid.uuid4().hex[:6]
    cfg = load_config(
        kafka={"bootstrap_servers": broker.bootstrap, "group_id": f"rb-{tag}",
               "input_topic": f"rb-{tag}.in", "output_topic": f"rb-{tag}.out",
               "dead_letter_topic": f"rb-{tag}.dlq", "suspects_topic": f"rb-{tag}.suspects",
               "commit_interval_s": 30.0, **GROUP_SETTINGS},  # only revokes commit in time
        # Room for every job: all are answered before the newcomer joins, none committed yet.
        limits={"shutdown_grace_s": 2, "max_in_flight": 4000},
    )  # fmt: skip
    ensure_worker_topics(cfg.kafka, 4)
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    for i in range(2000):
        value = json.dumps({"job_id": f"j{i}", "media": [{"uri": "https://example.test/a"}]})
        producer.send(cfg.kafka.input_topic, value.encode(), partition=i % 4)
    producer.flush()
    producer.close()

    async def behave(_s: SourceCoords) -> None:
        await asyncio.sleep(0.01)

    newcomer_owned: set[int] = set()

    def newcomer() -> None:
        c = KafkaConsumer(
            cfg.kafka.input_topic, bootstrap_servers=broker.bootstrap,
            group_id=cfg.kafka.group_id, enable_auto_commit=False,
            partition_assignment_strategy=[CooperativeStickyAssignor], **GROUP_SETTINGS,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            c.poll(200)
            newcomer_owned.update(tp.partition for tp in c.assignment())
        c.close(autocommit=False)

    async def scenario() -> tuple[int, Worker]:
        worker = Worker(cfg, ScriptedRunner(cfg, Metrics(), behave), Metrics(), "tiny")
        task = asyncio.create_task(worker.run())
        await asyncio.sleep(8)  # consuming, nothing committed yet (30 s interval)
        assert len(worker._runner.started) == 2000  # type: ignore[attr-defined]
        joiner = threading.Thread(target=newcomer)
        joiner.start()
        await asyncio.to_thread(joiner.join)
        assert worker._fatal is None, worker._fatal
        assert not task.done()
        worker._stopping.set()
        return await task, worker

    code, _worker = asyncio.run(scenario())
    assert code == ExitCode.OK
    assert newcomer_owned, "the newcomer was never given a partition"
    reader = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=cfg.kafka.group_id,
                           enable_auto_commit=False)  # fmt: skip
    committed = {p: reader.committed(TopicPartition(cfg.kafka.input_topic, p)) for p in range(4)}
    reader.close()
    # The newcomer commits nothing: offsets on its partitions come from the worker's revoke.
    for p in newcomer_owned:
        assert committed[p] == 500, (p, committed)
