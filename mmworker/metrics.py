"""Prometheus metrics of one worker, on a registry of its own (several workers per test process).

Names follow Prometheus' conventions: the unit in the name, `_total` on counters (the client adds
it), ratios as `_ratio`. Values another component owns (the engine's scheduler, the process
tree) are read at scrape time by collectors, so nothing polls them between scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
#: Broker timestamp → start/finish: from sub-second (live traffic) to hours (a backfill queue).
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800, 3600,
                    4 * 3600, 12 * 3600)  # fmt: skip


@dataclass(slots=True)
class EngineState:
    """The engine scheduler's last report (vLLM's SchedulerStats/IterationStats)."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    preemptions: int = 0


class EngineCollector(Collector):
    def __init__(self, state: Callable[[], EngineState]) -> None:
        self._state = state

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._state()
        yield GaugeMetricFamily(
            "mmworker_engine_requests_running", "Requests the engine is running", value=s.running
        )
        yield GaugeMetricFamily(
            "mmworker_engine_requests_waiting", "Requests queued in the engine's scheduler",
            value=s.waiting,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "mmworker_engine_kv_cache_usage_ratio", "Share of the KV cache in use (0-1)",
            value=s.kv_cache_usage,
        )  # fmt: skip
        yield CounterMetricFamily(
            "mmworker_engine_preemptions",
            "Requests preempted (KV cache full: their work is redone later)",
            value=s.preemptions,
        )


def process_role(proc: psutil.Process) -> str:
    """Which part of the worker a child process is, from its title: vLLM names its processes
    (`VLLM::EngineCore`), multiprocessing's spawned pool children run `spawn_main`."""
    try:
        title = " ".join(proc.cmdline()) or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "other"
    if "VLLM" in title or "EngineCore" in title:
        return "engine_core"
    if "spawn_main" in title or "multiprocessing" in title:
        return "preprocess"
    return "other"


class ProcessTreeCollector(Collector):
    """Resident memory of the worker and of the processes it started (engine core, preprocessing
    pool), by role: a leak shows in the process that has it."""

    def __init__(self, pid: int | None = None) -> None:
        self._proc = psutil.Process(pid)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "mmworker_process_resident_memory_bytes",
            "Resident memory of the worker's processes, by role",
            labels=["process"],
        )
        totals = {"worker": float(self._proc.memory_info().rss)}
        for child in self._proc.children(recursive=True):
            try:
                rss = float(child.memory_info().rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue  # it ended between listing and reading
            role = process_role(child)
            totals[role] = totals.get(role, 0.0) + rss
        for role, value in sorted(totals.items()):
            family.add_metric([role], value)
        yield family


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.jobs = Counter("mmworker_jobs", "Jobs finished, by outcome", ["outcome"], registry=r)
        self.failures = Counter("mmworker_failures", "Dead-lettered jobs", ["code"], registry=r)
        self.retries = Counter("mmworker_retries", "Retries of retryable failures", registry=r)
        self.in_flight = Gauge("mmworker_in_flight", "Jobs held by this worker", registry=r)
        self.paused = Gauge("mmworker_paused", "1 while consumption is paused", registry=r)
        self.commits = Counter("mmworker_commits", "Offset commits that succeeded", registry=r)
        self.commit_errors = Counter(
            "mmworker_commit_errors", "Offset commits that failed (retried)", registry=r
        )
        self.stage_seconds = Histogram(
            "mmworker_stage_seconds", "Time per stage", ["stage"], buckets=_STAGE_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.cache = Counter(
            "mmworker_feature_cache",
            "Feature cache lookups: hit, miss, or shared (joined a decode of the same media)",
            ["result"],
            registry=r,
        )
        self.engine_busy_seconds = Gauge(
            "mmworker_engine_busy_seconds", "Wall time with at least one request in the engine",
            registry=r,
        )  # fmt: skip
        self.suspects = Counter(
            "mmworker_suspect_jobs",
            "Jobs that were inside a dead engine: isolated (run alone) or condemned "
            "(dead-lettered as engine_crash)",
            ["action"],
            registry=r,
        )
        self.preempted = Counter(
            "mmworker_backfill_preempted",
            "Backfill generations aborted in the engine for a live job, then run again",
            registry=r,
        )
        self.output_tokens = Counter("mmworker_output_tokens", "Generated tokens", registry=r)
        self.engine_restarts = Counter(
            "mmworker_engine_restarts", "Engine cores started in-process after a death",
            registry=r,
        )  # fmt: skip
        self.engine_restart_seconds = Gauge(
            "mmworker_engine_restart_seconds", "How long the last in-process engine restart took",
            registry=r,
        )  # fmt: skip
        self.engine_cap = Gauge(
            "mmworker_engine_jobs_cap",
            "Most jobs inside the engine at once after load-dependent deaths (0: no cap)",
            registry=r,
        )
        self.response_formats = Counter(
            "mmworker_response_formats",
            "Guided jobs' response_format checks: compiled (first of its kind), cached (verdict "
            "known), refused (invalid_response_format)",
            ["result"],
            registry=r,
        )

        self.queue_wait_seconds = Histogram(
            "mmworker_queue_wait_seconds",
            "Broker timestamp of a job's record to the start of its work",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.end_to_end_seconds = Histogram(
            "mmworker_end_to_end_seconds",
            "Broker timestamp of a job's record to its result or failure acknowledged",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.consumer_lag = Gauge(
            "mmworker_consumer_lag_messages",
            "Records behind the partition's last known high-water mark, from this worker's "
            "committed offset (or its position before its first commit)",
            ["topic", "partition"],
            registry=r,
        )
        self._lag_labels: set[tuple[str, str]] = set()
        self.last_commit = Gauge(
            "mmworker_last_commit_timestamp_seconds",
            "Unix time of the last offset commit that succeeded",
            registry=r,
        )
        self.start_time = Gauge(
            "mmworker_start_time_seconds", "Unix time this worker process started", registry=r
        )
        self.start_time.set(time.time())
        self.ready = Gauge("mmworker_ready", "1 while /readyz answers 200", registry=r)
        self.feature_cache_bytes = Gauge(
            "mmworker_feature_cache_bytes", "Bytes in the prepared-feature cache", registry=r
        )
        self.feature_cache_entries = Gauge(
            "mmworker_feature_cache_entries", "Entries in the prepared-feature cache", registry=r
        )
        self.encoder_store_bytes = Gauge(
            "mmworker_encoder_store_bytes",
            "Bytes in the vision-encoder output store, as of its last pruning round",
            registry=r,
        )
        r.register(ProcessTreeCollector())

    def set_consumer_lag(self, lag: dict[tuple[str, str], float]) -> None:
        """Replace the lag series by `lag` ((topic, partition) → records) without a moment with
        fewer: each partition is set, then only those no longer there are removed. A scrape
        runs on another thread, and clearing first showed it no series at all meanwhile."""
        for labels, value in lag.items():
            self.consumer_lag.labels(*labels).set(value)
        for labels in self._lag_labels - lag.keys():
            self.consumer_lag.remove(*labels)
        self._lag_labels = set(lag)

    def watch_engine(self, state: Callable[[], EngineState]) -> None:
        self.registry.register(EngineCollector(state))
