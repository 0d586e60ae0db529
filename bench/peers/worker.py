"""The worker peer: `mmworker run` in a subprocess, timed from the results it publishes.

Timed from the outside (result timestamps, the worker's own `timings`, its Prometheus metrics),
as an operator would see it, so nothing in the worker is changed to be measured.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import OUT, ROOT, PeerStats, ResultReader, mean, metric_delta, scrape
from bench.e2e_config import Options, child_env
from bench.e2e_jobs import image_job, make_topics, post, video_job


def worker_args(
    opts: Options,
    bootstrap: str,
    work: Path,
    topics: dict[str, str],
    group: str,
    model_path: str,
    port: int,
    allowed: list[Path],
) -> list[str]:
    """`mmworker run` arguments: the demo/test settings, then the bench's overrides.

    demo.worker_command is reused so the worker runs as the tests run it; its CPU-only choices
    are overridden (preprocess workers, context length) and `--model` is appended (argparse keeps
    the last value), so on a GPU host the engine gets its defaults (CUDA graphs, 0.92 memory).
    """
    from mmworker.devkit.demo import worker_command
    from mmworker.set_items import parse_sets

    extra: dict[str, object] = {
        "engine.load_format": opts.load_format,
        "engine.max_model_len": opts.max_model_len,
        "preprocess.allowed_roots": [str(p) for p in allowed],
        "metrics_port": port,
    }
    if opts.processes is not None:  # else the worker chooses (its `processes` default)
        extra["processes"] = opts.processes
    sets = parse_sets(opts.sets)

    def args(extra: dict[str, object]) -> list[str]:
        cmd = worker_command(bootstrap, work, topics, group, extra)
        assert cmd[1:3] == ["-m", "mmworker"], cmd[:3]
        return [*cmd[3:], "--model", model_path]

    # The pool is per host, split over the processes (the demo settings' own value is 1).
    n = opts.processes or chosen_processes(args({**extra, **sets}))
    extra["preprocess.workers"] = max(1, opts.preprocess_workers // n)
    return args({**extra, **sets})


def chosen_processes(args: list[str]) -> int:
    """The processes `mmworker run ARGS` runs on this host: its own choice where the bench sets
    none (read the same way the worker reads it, through its config)."""
    from bench.peers.raw import load_worker_config

    return int(load_worker_config(args).processes)


def processes_for(opts: Options) -> int:
    """Worker processes of a run: `--processes`, else what the worker chooses on this host."""
    if opts.processes is not None:
        return opts.processes
    unused = {"input": "unused", "output": "unused", "dlq": "unused"}
    return chosen_processes(worker_args(opts, "127.0.0.1:9092", OUT, unused, "probe", "m", 0, []))


class WorkerRun:
    """One `mmworker run` subprocess with its log in a file, optionally sampled by py-spy."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.log_path = log_path
        self.started = time.time()
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mmworker", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )
        self._spy: subprocess.Popen[bytes] | None = None

    def profile_start(self, raw_out: Path, nonblocking: bool = False) -> None:
        """Attach py-spy to the worker and its children (engine core, preprocess pool).

        Attached after start-up, not wrapped around it, so imports and engine initialisation do
        not drown the steady state in the profile.
        """
        spy = Path(sys.executable).parent / "py-spy"
        if not spy.exists():  # a --user install puts it on PATH, beside no interpreter
            spy = Path(shutil.which("py-spy") or spy)
        self._spy = subprocess.Popen(
            [
                str(spy),
                "record",
                "--pid",
                str(self.proc.pid),
                "--subprocesses",
                *(["--nonblocking"] if nonblocking else []),
                "--rate",
                "50",
                "--format",
                "raw",
                "-o",
                str(raw_out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)  # attach before the measured work starts

    def profile_stop(self) -> None:
        spy, self._spy = self._spy, None
        if spy is None:
            return
        spy.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
        try:
            spy.wait(timeout=60)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if " consuming " in self.log():
                return time.time()
            if not self.alive():
                raise RuntimeError(f"worker exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"worker not ready in {timeout_s}s:\n{self.log()[-3000:]}")

    def stop(self, timeout_s: float = 180.0) -> int | None:
        self.profile_stop()
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


def worker_pass(
    opts: Options,
    name: str,
    bootstrap: str,
    work: Path,
    model_path: str,
    images: list[Path],
    videos: list[Path],
    allowed: list[Path],
    port: int,
    profiling: bool = False,
) -> dict[str, Any]:
    topics = make_topics(bootstrap, name)
    args = worker_args(
        opts,
        bootstrap,
        work,
        topics,
        f"e2e-{name}-{uuid.uuid4().hex[:6]}",
        model_path,
        port,
        allowed,
    )
    img_jobs = [
        (f"{name}-img-{i}", image_job(f"{name}-img-{i}", p, opts.max_tokens, opts.ignore_eos))
        for i, p in enumerate(images)
    ]
    vid_jobs = [
        (f"{name}-vid-{i}", video_job(f"{name}-vid-{i}", p, opts.max_tokens, opts.ignore_eos))
        for i, p in enumerate(videos)
    ]
    produce_s = post(bootstrap, topics["input"], img_jobs) if img_jobs else 0.0
    print(
        f"[{name}] {len(img_jobs)} image jobs produced in {produce_s:.1f}s; starting worker",
        flush=True,
    )
    reader = ResultReader(bootstrap, [topics["output"], topics["dlq"]])
    if profiling:  # its own empty cache directory: a cold pass (argparse keeps the last value)
        args += ["--cache-dir", str(work / f"features-{name}")]
    if profiling or name.startswith("cold"):  # cold means an empty feature cache
        shutil.rmtree(work / ("features-" + name if profiling else "features"), ignore_errors=True)
    processes = chosen_processes(args)
    worker = WorkerRun(args, work / f"worker-{name}.log", child_env(opts))
    spy = profiling or opts.profile_measured
    out: dict[str, Any] = {"topics": topics, "log": str(worker.log_path), "processes": processes}
    try:
        ready = worker.wait_ready(opts.timeout_s)
        out["startup_s"] = round(ready - worker.started, 2)
        print(f"[{name}] worker ready after {out['startup_s']}s", flush=True)
        if img_jobs:
            ids = {k for k, _ in img_jobs}
            if spy:
                worker.profile_start(profile_path(name, "image"), opts.profile_measured)
            reader.wait_for(ids, opts.timeout_s, worker.alive)
            worker.profile_stop()
            after = scrape(port, processes)
            out["image"] = summarise_worker(name, "image", reader, ids, ready, {}, after)
            print(f"[{name}] images: {out['image']['jobs_per_s']:.2f} jobs/s", flush=True)
        if vid_jobs:
            reader.pump(50)
            if spy:
                worker.profile_start(profile_path(name, "video"), opts.profile_measured)
            before, posted_at = scrape(port, processes), time.time()
            post(bootstrap, topics["input"], vid_jobs)
            ids = {k for k, _ in vid_jobs}
            reader.wait_for(ids, opts.timeout_s, worker.alive)
            worker.profile_stop()
            after = scrape(port, processes)
            out["video"] = summarise_worker(name, "video", reader, ids, posted_at, before, after)
            print(f"[{name}] videos: {out['video']['jobs_per_s']:.2f} jobs/s", flush=True)
    finally:
        out["exit_code"] = worker.stop()
        reader.close()
        log = worker.log()
        out["log_tail"] = log[-1500:]
        for line in log.splitlines():
            if "engine busy" in line:
                out["shutdown_line"] = line.split(": ", 1)[-1]
            if m := re.search(r"max_num_batched_tokens=(\d+)", line):
                out["scheduler"] = {"max_num_batched_tokens": int(m.group(1))}
        if spy:
            out["profiles"] = {k: str(profile_path(name, k)) for k in ("image", "video")}
    return out


def profile_path(pass_name: str, kind: str) -> Path:
    return OUT / f"profile-{pass_name}-{kind}.txt"


def summarise_worker(
    pass_name: str,
    kind: str,
    reader: ResultReader,
    ids: set[str],
    ready: float,
    before: dict[str, float],
    after: dict[str, float],
) -> dict[str, Any]:
    seen = [reader.seen[i] for i in ids]
    ok = [s for s in seen if "usage" in s.doc]
    starts = [s.created - s.doc["timings"]["total_s"] for s in ok if s.created is not None]
    first_start = min(starts) if starts else ready
    last = max(s.received for s in seen)
    first_result = min(s.received for s in seen)
    tokens = [s.doc["usage"]["output_tokens"] for s in ok]
    timings = [s.doc["timings"] for s in ok]

    def stage(name: str) -> float | None:
        total = metric_delta(before, after, f'mmworker_stage_seconds_sum{{stage="{name}"}}')
        count = metric_delta(before, after, f'mmworker_stage_seconds_count{{stage="{name}"}}')
        return total / count if total is not None and count else None

    stats = PeerStats(
        peer=f"worker {pass_name}",
        kind=kind,
        jobs=len(seen),
        wall_s=last - first_start,
        output_tokens=sum(tokens),
        latencies_s=[t["total_s"] for t in timings],
        busy_s=metric_delta(before, after, "mmworker_engine_busy_seconds"),
        failures=len(seen) - len(ok),
    )
    doc = stats.to_json()
    from_ready = last - ready
    doc.update(
        {
            "jobs_per_s_from_ready": round(len(seen) / from_ready, 3) if from_ready > 0 else None,
            "jobs_per_s_first_to_last_result": round((len(seen) - 1) / (last - first_result), 3)
            if last > first_result
            else None,
            "output_tokens_min_max": [min(tokens, default=0), max(tokens, default=0)],
            "prompt_tokens_mean": mean(s.doc["usage"]["prompt_tokens"] for s in ok),
            "visual_tokens_mean": mean(s.doc["usage"]["visual_tokens"] for s in ok),
            "cache_hit_fraction": mean(1.0 if s.doc.get("cache_hit") else 0.0 for s in ok),
            "mean_s": {
                k: mean(t[k] for t in timings)
                for k in ("queue_wait_s", "fetch_s", "preprocess_s", "engine_s", "total_s")
            },
            "metrics_mean_stage_s": {n: stage(n) for n in ("fetch", "preprocess", "engine")},
            "failure_codes": sorted({s.doc.get("code", "?") for s in seen if "usage" not in s.doc}),
            # Hosts are shared: a load well above what this benchmark keeps busy (about the core
            # count while it runs) says another job competed for the CPU.
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        }
    )
    return doc
