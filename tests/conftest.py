"""Fixtures shared by every test layer: a real embedded Kafka-protocol broker."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mmworker.devkit.broker import EmbeddedBroker

#: Group settings for the test broker (FIELD-NOTES §2): every join waits ~half the session timeout.
GROUP_SETTINGS = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}


@pytest.fixture(scope="session")
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as b:
        yield b
