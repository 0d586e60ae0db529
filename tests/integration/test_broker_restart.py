"""Issue #35 item 2: the embedded broker restarts on its port at once, and a port that really is
taken is reported with what holds it. Real Tansu, real clients, real sockets."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from kafka import KafkaProducer

import mmworker.devkit.broker as broker_module
from mmworker.devkit.broker import BrokerError, EmbeddedBroker, free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]


class BrokerCommand:
    """`mmworker broker --port PORT` left running; its first stdout line says it serves."""

    def __init__(self, port: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MMWORKER_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mmworker", "broker", "--port", str(port), "--partitions", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def first_line(self, timeout: float = 60.0) -> str | None:
        """Its first line, or None when it exited without one."""
        return self.lines.get(timeout=timeout)

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        _out, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, err


def _time_wait_on(port: int, within_s: float = 10.0) -> int:
    """Connections in TIME_WAIT on the broker's side of `port`, waiting up to `within_s` for
    one: the broker's socket gets there only once the client has answered its FIN, which the
    client's network thread does a moment after the broker is gone (one CI run checked first)."""
    deadline = time.monotonic() + within_s
    while True:
        found = sum(
            1
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_TIME_WAIT and c.laddr and c.laddr.port == port
        )
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_broker_command_restarts_at_once_after_a_stop_with_a_client_connected() -> None:
    """The broker closes its clients' connections when it stops, so they wait in TIME_WAIT on
    its port for a minute; the old probe (a bind without SO_REUSEADDR) refused that port for that
    minute and blamed "another broker"."""
    port = free_port()
    first = BrokerCommand(port)
    assert (first.first_line() or "").startswith(f"broker (Tansu, in memory) on 127.0.0.1:{port}")
    producer = KafkaProducer(bootstrap_servers=[f"127.0.0.1:{port}"], acks="all")
    producer.send("mmworker.jobs", b"job").get(timeout=30)
    code, _err = first.stop()  # the producer is still connected
    assert code == 0
    assert _time_wait_on(port) > 0  # the condition of the bug is there
    producer.close(timeout=5)

    started = time.monotonic()
    second = BrokerCommand(port)
    try:
        line = second.first_line()
        assert line is not None, second.stop()[1]
        assert line.startswith(f"broker (Tansu, in memory) on 127.0.0.1:{port}")
        assert time.monotonic() - started < 30
        again = KafkaProducer(bootstrap_servers=[f"127.0.0.1:{port}"], acks="all")
        again.send("mmworker.jobs", b"again").get(timeout=30)
        again.close(timeout=5)
    finally:
        code, err = second.stop()
    assert code == 0, err


def test_broker_command_names_what_holds_its_port() -> None:
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        command = BrokerCommand(port)
        assert command.first_line() is None
        code, err = command.stop()
    assert code == 2
    assert f"cannot listen on 127.0.0.1:{port}: pid {os.getpid()} (" in err, err
    assert "pick another port with --port" in err


def test_embedded_broker_on_a_taken_port_fails_instead_of_reaching_the_holder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tansu, unable to bind, exits (code 0) a few milliseconds after it starts; a start that only
    waited for a connect reached the port's holder first and called the broker started. The
    port check is skipped here so that Tansu itself meets the taken port, as it does when
    something takes the port between the check and Tansu's bind."""
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        with (
            pytest.raises(BrokerError, match=f"cannot listen on 127.0.0.1:{port}: pid"),
            monkeypatch.context() as patch,
        ):
            patch.setattr(broker_module, "port_holder", _free_then_real())
            EmbeddedBroker(port=port).start()
        with pytest.raises(BrokerError, match=f"pid {os.getpid()} .* listens there"):
            EmbeddedBroker(port=port).start()


def _free_then_real() -> object:
    """`port_holder` that reports the port free once (the check before the start), then
    answers truly (the diagnosis after Tansu's exit)."""
    calls: list[int] = []
    real = broker_module.port_holder

    def holder(port: int) -> str | None:
        calls.append(port)
        return None if len(calls) == 1 else real(port)

    return holder


def test_embedded_broker_restarts_on_its_port() -> None:
    with EmbeddedBroker() as first:
        port = first.port
        producer = KafkaProducer(bootstrap_servers=[first.bootstrap], acks="all")
        producer.send("t", b"x").get(timeout=30)
        first.stop()  # the producer is still connected
        assert _time_wait_on(port) > 0
        producer.close(timeout=5)
        with EmbeddedBroker(port=port) as second:
            again = KafkaProducer(bootstrap_servers=[second.bootstrap], acks="all")
            again.send("t", b"y").get(timeout=30)
            again.close(timeout=5)
