"""Unit-test guard: no unit test may open a connection beyond loopback, whatever it resolves."""

from __future__ import annotations

import socket

import pytest
from mmworker_preprocess import fetch


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a test (or a bug) resolves, nothing may connect beyond 127.0.0.1 and ::1."""
    real = fetch._open_socket

    def guarded(address: str) -> socket.socket:
        assert address in ("127.0.0.1", "::1"), f"a test tried to connect to {address}"
        return real(address)

    monkeypatch.setattr(fetch, "_open_socket", guarded)
