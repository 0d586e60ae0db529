"""The worker's own lines about the brokers: one when they are lost, one when they are back, and
kafka-python's per-attempt connection lines dropped in between (its other lines kept)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mmworker.broker_watch import ConnectionNoise, watch_brokers
from mmworker.config import KafkaConfig


def test_one_line_when_lost_and_one_when_back(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mmworker.broker_watch")
    answers = iter([None, "127.0.0.1:9: connection refused", "x", "x", None, None])
    seen: list[bool] = []

    def probe(_servers: object) -> str | None:
        return next(answers)

    async def scenario() -> None:
        cfg = KafkaConfig(bootstrap_servers="127.0.0.1:9")
        task = asyncio.create_task(watch_brokers(cfg, seen.append, 0.001, probe))
        while len(seen) < 2:
            await asyncio.sleep(0.001)
        task.cancel()

    asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and seen == [False, True]
    assert lines[0].startswith("lost the Kafka brokers (127.0.0.1:9: connection refused)")
    assert lines[1].startswith("Kafka brokers back after")


@pytest.mark.parametrize(
    ("name", "message", "kept"),
    [
        (
            "kafka.net.connection",
            "<KafkaConnection node_id=1>: Connection lost: socket disconnected",
            False,
        ),
        ("kafka.cluster", "Metadata refresh: failed KafkaConnectionError: 111 ECONNREFUSED", False),
        ("kafka.coordinator", "Heartbeat failed for group g because it is rebalancing", True),
        ("mmworker.worker", "publish to out failed (Connection lost); retrying in 0.2s", True),
    ],
)
def test_only_kafka_pythons_connection_lines_are_dropped(
    name: str, message: str, kept: bool
) -> None:
    record = logging.LogRecord(name, logging.ERROR, __file__, 1, message, None, None)
    assert ConnectionNoise().filter(record) is kept
