"""The probes' verdicts, and a real event loop blocked under a real HTTP server."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry

from mmworker.app import _beat_forever
from mmworker.config import HealthConfig
from mmworker.devkit.broker import free_port
from mmworker.health import EngineProbe, Health, serve


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _get(port: int, path: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_liveness_ignores_the_loop_until_started_then_fails_on_a_late_heartbeat() -> None:
    clock = Clock()
    h = Health(HealthConfig(loop_deadline_s=10), clock)
    clock.now += 60  # the model load blocks the loop's thread: not a wedge
    assert h.livez()[0]
    h.started = True
    assert not h.livez()[0]  # started, and the heartbeat is 60 s old
    h.beat()
    clock.now += 9
    assert h.livez()[0]
    clock.now += 2
    ok, checks = h.livez()
    assert not ok and checks["event_loop"]["heartbeat_age_s"] == 11


def test_liveness_fails_on_an_engine_stalled_with_requests_or_dead() -> None:
    clock = Clock()
    h = Health(HealthConfig(engine_stall_s=30), clock)
    h.started = True
    state = {"alive": True, "inside": 0, "since": clock.now}
    h.engine = EngineProbe(
        alive=lambda: bool(state["alive"]),
        progress=lambda: (int(state["inside"]), float(state["since"])),
    )
    h.beat()
    clock.now += 5
    assert h.livez()[0]
    state["inside"] = 3
    clock.now += 31  # requests inside, no output for 36 s
    h.beat()
    ok, checks = h.livez()
    assert not ok and checks["engine"]["requests"] == 3 and checks["engine"]["no_progress_s"] > 30
    state["inside"] = 0  # idle for long is not a stall
    assert h.livez()[0]
    state["alive"] = False
    assert not h.livez()[0]


def test_a_worker_that_replaces_stuck_cores_gets_their_grace_before_liveness_fails() -> None:
    clock = Clock()
    h = Health(HealthConfig(engine_stall_s=30), clock)
    h.started, h.stall_grace_s = True, 15.0
    since = clock.now
    h.engine = EngineProbe(alive=lambda: True, progress=lambda: (2, since))
    clock.now += 44
    h.beat()
    assert h.livez()[0]  # stuck for 44 s: the worker's own replacement is due, not a restart
    clock.now += 2
    h.beat()
    assert not h.livez()[0]  # 46 s: the replacement never began
    # A dead core the worker replaces itself: dead for the grace, not a restart of the pod
    # (before a job or the calm loop has begun the replacement, the state still says "up").
    state = {"alive": False}
    h.engine = EngineProbe(alive=lambda: state["alive"], progress=lambda: (0, clock.now))
    assert h.livez()[0]
    clock.now += 15
    h.beat()
    assert h.livez()[0]
    clock.now += 1
    h.beat()
    assert not h.livez()[0]  # dead for 16 s and not being replaced
    state["alive"] = True
    assert h.livez()[0]
    state["alive"] = False  # a later death gets its own grace
    assert h.livez()[0]


def test_readiness_needs_start_an_assignment_and_no_stop() -> None:
    h = Health(HealthConfig())
    assert h.readyz()[0] is False and h.startupz()[0] is False
    h.started = True
    assert h.startupz()[0] and not h.readyz()[0]  # in no group yet
    h.assigned = lambda: 2
    assert h.readyz()[0] and h.ready() == 1.0
    h.stopping = True
    ok, checks = h.readyz()
    assert not ok and checks["stopping"]["ok"] is False and h.ready() == 0.0


def test_a_blocked_event_loop_fails_livez_over_http_and_recovers() -> None:
    """The server answers from its own thread while the loop is stuck in a blocking call."""
    h = Health(HealthConfig(loop_deadline_s=0.4))
    h.started = True
    port = free_port()
    server = serve(port, CollectorRegistry(), h, host="127.0.0.1")
    seen: list[int] = []

    def probe_while_blocked() -> None:
        time.sleep(1.0)  # the loop is blocked from 0.3 s to 2.0 s
        seen.append(_get(port, "/livez")[0])

    async def main() -> None:
        beating = asyncio.create_task(_beat_forever(h))
        await asyncio.sleep(0.3)
        seen.append(_get(port, "/livez")[0])  # healthy loop
        prober = threading.Thread(target=probe_while_blocked)
        prober.start()
        time.sleep(1.7)
        await asyncio.to_thread(prober.join)
        await asyncio.sleep(0.3)
        seen.append(_get(port, "/livez")[0])
        beating.cancel()

    try:
        asyncio.run(main())
        assert seen == [200, 503, 200], seen
    finally:
        server.shutdown()


def test_the_supervisor_answers_for_every_process_on_one_port() -> None:
    """processes > 1: one probe port for the pod; a process that fails (or stops answering)
    fails the pod's probe, and one scrape carries every process's series."""
    from prometheus_client import Counter, generate_latest

    from mmworker.health import Processes, ProcessesCollector

    children, servers, ports = [], [], []
    for i in range(2):
        h = Health(HealthConfig())
        h.started, h.assigned = True, (lambda: 1)
        h.beat()
        registry = CollectorRegistry()
        Counter("mmworker_jobs", "jobs", ["outcome"], registry=registry).labels("result").inc(i + 1)
        port = free_port()
        servers.append(serve(port, registry, h, host="127.0.0.1"))
        children.append(h)
        ports.append(port)
    supervisor = Processes(ports)
    merged = CollectorRegistry()
    merged.register(ProcessesCollector(ports))
    top = free_port()
    servers.append(serve(top, merged, supervisor, host="127.0.0.1"))
    try:
        assert _get(top, "/readyz")[0] == 200 and _get(top, "/livez")[0] == 200
        text = generate_latest(merged).decode()
        assert 'mmworker_jobs_total{outcome="result",worker_process="0"} 1.0' in text, text
        assert 'mmworker_jobs_total{outcome="result",worker_process="1"} 2.0' in text, text
        children[1].assigned = lambda: 0  # more group members than partitions: process 1 idle
        status, body = _get(top, "/readyz")
        assert status == 200 and body["checks"]["assignment"]["partitions"] == 1, body
        assert body["checks"]["processes"]["1"]["status"] == "failing"  # its own view stays
        children[0].assigned = lambda: 0  # the pod holds no partition at all
        status, body = _get(top, "/readyz")
        assert status == 503 and not body["checks"]["assignment"]["ok"], body
        children[0].assigned = lambda: 2
        children[1].engine_state = "restarting"  # any other check of a process still counts
        assert _get(top, "/readyz")[0] == 503
        children[1].engine_state = "up"
        servers[1].shutdown()
        servers[1].server_close()  # process 1 stops answering: a wedge to the probe
        status, body = _get(top, "/livez")
        assert status == 503 and body["checks"]["processes"]["1"]["status"] == "unreachable"
        assert body["checks"]["processes"]["0"]["status"] == "ok"
        supervisor.stopping = True
        assert _get(top, "/readyz")[0] == 503
    finally:
        for server in servers:
            server.shutdown()
