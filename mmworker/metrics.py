"""Prometheus metrics of one worker, on a registry of its own (several workers per test process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


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
        self.output_tokens = Counter("mmworker_output_tokens", "Generated tokens", registry=r)
        self.response_formats = Counter(
            "mmworker_response_formats",
            "Guided jobs' response_format checks: compiled (first of its kind), cached (verdict "
            "known), refused (invalid_response_format)",
            ["result"],
            registry=r,
        )

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
