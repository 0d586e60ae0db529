"""Fixtures shared by every test layer: a real embedded Kafka-protocol broker, and a server on
a Kafka port that never answers."""

from __future__ import annotations

import contextlib
import socket
import threading
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


class SilentBroker:
    """A server on a Kafka port that accepts connections and reads requests but never answers:
    a broker hung at the network level (or a firewall that lets SYN through). Every client call
    to it waits out its own timeout, which is what a signal must not have to wait for."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.bootstrap = f"127.0.0.1:{self._server.getsockname()[1]}"
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> SilentBroker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.close()
        for conn in self._conns:
            conn.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # closed
                return
            self._conns.append(conn)
            self.accepted += 1
            threading.Thread(target=self._swallow, args=(conn,), daemon=True).start()

    @staticmethod
    def _swallow(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while conn.recv(65536):
                pass


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that takes the real broker (the `broker` fixture) is an integration test wherever
    it lives, so `-m "not integration"` (`make test-fast`) runs only tests that need neither the
    broker nor the engine."""
    for item in items:
        if "broker" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)
