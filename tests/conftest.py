"""Fixtures shared by every test layer: a real embedded Kafka-protocol broker."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mmworker.devkit.broker import EmbeddedBroker

#: Group settings for the test broker: a consumer-group join there waits about half the session
#: timeout, so a 6 s session keeps each join near 3 s.
GROUP_SETTINGS = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}


@pytest.fixture(scope="session")
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as b:
        yield b
