"""Health probes and metrics on one HTTP port, answered from a thread of their own.

The probes answer from a thread, not the event loop, so that a blocked loop is *reported* rather
than making the probe hang: the loop proves it runs by beating a heartbeat, and /livez compares
the heartbeat's age with a deadline. Kubernetes asks three different questions and each has its
own endpoint:

- /startupz: has the model loaded? (minutes for a 7B model; liveness is not checked until then,
  so a slow load is not mistaken for a wedge)
- /livez: should this process be restarted? The event loop beat within `health.loop_deadline_s`,
  the engine is not dead, and requests in the engine made progress within
  `health.engine_stall_s` (plus a grace in which the worker replaces a stuck core itself).
- /readyz: does this worker serve now? Started, in its consumer group with at least one
  partition, and not stopping.

Every answer is a small JSON object naming each check, so `curl` tells an on-call why.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from mmworker.config import HealthConfig

#: Most seconds between heartbeats of the event loop.
BEAT_EVERY_S = 1.0


@dataclass(frozen=True, slots=True)
class EngineProbe:
    """What liveness asks the engine; the engine module answers (no vLLM import here)."""

    alive: Callable[[], bool]
    #: Requests inside the engine now, and the monotonic time of their last progress.
    progress: Callable[[], tuple[int, float]]


class Health:
    """State the worker reports and the probes read; written from the loop, read from the
    server's threads (single attribute writes and reads, no lock needed)."""

    def __init__(self, cfg: HealthConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._cfg = cfg
        self._clock = clock
        self._beat = clock()
        self.engine: EngineProbe | None = None
        self.started = False
        self.stopping = False
        #: Partitions the consumer owns now (the worker keeps it current).
        self.assigned: Callable[[], int] = lambda: 0
        #: "up", "restarting" (a new core after a death, `mmworker.recovery`) or "degraded"
        #: (up, with fewer jobs inside after load-dependent deaths, `engine_cap`).
        self.engine_state = "up"
        self.engine_cap: int | None = None
        #: Seconds past `engine_stall_s` before a stall fails /livez, and a dead core may stay
        #: dead: the worker's own replacement (`mmworker.recovery`) gets its turn first (it
        #: finds an idle death within 5 s, and a job sees a busy one at once).
        self.stall_grace_s = 0.0
        self._dead_since: float | None = None

    def beat(self) -> None:
        self._beat = self._clock()

    def beat_every_s(self) -> float:
        """Often enough that a healthy loop never looks late."""
        return min(BEAT_EVERY_S, self._cfg.loop_deadline_s / 4)

    def livez(self) -> tuple[bool, dict[str, Any]]:
        now = self._clock()
        # The model load runs on the loop's thread; until it is done /startupz speaks for the
        # process, and a probe that ignores it (no startupProbe) still sees a live process.
        loop_age = now - self._beat if self.started else 0.0
        checks: dict[str, dict[str, Any]] = {
            "event_loop": {"ok": loop_age <= self._cfg.loop_deadline_s,
                           "heartbeat_age_s": round(loop_age, 3)},
        }  # fmt: skip
        if self.engine is not None:
            inside, since = self.engine.progress()
            stalled = now - since if inside else 0.0
            # A core being replaced is neither alive nor dead: restarting the process would
            # only start the same engine again, later.
            restarting = self.engine_state == "restarting"
            alive = self.engine.alive()
            if alive:
                self._dead_since = None
            elif self._dead_since is None:
                self._dead_since = now
            dead_s = 0.0 if self._dead_since is None else now - self._dead_since
            checks["engine"] = {
                "ok": restarting
                or (alive and stalled <= self._cfg.engine_stall_s + self.stall_grace_s)
                or (not alive and self.stall_grace_s > 0 and dead_s <= self.stall_grace_s),
                "alive": alive,
                "state": self.engine_state,
                "requests": inside,
                "no_progress_s": round(stalled, 3),
            }
        return all(c["ok"] for c in checks.values()), checks

    def readyz(self) -> tuple[bool, dict[str, Any]]:
        assigned = self.assigned()
        checks: dict[str, dict[str, Any]] = {
            "started": {"ok": self.started},
            "assignment": {"ok": assigned > 0, "partitions": assigned},
            "stopping": {"ok": not self.stopping},
            # Degraded still serves (ok); a restart does not, for its few seconds.
            "engine": {"ok": self.engine_state != "restarting", "state": self.engine_state,
                       "jobs_cap": self.engine_cap},
        }  # fmt: skip
        return all(c["ok"] for c in checks.values()), checks

    def startupz(self) -> tuple[bool, dict[str, Any]]:
        return self.started, {"started": {"ok": self.started}}

    def ready(self) -> float:
        """1 while /readyz would answer 200 (the `mmworker_ready` gauge)."""
        return 1.0 if self.readyz()[0] else 0.0


Probe = Callable[[], tuple[bool, dict[str, Any]]]
#: Seconds the supervisor waits for one process's answer before calling it failing.
CHILD_TIMEOUT_S = 3.0


def _fetch(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}{path}", timeout=CHILD_TIMEOUT_S
        ) as reply:
            return int(reply.status), bytes(reply.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read())
    except OSError as exc:  # not listening (yet), or no answer in time (URLError, TimeoutError)
        return 0, json.dumps({"status": "unreachable", "error": str(exc)}).encode()


