"""Memory soak: does a real `mmworker run` process tree stay flat over tens of thousands of jobs?

A throughput benchmark runs a few hundred jobs and cannot see a cache that fills for an hour; this
one keeps a worker busy with a realistic mix (new images, repeats of a hot set, some short
videos, new and repeated) and samples the resident memory of every process in the worker's tree
(the worker itself, vLLM's engine core, the preprocess pool, multiprocessing's resource tracker)
against the number of jobs answered. The figure that matters is the slope over the second half
of the run: a bounded cache has filled by then, so anything still growing is a leak. RSS summed
over the tree counts shared library pages once per process; PSS and anonymous memory (from
/proc/PID/smaps_rollup) are kept beside it, so a reader can tell real growth from double counting.

`--probe` puts a `sitecustomize` on the worker's PYTHONPATH that answers SIGUSR2 in every Python
process of the tree with a JSON of its vLLM LRU caches (entries, bytes), live torch tensors,
glibc malloc counters and, with `--tracemalloc`, the Python allocation sites that grew since the
last probe: evidence of *what* grows, taken inside the process without touching the worker.

    .venv/bin/python bench/soak.py --jobs 2000 --tag quick                     # ~3 min
    .venv/bin/python bench/soak.py --jobs 5000 --tag before --probe \\
        --set engine.mm_processor_cache_gb=null                              # vLLM's 4 GiB
    nohup .venv/bin/python bench/soak.py --jobs 20000 --tag after-knobs --probe \\
        --env MALLOC_MMAP_THRESHOLD_=131072 --env ONEDNN_PRIMITIVE_CACHE_CAPACITY=8 \\
        > bench/out/soak.out 2>&1 &                                          # ~10-30 min

`--env` exists because two of the growths found here are not settings of the worker: glibc
keeping freed tensor memory in its heaps (its mmap threshold rises to 32 MiB after the first
large free, so later tensors come from the heap) and oneDNN's primitive cache (a JIT kernel per
new input shape, up to 1,024 of them); both are read from the environment at process start.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import OUT, ROOT, add_set_option, environment, print_table, read_from_start

RESULTS = ROOT / "bench" / "results"
PARTITIONS = 3
#: The bar for "flat": a worker that answers a million jobs a week grows under 5 GiB in that week.
GOAL_MIB_PER_1000_JOBS = 5.0

#: Fields of /proc/PID/smaps_rollup kept per process (kB in the file, MiB in the report).
SMAPS_FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Anonymous", "Shared_Clean", "Swap")


@dataclass
class Options:
    jobs: int = 20_000
    sets: list[str] = field(default_factory=list)
    #: Environment of the worker's tree, e.g. glibc malloc tunables (read at process start).
    env: list[str] = field(default_factory=list)
    tag: str = "run"
    #: Share of image jobs that bring an image never seen before (the rest repeat a hot set).
    distinct_fraction: float = 0.6
    hot_images: int = 200
    #: Every Nth job is a video; half of those are new clips, half repeat a small pool.
    video_every: int = 40
    video_pool: int = 8
    max_tokens: int = 8
    sample_s: float = 5.0
    #: Jobs posted but not answered, at most: enough that the worker never starves, few enough
    #: that the broker is not holding the whole run at once.
    window: int = 600
    probe: bool = False
    tracemalloc: bool = False
    #: Jobs between two marks (memory maps of every process, and the probes with --probe);
    #: 0: at a quarter, half and three quarters of the run.
    probe_every: int = 0
    timeout_s: float = 3600.0
    out: Path | None = None
    keep: bool = False


def build_parser() -> argparse.ArgumentParser:
    d = Options()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--jobs", type=int, default=d.jobs, help="jobs to push (≥ 20,000 for a soak)")
    add_set_option(p, "worker setting, e.g. --set engine.mm_processor_cache_gb=0.5 (repeatable)")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment variable for the worker's tree, e.g. MALLOC_ARENA_MAX=2 (repeatable)",
    )
    p.add_argument("--tag", default=d.tag, help="names the report: bench/results/soak-TAG.json")
    p.add_argument("--distinct-fraction", type=float, default=d.distinct_fraction)
    p.add_argument("--hot-images", type=int, default=d.hot_images, help="size of the repeated set")
    p.add_argument("--video-every", type=int, default=d.video_every, help="0: no videos")
    p.add_argument("--video-pool", type=int, default=d.video_pool, help="repeated clips")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--sample-s", type=float, default=d.sample_s, help="seconds between samples")
    p.add_argument("--window", type=int, default=d.window, help="most jobs posted, unanswered")
    p.add_argument(
        "--probe", action="store_true", help="SIGUSR2 probes inside each process (see above)"
    )
    p.add_argument(
        "--tracemalloc", action="store_true", help="with --probe: trace Python allocations (slow)"
    )
    p.add_argument(
        "--probe-every",
        type=int,
        default=d.probe_every,
        metavar="JOBS",
        help="jobs between marks (memory maps, and probes with --probe); 0: quarters",
    )
    p.add_argument("--timeout-s", type=float, default=d.timeout_s)
    p.add_argument("--out", type=Path, default=None, help="default bench/results/soak-TAG.json")
    p.add_argument("--keep", action="store_true", help="keep the work directory (cache, media)")
    return p


# ---------------------------------------------------------------------------------------------
# The job mix


class JobMaker:
    """Deterministic mix, made lazily: 20,000 inline images would otherwise sit in our memory.

    Distinct images get distinct pixels (not just distinct bytes), so every cache downstream
    (feature cache, vLLM's processor and encoder caches) sees a genuinely new item. Sizes vary
    so allocators see the mixed shapes production sends.
    """

    IMAGE_SIZES = ((128, 96), (160, 120), (224, 224), (256, 192), (320, 240))

    def __init__(self, opts: Options, media_dir: Path) -> None:
        self._opts = opts
        self._dir = media_dir
        self._rng = random.Random(0)
        self._hot: dict[int, bytes] = {}
        self.counts: dict[str, int] = {
            "image_new": 0,
            "image_repeat": 0,
            "video_new": 0,
            "video_repeat": 0,
        }

    def job(self, i: int) -> tuple[str, bytes]:
        from mmworker_schemas import GenerationParams, Job, MediaRef

        o = self._opts
        gen = GenerationParams(max_tokens=o.max_tokens, ignore_eos=True)
        job_id = f"soak-{i}"
        if o.video_every and i % o.video_every == o.video_every - 1:
            new = (i // o.video_every) % 2 == 0
            seed = 10_000_000 + i if new else self._rng.randrange(o.video_pool)
            self.counts["video_new" if new else "video_repeat"] += 1
            ref = MediaRef(uri=self._video(seed).as_uri())
        elif self._rng.random() < o.distinct_fraction:
            self.counts["image_new"] += 1
            ref = MediaRef(data=self._image(1_000_000 + i))
        else:
            self.counts["image_repeat"] += 1
            ref = MediaRef(data=self._hot_image(self._rng.randrange(o.hot_images)))
        job = Job(job_id=job_id, media=[ref], generation=gen)
        return job_id, job.model_dump_json().encode()

    def _image(self, seed: int) -> bytes:
        from mmworker.devkit.samples import sample_image

        width, height = self.IMAGE_SIZES[seed % len(self.IMAGE_SIZES)]
        return sample_image(width=width, height=height, seed=seed)

    def _hot_image(self, k: int) -> bytes:
        if k not in self._hot:
            self._hot[k] = self._image(k)
        return self._hot[k]

    def _video(self, seed: int) -> Path:
        """2 s, 8 fps, 160×120: sampled at 2 fps → 4 frames, upscaled to the per-frame floor."""
        from mmworker.devkit.samples import sample_video

        path = self._dir / f"clip-{seed}.mp4"
        if not path.exists():
            path.write_bytes(sample_video(seconds=2.0, fps=8, width=160, height=120, seed=seed))
        return path


# ---------------------------------------------------------------------------------------------
# Memory of the worker's process tree


def smaps_rollup(pid: int) -> dict[str, float] | None:
    """MiB per field; None once the process is gone (it may exit between listing and reading)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    out: dict[str, float] = {}
    for line in text.splitlines()[1:]:
        name, _, rest = line.partition(":")
        if name in SMAPS_FIELDS:
            out[name] = int(rest.split()[0]) / 1024
    return out


def memory_regions(pid: int) -> dict[str, dict[str, int]] | None:
    """Resident kB per mapping of a process, keyed by start address and what it maps.

    Summed counters (RSS, mallinfo) say *that* a process grows; a mapping says *where*: glibc's
    main heap (`[heap]`), a thread arena (anonymous, inside a 64 MiB reservation), one large
    allocation mmapped by malloc or torch, a file read through mmap (weights, the feature cache).
    mallinfo counts a mapping's whole size, touched or not, so a buffer whose pages are touched
    over hours (a KV cache used block by block) shows here and not there.
    """
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    regions: dict[str, dict[str, int]] = {}
    current: dict[str, int] | None = None
    for line in text.splitlines():
        head = line.split(maxsplit=5)
        if "-" in head[0] and not head[0].endswith(":"):
            start, end = (int(x, 16) for x in head[0].split("-"))
            name = head[5] if len(head) > 5 else "[anon]"
            current = {"size_kb": (end - start) // 1024, "rss_kb": 0, "anon_kb": 0}
            regions[f"{head[0].split('-')[0]} {head[1]} {name}"] = current
        elif current is not None and head[0] in ("Rss:", "Anonymous:"):
            current["rss_kb" if head[0] == "Rss:" else "anon_kb"] = int(head[1])
    return regions


def region_class(key: str, size_kb: int) -> str:
    """Coarse kind of a mapping: what a reader of the growth table needs to tell apart."""
    start, _perms, name = key.split(" ", 2)
    if name == "[anon]":
        # glibc reserves each thread arena's heap at a 64 MiB-aligned address.
        arena = int(start, 16) % (64 << 20) == 0
        return "anon: malloc thread arena" if arena else "anon: mmap (large allocation)"
    if name.startswith("["):
        return name
    if ".so" in name:
        return "shared library"
    return "file: " + name.rsplit("/", 1)[-1][:40]


def region_growth(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], top: int = 8
) -> dict[str, Any]:
    """MiB of resident memory gained between two snapshots: by kind, and the mappings that
    gained most (a mapping that appeared counts whole, one that went away counts negative)."""
    keys = set(before) | set(after)
    empty = {"size_kb": 0, "rss_kb": 0, "anon_kb": 0}
    rows: list[dict[str, Any]] = []
    by_class: dict[str, float] = {}
    for k in keys:
        a, b = before.get(k, empty), after.get(k, empty)
        d = (b["rss_kb"] - a["rss_kb"]) / 1024
        size = max(a["size_kb"], b["size_kb"])
        cls = region_class(k, size)
        by_class[cls] = by_class.get(cls, 0.0) + d
        rows.append({"mapping": k, "size_mib": round(size / 1024, 1), "rss_gain_mib": round(d, 2),
                     "rss_mib": round(b["rss_kb"] / 1024, 1)})  # fmt: skip
    rows.sort(key=lambda r: -abs(r["rss_gain_mib"]))
    kinds = sorted(by_class.items(), key=lambda kv: kv[1])
    return {
        "by_kind_mib": {k: round(v, 1) for k, v in kinds if abs(v) >= 0.5},
        "top_mappings": [r for r in rows[:top] if r["rss_gain_mib"] != 0],
    }


def mark_regions(root: int, label: str, answered: int) -> dict[str, Any]:
    """Every process's mappings at one mark (kept whole only until the summary is made)."""
    procs = {}
    for pid in tree_pids(root):
        regions = memory_regions(pid)
        if regions is not None:
            procs[str(pid)] = {"role": role_of(pid, root), "regions": regions}
    return {"label": label, "answered": answered, "processes": procs}


def regions_report(marks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Growth per process from each mark to the next (processes present at both)."""
    out = []
    for a, b in itertools.pairwise(marks):
        for pid, pb in b["processes"].items():
            pa = a["processes"].get(pid)
            if pa is None:
                continue
            growth = region_growth(pa["regions"], pb["regions"])
            span = {"from": a["answered"], "to": b["answered"], "pid": int(pid)}
            out.append({**span, "role": pb["role"], **growth})
    return out


def role_of(pid: int, root: int) -> str:
    """What a process of the tree is, from its command line (vLLM retitles its engine core)."""
    if pid == root:
        return "worker"
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        cmd = raw.replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    if "EngineCore" in cmd:
        return "engine core"
    if "resource_tracker" in cmd:
        return "resource tracker"
    if "spawn_main" in cmd:
        return "preprocess pool"
    return "other: " + cmd[:60]


def tree_pids(root: int) -> list[int]:
    import psutil

    try:
        proc = psutil.Process(root)
        return [root, *(c.pid for c in proc.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def sample_tree(root: int) -> list[dict[str, Any]]:
    procs = []
    for pid in tree_pids(root):
        mem = smaps_rollup(pid)
        if mem is not None:
            procs.append({"pid": pid, "role": role_of(pid, root), **mem})
    return procs


def by_role(procs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    roles: dict[str, dict[str, float]] = {}
    for p in procs:
        r = roles.setdefault(p["role"], {"n": 0, **dict.fromkeys(SMAPS_FIELDS, 0.0)})
        r["n"] += 1
        for f in SMAPS_FIELDS:
            r[f] += p.get(f, 0.0)
    return {k: {f: round(v, 1) for f, v in r.items()} for k, r in roles.items()}


def slope_per_1000(points: list[tuple[float, float]]) -> float | None:
    """Least-squares MiB per 1,000 jobs over (jobs answered, MiB) points."""
    if len(points) < 3:
        return None
    xs, ys = [p[0] / 1000 for p in points], [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


# ---------------------------------------------------------------------------------------------
# In-process probes (SIGUSR2 → JSON), installed through sitecustomize in --probe mode

PROBE_SITECUSTOMIZE = textwrap.dedent(
    '''
    """Soak probe: SIGUSR2 writes what this process holds to $SOAK_PROBE_DIR (bench/soak.py)."""
    import os
    import signal

    _DIR = os.environ.get("SOAK_PROBE_DIR")
    _STATE = {"prev": None, "n": 0}


    def _mallinfo():
        import ctypes

        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost")]

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        m = libc.mallinfo2()
        mib = 1024 * 1024
        return {"heap_arena_mib": m.arena / mib, "mmap_mib": m.hblkhd / mib,
                "in_use_mib": (m.uordblks + m.hblkhd) / mib, "free_in_heap_mib": m.fordblks / mib}


    def _chain(frame):
        while frame is not None:
            yield frame
            frame = frame.f_back


    def _probe(signum, frame):
        # A handler that raises would raise inside whatever the main thread was doing, and
        # stop the worker under test: report the error instead.
        try:
            _probe_now()
        except Exception as exc:  # noqa: BLE001
            _STATE["n"] += 1
            _write({"pid": os.getpid(), "argv": [], "lru_caches": [], "error": repr(exc)})


    def _write(out):
        import json

        path = os.path.join(_DIR, f"probe-{os.getpid()}-{_STATE['n']}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(path + ".tmp", path)


    def _probe_now():
        import gc
        import json
        import sys
        import time
        import tracemalloc

        out = {"pid": os.getpid(), "time": time.time(), "argv": sys.argv[:2], "lru_caches": []}
        try:
            out["malloc"] = _mallinfo()
        except Exception as exc:  # noqa: BLE001
            out["malloc"] = repr(exc)
        cache_mod = sys.modules.get("vllm.utils.cache")
        torch = sys.modules.get("torch")
        objs = gc.get_objects()
        counts = {}
        for o in objs:
            t = type(o)
            name = f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', '?')}"
            counts[name] = counts.get(name, 0) + 1
        out["object_counts"] = sorted(counts.items(), key=lambda kv: -kv[1])[:60]
        out["threads"] = len(sys._current_frames())
        if cache_mod is not None:
            # vLLM gc.freeze()s after start-up, and frozen objects are not in get_objects():
            # reach the caches made before that through the live frames' locals too.
            found = {id(o): o for o in objs if isinstance(o, cache_mod.LRUCache)}
            todo = [v for fr in sys._current_frames().values() for f in _chain(fr)
                    for v in f.f_locals.values()]
            seen = set()
            for _ in range(4):
                nxt = []
                for o in todo:
                    if id(o) in seen:
                        continue
                    seen.add(id(o))
                    if isinstance(o, cache_mod.LRUCache):
                        found[id(o)] = o
                    elif hasattr(o, "__dict__") and type(o).__module__.startswith("vllm"):
                        nxt += list(vars(o).values())
                todo = nxt
            for o in found.values():
                values = list(o.values())[:1]
                out["lru_caches"].append({
                    "entries": len(o), "currsize_mib": o.currsize / (1024 * 1024),
                    "maxsize_mib": o.maxsize / (1024 * 1024),
                    "value_type": type(values[0]).__qualname__ if values else None})
        if torch is not None:
            seen, n, total = set(), 0, 0
            for o in objs:
                try:
                    if isinstance(o, torch.Tensor) and o.device.type == "cpu":
                        st = o.untyped_storage()
                        if st.data_ptr() not in seen:
                            seen.add(st.data_ptr())
                            n += 1
                            total += st.nbytes()
                except Exception:  # noqa: BLE001
                    continue
            out["torch_cpu_storages"] = {"count": n, "mib": total / (1024 * 1024)}
        del objs
        if tracemalloc.is_tracing():
            snap = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__)])
            cur, peak = tracemalloc.get_traced_memory()
            out["tracemalloc"] = {"traced_mib": cur / 1048576, "peak_mib": peak / 1048576}
            stats = (snap.compare_to(_STATE["prev"], "lineno") if _STATE["prev"] is not None
                     else snap.statistics("lineno"))
            out["tracemalloc"]["top"] = [
                {"where": str(s.traceback[0]), "mib": s.size / (1024 * 1024),
                 "diff_mib": getattr(s, "size_diff", s.size) / (1024 * 1024), "count": s.count}
                for s in stats[:15]]
            _STATE["prev"] = snap
        _STATE["n"] += 1
        _write(out)


    def _install():
        signal.signal(signal.SIGUSR2, _probe)
        open(os.path.join(_DIR, f"ready-{os.getpid()}"), "w").close()


    if _DIR:
        _install()
        os.register_at_fork(after_in_child=_install)
    '''
)


def probe_env(env: dict[str, str], work: Path, tracing: bool) -> Path:
    site = work / "probe-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(PROBE_SITECUSTOMIZE)
    probes = work / "probes"
    probes.mkdir(exist_ok=True)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    env["SOAK_PROBE_DIR"] = str(probes)
    if tracing:
        env["PYTHONTRACEMALLOC"] = "1"
    return probes


def fire_probes(root: int, probes: Path, label: str, wait_s: float = 60.0) -> list[dict[str, Any]]:
    """SIGUSR2 to every process of the tree that installed the probe; collect their answers."""
    before = set(probes.glob("probe-*.json"))
    targets = [p for p in tree_pids(root) if (probes / f"ready-{p}").exists()]
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + wait_s
    got: list[Path] = []
    while time.monotonic() < deadline:
        got = sorted(set(probes.glob("probe-*.json")) - before)
        if len({p.name.split("-")[1] for p in got}) >= len(targets):
            break
        time.sleep(0.5)
    answers = []
    for path in got:
        doc = json.loads(path.read_text())
        doc["label"], doc["role"] = label, role_of(doc["pid"], root)
        answers.append(doc)
    return answers


# ---------------------------------------------------------------------------------------------
# The run


class Answers:
    """Counts answered job ids on the output and dead-letter topics; keeps no documents."""

    def __init__(self, bootstrap: str, topics: list[str]) -> None:
        self._consumer = read_from_start(bootstrap, topics)
        self._dlq = topics[-1]
        self.ids: set[str] = set()
        self.failures: dict[str, int] = {}
        self.duplicates = 0

    def pump(self, timeout_ms: int = 100) -> None:
        for records in self._consumer.poll(timeout_ms=timeout_ms).values():
            for r in records:
                doc = json.loads(r.value)
                job_id = str(doc.get("job_id") or r.key.decode())
                if job_id in self.ids:
                    self.duplicates += 1
                    continue
                self.ids.add(job_id)
                if r.topic == self._dlq:
                    code = str(doc.get("code", "?"))
                    self.failures[code] = self.failures.get(code, 0) + 1

    def close(self) -> None:
        self._consumer.close()


def worker_settings(opts: Options, work: Path) -> dict[str, object]:
    from mmworker.set_items import parse_sets

    return {
        "preprocess.allowed_roots": [str(work)],
        "cache.min_image_pixels": 0,  # cache every image too: the feature cache is under test
        **parse_sets(opts.sets),
    }


def run(opts: Options) -> dict[str, Any]:
    from kafka import KafkaProducer

    from bench.e2e_config import Options as E2EOptions
    from bench.e2e_config import child_env, resolve_model_path
    from mmworker.config import KafkaConfig
    from mmworker.devkit.broker import EmbeddedBroker
    from mmworker.devkit.demo import worker_command
    from mmworker.kafka_io import ensure_topics

    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"soak-{opts.tag}-", dir=OUT))
    media = work / "media"
    media.mkdir()
    model_path = resolve_model_path("tiny")
    env = child_env(E2EOptions(model="tiny"))
    for item in opts.env:
        name, _, value = item.partition("=")
        env[name] = value
    probes = probe_env(env, work, opts.tracemalloc) if opts.probe else None
    maker = JobMaker(opts, media)
    report: dict[str, Any] = {
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
        "environment": environment(),
        "work_dir": str(work),
        "samples": [],
        "probes": [],
        "ok": False,
    }
    with EmbeddedBroker() as broker:
        tag = uuid.uuid4().hex[:6]
        topics = {k: f"soak-{tag}.{k}" for k in ("input", "output", "dlq")}
        ensure_topics(
            KafkaConfig(bootstrap_servers=broker.bootstrap),
            {topics["input"]: PARTITIONS, topics["output"]: PARTITIONS, topics["dlq"]: 1},
        )
        cmd = worker_command(
            broker.bootstrap, work, topics, f"soak-{tag}", worker_settings(opts, work)
        )
        cmd += ["--model", model_path]  # the built tiny model (argparse keeps the last value)
        report["worker_command"] = cmd[1:]
        log_path = work / "worker.log"
        with log_path.open("wb") as log:
            worker = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                start_new_session=True,
            )  # fmt: skip
        report["worker_log"] = str(log_path)
        producer = KafkaProducer(
            bootstrap_servers=[broker.bootstrap], acks=1, linger_ms=20, max_request_size=8 << 20
        )
        answers = Answers(broker.bootstrap, [topics["output"], topics["dlq"]])
        report["region_marks"] = []  # whole memory maps: used for region_growth, not written
        try:
            _drive(opts, worker, log_path, producer, topics["input"], answers, maker, probes,
                   report)  # fmt: skip
        except (RuntimeError, TimeoutError) as exc:  # keep what was sampled: it is the evidence
            report["error"] = str(exc)
            print(f"[{opts.tag}] stopped early: {exc}", file=sys.stderr, flush=True)
            if worker.poll() is None:  # a timeout: the tree is still there to be measured
                marks = report["region_marks"]
                marks.append(mark_regions(worker.pid, "stopped", len(answers.ids)))
                report["region_growth"] = regions_report(marks)
        finally:
            producer.close()
            answers.close()
            report["worker_exit_code"] = _stop(worker)
            report["worker_log_tail"] = log_path.read_text(errors="replace")[-3000:]
    del report["region_marks"]
    report["job_mix"] = maker.counts
    report["summary"] = summarise(report)
    if not opts.keep:
        shutil.rmtree(work / "features", ignore_errors=True)
        shutil.rmtree(media, ignore_errors=True)
    return report


def _drive(
    opts: Options,
    worker: subprocess.Popen[bytes],
    log_path: Path,
    producer: Any,
    topic: str,
    answers: Answers,
    maker: JobMaker,
    probes: Path | None,
    report: dict[str, Any],
) -> None:
    """Post ahead of the worker, read answers, sample memory; until every job is answered."""
    started = time.monotonic()
    deadline = started + opts.timeout_s
    while " consuming " not in log_path.read_text(errors="replace"):
        if worker.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"worker did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    ready = time.monotonic()
    report["startup_s"] = round(ready - started, 1)
    print(f"[{opts.tag}] worker ready after {report['startup_s']}s", flush=True)
    samples: list[dict[str, Any]] = report["samples"]
    posted, next_sample = 0, ready
    every = opts.probe_every
    probe_marks = (
        list(range(every, opts.jobs, every))
        if every > 0
        else sorted({opts.jobs // 4, opts.jobs // 2, 3 * opts.jobs // 4})
    )
    region_marks: list[dict[str, Any]] = report["region_marks"]
    first_answer: float | None = None
    while len(answers.ids) < opts.jobs:
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"{opts.jobs - len(answers.ids)} jobs unanswered")
        if worker.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"worker exited {worker.returncode}:\n{tail}")
        room = min(opts.jobs - posted, opts.window - (posted - len(answers.ids)))
        for _ in range(max(0, min(room, 100))):
            key, value = maker.job(posted)
            producer.send(topic, key=key.encode(), value=value)
            posted += 1
        answers.pump(100)
        if first_answer is None and answers.ids:
            first_answer = time.monotonic()
        if now >= next_sample:
            samples.append(_sample(worker.pid, now - ready, posted, len(answers.ids)))
            next_sample = now + opts.sample_s
            s = samples[-1]
            print(
                f"[{opts.tag}] {s['t_s']:7.0f}s answered {s['answered']:6d}/{opts.jobs} "
                f"tree RSS {s['tree']['Rss']:7.0f} MiB  PSS {s['tree']['Pss']:7.0f}  "
                + "  ".join(f"{r} {v['Rss']:.0f}" for r, v in sorted(s["roles"].items())),
                flush=True,
            )
        if probe_marks and len(answers.ids) >= probe_marks[0]:
            probe_marks.pop(0)
            label = f"{len(answers.ids)} jobs"
            region_marks.append(mark_regions(worker.pid, label, len(answers.ids)))
            report["region_growth"] = regions_report(region_marks)
            if probes is not None:
                report["probes"] += fire_probes(worker.pid, probes, label)
    end = time.monotonic()
    samples.append(_sample(worker.pid, end - ready, posted, len(answers.ids)))
    report["final_processes"] = sample_tree(worker.pid)
    region_marks.append(mark_regions(worker.pid, "end", len(answers.ids)))
    report["region_growth"] = regions_report(region_marks)
    if probes is not None:
        report["probes"] += fire_probes(worker.pid, probes, "end")
    report["answered"] = len(answers.ids)
    report["failures"] = answers.failures
    report["duplicates"] = answers.duplicates
    report["wall_s"] = round(end - ready, 1)
    first = first_answer or ready
    report["jobs_per_s"] = round(len(answers.ids) / (end - first), 2) if end > first else None
    report["ok"] = True


def _sample(root: int, t: float, posted: int, answered: int) -> dict[str, Any]:
    procs = sample_tree(root)
    tree = {f: round(sum(p.get(f, 0.0) for p in procs), 1) for f in SMAPS_FIELDS}
    return {
        "t_s": round(t, 1),
        "posted": posted,
        "answered": answered,
        "tree": tree,
        "roles": by_role(procs),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def _stop(worker: subprocess.Popen[bytes]) -> int | None:
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
    try:
        return worker.wait(timeout=180)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        return None


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    samples = report["samples"]
    if not samples:
        return {}
    total = samples[-1]["answered"]
    half = [s for s in samples if s["answered"] >= total / 2]
    roles = sorted({r for s in samples for r in s["roles"]})

    def slope(metric: Any) -> float | None:
        points = []
        for s in half:
            value = metric(s)
            if value is not None:
                points.append((float(s["answered"]), float(value)))
        got = slope_per_1000(points)
        return None if got is None else round(got, 2)

    tree_slope = slope(lambda s: s["tree"]["Rss"])
    peak = max(samples, key=lambda s: s["tree"]["Rss"])
    first = next((s for s in samples if s["answered"] > 0), samples[0])
    return {
        "jobs_answered": total,
        "jobs_per_s": report.get("jobs_per_s"),
        "slope_mib_per_1000_jobs_last_half": {
            "tree_rss": tree_slope,
            "tree_pss": slope(lambda s: s["tree"]["Pss"]),
            "tree_anonymous": slope(lambda s: s["tree"]["Anonymous"]),
            **{f"rss {r}": slope(lambda s, r=r: s["roles"].get(r, {}).get("Rss")) for r in roles},
        },
        "slope_mib_per_1000_jobs_whole_run": {
            "tree_rss": round(
                slope_per_1000([(s["answered"], s["tree"]["Rss"]) for s in samples]) or 0.0, 2
            )
        },
        "goal_mib_per_1000_jobs": GOAL_MIB_PER_1000_JOBS,
        "within_goal": tree_slope is not None and tree_slope <= GOAL_MIB_PER_1000_JOBS,
        "peak_tree_rss_mib": peak["tree"]["Rss"],
        "peak_at_jobs": peak["answered"],
        "first_answer_tree_rss_mib": first["tree"]["Rss"],
        "end_tree_rss_mib": samples[-1]["tree"]["Rss"],
        "by_role_first": first["roles"],
        "by_role_end": samples[-1]["roles"],
        "region_growth_last_half_mib": _regions_last_half(report, total),
    }


def _regions_last_half(report: dict[str, Any], total: int) -> dict[str, dict[str, float]]:
    """Resident MiB gained per process role and kind of mapping, between the marks of the
    second half: where the last half's slope lives."""
    out: dict[str, dict[str, float]] = {}
    for step in report.get("region_growth", []):
        if step["from"] < total / 2:
            continue
        kinds = out.setdefault(step["role"], {})
        for kind, mib in step["by_kind_mib"].items():
            kinds[kind] = round(kinds.get(kind, 0.0) + mib, 1)
    return out


def print_report(report: dict[str, Any]) -> None:
    s = report.get("summary") or {}
    if not s:
        print("no samples")
        return
    slopes = s["slope_mib_per_1000_jobs_last_half"]
    verdict = "met" if s.get("within_goal") else "NOT met"
    print(
        f"\n{s['jobs_answered']} jobs answered, {s['jobs_per_s']} jobs/s; failures "
        f"{report.get('failures')}; RSS slope over the last half: {slopes['tree_rss']} MiB per "
        f"1,000 jobs (goal ≤ {GOAL_MIB_PER_1000_JOBS:g}: {verdict}; "
        f"PSS {slopes['tree_pss']}, anonymous {slopes['tree_anonymous']}); peak tree "
        f"RSS {s['peak_tree_rss_mib']:.0f} MiB at {s['peak_at_jobs']} jobs"
    )
    first, end = s["by_role_first"], s["by_role_end"]
    rows = []
    for role in sorted(set(first) | set(end)):
        a, b = first.get(role, {}), end.get(role, {})
        rows.append([
            role, str(int(b.get("n", 0))),
            f"{a.get('Rss', 0):.0f}", f"{b.get('Rss', 0):.0f}", f"{b.get('Pss', 0):.0f}",
            f"{b.get('Anonymous', 0):.0f}",
            str(slopes.get(f"rss {role}")),
        ])  # fmt: skip
    print_table(
        "per process (MiB): RSS at the first answer → at the end; slope over the last half",
        ["process", "n", "RSS first", "RSS end", "PSS end", "anon end", "MiB/1k jobs"],
        rows,
    )
    for role, kinds in s.get("region_growth_last_half_mib", {}).items():
        print(f"  resident MiB gained over the last half, {role}: {kinds}")
    for p in report.get("probes", []):
        caches = "; ".join(
            f"{c['entries']} × {c['value_type']} = {c['currsize_mib']:.0f}/{c['maxsize_mib']:.0f}"
            for c in p.get("lru_caches", [])
            if c["maxsize_mib"] > 1
        )
        malloc = p.get("malloc") if isinstance(p.get("malloc"), dict) else {}
        print(
            f"  probe @{p['label']} {p['role']} pid {p['pid']}: LRU caches [{caches}] "
            f"torch {p.get('torch_cpu_storages', {}).get('mib', 0):.0f} MiB, malloc in use "
            f"{malloc.get('in_use_mib', 0):.0f} MiB, free in heap "
            f"{malloc.get('free_in_heap_mib', 0):.0f} MiB"
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = Options(
        jobs=args.jobs,
        sets=args.sets,
        env=args.env,
        tag=args.tag,
        distinct_fraction=args.distinct_fraction,
        hot_images=args.hot_images,
        video_every=args.video_every,
        video_pool=args.video_pool,
        max_tokens=args.max_tokens,
        sample_s=args.sample_s,
        window=args.window,
        probe=args.probe or args.tracemalloc,
        tracemalloc=args.tracemalloc,
        probe_every=args.probe_every,
        timeout_s=args.timeout_s,
        out=args.out,
        keep=args.keep,
    )
    out = opts.out or RESULTS / f"soak-{opts.tag}.json"
    try:
        report = run(opts)
    except KeyboardInterrupt:
        return 130
    print_report(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"report: {out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
