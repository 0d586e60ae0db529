"""The end-to-end benchmark on CPU with the tiny random model: the worker's own overhead, exposed.

With a 2-layer, 128-wide model the engine's arithmetic is nearly free, so whatever separates
`mmworker run` from the raw engine here is the worker's own cost: parsing, fetching, hashing,
decode/resize, the feature cache, Kafka, bookkeeping, and vLLM's CPU-side input processing that
runs in the worker's process. This script is `e2e.py` with small CPU defaults, plus (`--profile`,
on by default) one more cold pass sampled by py-spy and folded into a table of where the CPU of
the worker, the engine core, the model runner and the preprocess pool went, because a jobs/s
ratio alone does not say what to fix. The raw stacks (bench/out/profile-profiled-*.txt) load
into speedscope.app or any flame-graph tool.

    .venv/bin/python bench/cpu_overhead.py                      # ~4-5 min on 2 cores
    .venv/bin/python bench/cpu_overhead.py --images 50 --videos 4 --no-profile   # smoke
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import e2e
from bench.common import OUT, print_table

CPU_DEFAULTS = e2e.Options(
    model="tiny",
    images=200,
    videos=10,
    max_tokens=16,
    load_format="auto",
    out=OUT / "cpu_overhead.json",
    naive_images=50,
    naive_videos=5,
    max_model_len=4096,
    profile=True,
    timeout_s=900.0,
)

#: Where a sampled stack's time goes, first match wins. Patterns are matched against the whole
#: stack (any frame), so a PIL resize under the preprocess pool counts as preprocessing and a
#: torch call under vLLM's multimodal processor counts as input processing.
CATEGORIES: list[tuple[str, str, str]] = [
    # (process role, category, regex on the joined stack)
    ("engine core", "scheduler, output handling, IPC", r"."),
    ("model runner", "vision encoder (ViT)", r"visual|vision|vit_attn|mm_input_norm|conv\.py"),
    ("model runner", "language model forward + sampling", r"model_executor|model_runner|sample"),
    ("model runner", "IPC, spin-wait, other", r"."),
    ("pool", "preprocess pool: decode + resize", r"preprocess/(image|video|prepare)"),
    ("pool", "preprocess pool: idle/IPC", r"."),
    ("worker", "vLLM input processing (HF processor, mm hashing)",
     r"vllm/(multimodal|inputs|renderers)|vllm/v1/engine/(input_processor|processor)|"
     r"transformers/"),
    ("worker", "vLLM output processing + detokenize",
     r"vllm/v1/engine/(output_processor|detokenizer)|vllm/tokenizers"),
    ("worker", "vLLM client IPC (serialise to engine core)",
     r"vllm/v1/engine/core_client|vllm/v1/serial_utils|zmq|msgspec"),
    ("worker", "vLLM AsyncLLM other", r"vllm/"),
    ("worker", "Kafka client (consume, produce, commit)", r"kafka/"),
    ("worker", "feature cache (zstd, checksum, files)", r"mmworker/cache\.py"),
    ("worker", "job parse + result build (pydantic, json)",
     r"schemas/|pydantic|mmworker/records\.py|json/"),
    ("worker", "media stage (fetch, hash, sniff)", r"mmworker/media\.py|preprocess/"),
    ("worker", "process-pool plumbing (pickling prepared media)",
     r"concurrent/futures/process\.py|multiprocessing/"),
    ("worker", "asyncio + worker loop", r"asyncio/|mmworker/(worker|jobs|engine)\.py"),
    ("worker", "other", r"."),
    ("child", "other child process", r"."),
]  # fmt: skip


#: Leaf frames that are blocking waits py-spy still reports as active (a thread parked in
#: queue.get, select or a condition); they are counted apart and left out of the shares.
IDLE_LEAF = re.compile(
    r"^(_worker \(concurrent/futures/thread\.py|\S*select \(selectors\.py|Condition\.wait |"
    r"Poller\.poll \(zmq|Connection\._recv |Event\.wait |Thread\._wait_for_tstate_lock |"
    r"_recv_msg |.*\.recv(_multipart)? \(zmq)"
)
#: vLLM's shared-memory message queue spins on sched_yield while waiting for the other side.
SPIN_LEAF = re.compile(r"^sched_yield ")


def role_of(frames: list[str]) -> str:
    """Which process a sample came from: the engine core, a preprocess pool process, the worker.

    With `--subprocesses` py-spy roots each stack at "process PID:cmdline" frames, the worker's
    first and a child's after it; the children are told apart by what they run.
    """
    stack = ";".join(frames)
    children = sum(1 for f in frames if f.startswith("process ")) > 1
    if "vllm/v1/engine/core.py" in stack:
        return "engine core"
    if children and re.search(r"vllm/v1/(worker|executor)/", stack):
        return "model runner"
    if children and "concurrent/futures/process.py" in stack:
        return "pool"
    return "child" if children else "worker"


_LINE = re.compile(r"^(.*) (\d+)$")


def fold_profile(path: Path) -> dict[str, Any]:
    """py-spy raw (collapsed) stacks → sample counts by process role and category."""
    by_cat: Counter[tuple[str, str]] = Counter()
    by_role: Counter[str] = Counter()
    leaf: dict[str, Counter[str]] = defaultdict(Counter)
    idle: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        frames, count = m.group(1).split(";"), int(m.group(2))
        stack = ";".join(frames)
        role = role_of(frames)
        if IDLE_LEAF.match(frames[-1]):
            idle[role] += count
            continue
        if SPIN_LEAF.match(frames[-1]):
            by_cat[(role, "vLLM shm queue spin-wait (sched_yield)")] += count
            by_role[role] += count
            total += count
            continue
        for r, cat, pattern in CATEGORIES:
            if r == role and re.search(pattern, stack):
                by_cat[(role, cat)] += count
                break
        by_role[role] += count
        leaf[role][frames[-1]] += count
        total += count
    return {
        "samples": total,
        "by_role": dict(by_role),
        "idle_samples_left_out": dict(idle),
        "by_category": [
            {"role": r, "category": c, "samples": n, "share": round(n / total, 4) if total else 0}
            for (r, c), n in by_cat.most_common()
        ],
        "top_leaf_frames": {r: c.most_common(12) for r, c in leaf.items()},
    }


def flamegraph(raw: Path) -> Path | None:
    """An SVG next to the raw stacks, if `flamegraph.pl`/`inferno` exists; else None."""
    for tool in ("inferno-flamegraph", "flamegraph.pl"):
        exe = shutil.which(tool)
        if exe:
            import subprocess

            svg = raw.with_suffix(".svg")
            with svg.open("wb") as out:
                subprocess.run([exe, str(raw)], stdout=out, check=False)
            return svg
    return None


def main(argv: list[str] | None = None) -> int:
    args = e2e.build_parser(CPU_DEFAULTS).parse_args(argv)
    opts = e2e.options_from(args)
    if opts.profile and not (Path(sys.executable).parent / "py-spy").exists():
        print("py-spy not installed (.venv/bin/pip install py-spy): running without a profile")
        opts.profile = False
    started = time.time()
    report = e2e.run(opts)
    e2e.print_report(report)
    if opts.profile:
        report["profile"] = {}
        for kind in ("image", "video"):
            raw = e2e.profile_path("profiled", kind)
            if raw.exists() and raw.stat().st_mtime >= started:
                folded = fold_profile(raw)
                svg = flamegraph(raw)
                report["profile"][kind] = {"raw": str(raw), "svg": str(svg or ""), **folded}
                print_profile(f"profiled cold pass, {kind} jobs", folded)
        opts.out.write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["ok"] else 1


def print_profile(title: str, folded: dict[str, Any]) -> None:
    total = folded["samples"] or 1
    rows = [
        [d["role"], d["category"], str(d["samples"]), f"{100 * d['samples'] / total:.1f}%"]
        for d in folded["by_category"]
    ]
    print_table(
        f"where CPU went: {title} ({folded['samples']} py-spy samples of non-idle threads,"
        " worker + engine core + preprocess pool)",
        ["process", "category", "samples", "share"],
        rows,
    )
    for role, frames in folded["top_leaf_frames"].items():
        print(f"  top leaf frames in {role}: " + "; ".join(f"{f} ×{n}" for f, n in frames[:6]))


if __name__ == "__main__":
    raise SystemExit(main())