class Processes:
    """The supervisor's view under `processes > 1`: one port for the pod, as Kubernetes probes
    and scrapes one port. Each probe asks every worker process (on `metrics_port + 1 + i`) and
    passes only if all pass, so a wedged process 1 fails liveness as process 0 would."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.stopping = False

    def _ask_all(self, path: str) -> tuple[bool, dict[str, Any]]:
        answers: dict[str, Any] = {}
        ok = True
        for index, port in enumerate(self.ports):
            status, body = _fetch(port, path)
            try:
                answers[str(index)] = json.loads(body)
            except ValueError:
                answers[str(index)] = {"status": f"HTTP {status}"}
            ok = ok and status == 200
        return ok, {"processes": answers}

    def livez(self) -> tuple[bool, dict[str, Any]]:
        return self._ask_all("/livez")

    def startupz(self) -> tuple[bool, dict[str, Any]]:
        return self._ask_all("/startupz")

    def readyz(self) -> tuple[bool, dict[str, Any]]:
        """Every process ready but for its assignment, and the pod holding at least one
        partition. A group can have more members than partitions; asking a partition of every
        process kept a pod with one idle process unready for good (a rollout that waits for it
        stalls), while each process is the same worker that a pod of one process would be:
        ready with one partition. The idle process's own answer (and `mmworker_ready` gauge)
        still says it holds none."""
        _ok, checks = self._ask_all("/readyz")
        ok, partitions = True, 0
        for answer in checks["processes"].values():
            own = answer.get("checks") if isinstance(answer, dict) else None
            if not isinstance(own, dict) or not own:
                ok = False  # unreachable, or not our probe's answer
                continue
            for name, check in own.items():
                if not isinstance(check, dict):
                    ok = False
                elif name == "assignment":
                    partitions += int(check.get("partitions") or 0)
                elif not check.get("ok"):
                    ok = False
        checks["assignment"] = {"ok": partitions > 0, "partitions": partitions}
        checks["stopping"] = {"ok": not self.stopping}
        return ok and partitions > 0 and not self.stopping, checks


class ProcessesCollector(Collector):
    """Every worker process's metrics in one scrape, each sample labelled `worker_process="i"`."""

    def __init__(self, ports: list[int]) -> None:
        self._ports = ports

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for index, port in enumerate(self._ports):
            status, body = _fetch(port, "/metrics")
            if status != 200:
                continue  # that process's series are absent from this scrape: `up`-style gaps
            for family in text_string_to_metric_families(body.decode()):
                out = merged.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                for sample in family.samples:
                    out.add_sample(sample.name, {**sample.labels, "worker_process": str(index)},
                                   sample.value)  # fmt: skip
        yield from merged.values()


def serve(
    port: int, registry: CollectorRegistry, health: Health | Processes, host: str = ""
) -> Any:
    """Start the HTTP server on a daemon thread; returns it (tests shut it down)."""
    probes: dict[str, Probe] = {
        "/livez": health.livez, "/readyz": health.readyz, "/startupz": health.startupz,
    }  # fmt: skip

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                self._reply(200, content_type, encoder(registry))
            elif path in probes:
                ok, checks = probes[path]()
                body = json.dumps({"status": "ok" if ok else "failing", "checks": checks})
                self._reply(200 if ok else 503, "application/json", body.encode() + b"\n")
            else:
                body = json.dumps({"status": "not_found", "endpoints": ["/metrics", *probes]})
                self._reply(404, "application/json", body.encode() + b"\n")

        def _reply(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            """Probes every few seconds would flood the log; errors still reach stderr."""

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="health-http", daemon=True).start()
    return server
