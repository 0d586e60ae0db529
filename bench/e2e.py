"""End-to-end throughput of `mmworker run` vs raw vLLM engines and a naive one-at-a-time consumer.

Why these peers: the raw engine (`LLM.generate` on inputs already decoded outside the timed
region, no Kafka) is the ceiling one engine reaches; "raw ×N engines" (`bench/peers/raw_engines.py`:
N plain `LLM` engines on the same GPU, each with 1/N of the memory and of the prompts) is what a
user gets by simply starting more engines, which beats one engine when vLLM's one-thread front
end, not the GPU, is the bound; a worker running N processes must be measured against the faster
of the two ("×best peer"). The naive consumer (poll one → preprocess → generate → produce →
commit) is what a first implementation would do, so the worker must beat it by a wide margin to
justify its concurrency. All use the same engine arguments (`Engine.engine_kwargs()` of the same
config, memory split N ways for N engines), the same chat template and the same decoded inputs.

Flow: media are made (cached under bench/out/media), jobs are pre-produced to an embedded broker,
then a peers subprocess runs raw and naive, then another runs raw ×N engines (subprocesses so the
GPU is free again before the next engines start), then one worker process per pass: "cold" (empty
feature cache) and "warm" (same media, new job ids, new process, same cache directory). Inside a
pass images go first (all pre-produced before the worker starts), then the videos are posted at
once.

    .venv/bin/python bench/e2e.py --model tiny --images 200 --videos 10 --max-tokens 16
    python bench/e2e.py --model /models/qwen3b-dummy --load-format dummy --images 1000 \
        --videos 100 --processes 2   # raw ×2 engines joins the peers (--raw-engines N; 0: none)

Definitions (also in bench/README.md): jobs/s = jobs / (last result read − first job started in
the worker, i.e. after its first poll, so the consumer-group join is not counted; the number from
"worker ready" is reported as `jobs_per_s_from_ready`). Raw: jobs / wall of `LLM.generate`, the
median of `--raw-repeats` runs, each under fresh multi_modal_uuids (vLLM caches cold). Naive:
jobs / (last commit − first poll that returned a job). Latency: the worker's own `timings.total_s`
(job start → result built), raw: `generate` start → request finished, naive: poll → commit.
Raw ×N engines: jobs / (last engine's finish − earliest engine's start; all are told to go at
once, one kind at a time). Engine busy: Δ`mmworker_engine_busy_seconds` over the window (worker),
Σ generate / wall (naive), 1 by definition (raw).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import OUT, add_set_option, environment, make_images, make_videos
from bench.e2e_config import Options, resolve_model_path
from bench.e2e_report import print_report, table_rows
from bench.peers import one_engine, raw_engines
from bench.peers.worker import profile_path, worker_args, worker_pass

# The driver only: the peers live in bench/peers/ (worker.py; one_engine.py, raw and naive on one
# LLM; raw_engines.py), the table and its ratios in e2e_report.py, the settings in e2e_config.py.
#: What other scripts take from here (`bench/cpu_overhead.py`): the driver's entry points.
__all__ = ["Options", "build_parser", "main", "options_from", "print_report", "profile_path", "run"]


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser(defaults: Options | None = None) -> argparse.ArgumentParser:
    d = defaults or Options()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=d.model, help="'tiny' or a model dir / HF id")
    p.add_argument("--images", type=int, default=d.images, help="image jobs per pass")
    p.add_argument("--videos", type=int, default=d.videos, help="video jobs per pass")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--load-format", default=d.load_format, help="auto | dummy (random weights)")
    p.add_argument("--out", type=Path, default=d.out, help="JSON report")
    p.add_argument("--passes", default=",".join(d.passes), help="comma list of cold,warm")
    p.add_argument("--skip-naive", action="store_true", default=d.skip_naive)
    p.add_argument(
        "--skip-raw",
        action="store_true",
        default=d.skip_raw,
        help="run no raw peer (one engine, hot, ×N engines); --peers-from rows still show",
    )
    p.add_argument(
        "--only-raw-engines",
        action="store_true",
        default=d.only_raw_engines,
        help="of the peers, run only raw ×N engines (e.g. again under other process settings)",
    )
    p.add_argument(
        "--raw-repeats", type=int, default=d.raw_repeats, help="raw runs; the median is the bar"
    )
    p.add_argument(
        "--naive-images",
        type=int,
        default=d.naive_images,
        help="image jobs the naive loop runs (it is slow; steady state is enough)",
    )
    p.add_argument("--naive-videos", type=int, default=d.naive_videos)
    p.add_argument("--image-size", type=int, default=d.image_size, help="JPEG side (448: 256 tok)")
    p.add_argument("--video-seconds", type=float, default=d.video_seconds)
    p.add_argument("--video-fps", type=int, default=d.video_fps, help="source frame rate")
    p.add_argument("--video-size", type=int, default=d.video_size)
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        default=d.ignore_eos,
        help="let requests stop at EOS (token counts differ)",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=d.processes,
        help="worker processes (own engine each); default: the worker's own choice for this host",
    )
    p.add_argument(
        "--raw-engines",
        type=int,
        default=d.raw_engines,
        help="N plain LLM engines on the one GPU as one more peer (default: --processes when > 1;"
        " 0: none)",
    )
    p.add_argument("--preprocess-workers", type=int, default=d.preprocess_workers)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    add_set_option(p, "extra worker setting (also used for the raw engine)", d.sets)
    p.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=d.profile,
        help="add a cold pass under `py-spy record` (raw stacks in bench/out/profile-*.txt)",
    )
    p.add_argument(
        "--profile-measured",
        action="store_true",
        default=d.profile_measured,
        help="sample the measured passes with `py-spy record --nonblocking` (never pauses the"
        " worker, so the figures stay comparable; stacks in bench/out/profile-PASS-*.txt)",
    )
    p.add_argument("--keep", action="store_true", default=d.keep, help="keep the work directory")
    p.add_argument(
        "--work-dir",
        type=Path,
        default=d.work_dir,
        help="reuse this directory and its feature cache (kept); a cold pass empties the cache",
    )
    p.add_argument(
        "--peers-from",
        type=Path,
        default=d.peers_from,
        help="reuse raw/naive/raw ×N (and earlier passes) from this JSON report: split runs'"
        " table; raw ×N still runs when the report has none for this N (unless --skip-raw)",
    )
    p.add_argument(
        "--serve-from",
        type=Path,
        default=d.serve_from,
        help="a bench/peers/serve.py report: its rows join the peers and the best-peer base",
    )
    p.add_argument("--timeout-s", type=float, default=d.timeout_s)
    p.add_argument("--peers-spec", type=Path, help=argparse.SUPPRESS)  # internal: child mode
    return p


def options_from(args: argparse.Namespace) -> Options:
    values = {f.name: getattr(args, f.name) for f in fields(Options)}
    values["passes"] = tuple(p for p in args.passes.split(",") if p)
    return Options(**values)


def main(argv: list[str] | None = None, defaults: Options | None = None) -> int:
    args = build_parser(defaults).parse_args(argv)
    if args.peers_spec is not None:
        return one_engine.peers_main(args.peers_spec)
    report = run(options_from(args))
    print_report(report)
    return 0 if report["ok"] else 1


# ---------------------------------------------------------------------------------------------
# Orchestration


def save(report: dict[str, Any], out: Path, partial: bool = True) -> None:
    """Written after every stage, not only at the end: a device call cut off by its time limit
    still returns the peers and passes it finished (session 28 lost a whole 600 s call's rows to
    one late warm pass). `partial` stays in the file until the last write."""
    report["rows"] = table_rows(report)
    report["partial"] = partial
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))


def run(opts: Options) -> dict[str, Any]:
    from mmworker.devkit.broker import EmbeddedBroker, free_port

    OUT.mkdir(parents=True, exist_ok=True)
    env_facts = environment()
    model_path = resolve_model_path(opts.model)
    t0 = time.perf_counter()
    images = make_images(opts.images, opts.image_size)
    videos = make_videos(opts.videos, opts.video_seconds, opts.video_fps, opts.video_size)
    print(
        f"media ready in {time.perf_counter() - t0:.1f}s: {len(images)} images "
        f"{opts.image_size}², {len(videos)} videos {opts.video_seconds:g}s@{opts.video_fps}fps "
        f"{opts.video_size}²",
        flush=True,
    )
    if opts.work_dir is not None:
        work = opts.work_dir.resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="e2e-", dir=OUT))
    allowed = sorted({p.parent.resolve() for p in videos} | {work.resolve()})
    report: dict[str, Any] = {
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
        "model_path": model_path,
        "environment": env_facts,
        "work_dir": str(work),
        "peers": {},
        "worker": {},
        "profiled": {},
        "ok": True,
        "errors": [],
    }
    with EmbeddedBroker() as broker:
        bootstrap = broker.bootstrap
        # The raw engine is configured from these arguments, parsed as the worker parses them.
        probe = {"input": "unused", "output": "unused", "dlq": "unused"}
        base_args = worker_args(opts, bootstrap, work, probe, "probe", model_path, 0, allowed)
        report["worker_args"] = base_args
        if opts.peers_from is not None:
            earlier = json.loads(opts.peers_from.read_text())
            report["peers"] = {**earlier.get("peers", {}), "from": str(opts.peers_from)}
            report["worker"].update(earlier.get("worker", {}))
        if opts.serve_from is not None:
            served = json.loads(opts.serve_from.read_text())
            report["peers"]["serve"] = {k: served[k] for k in ("image", "video") if k in served}
            report["peers"]["serve"]["from"] = str(opts.serve_from)
        elif not (opts.skip_raw and opts.skip_naive) and not opts.only_raw_engines:
            try:
                report["peers"] = one_engine.run_peers(
                    opts, bootstrap, work, base_args, model_path, images, videos
                )
            except Exception as exc:  # noqa: BLE001 - keep the worker passes; report the error
                report["ok"] = False
                report["errors"].append(f"peers: {exc}")
                print(f"peers failed: {exc}", file=sys.stderr, flush=True)
            save(report, opts.out)
        engines = raw_engines.count_for(opts)
        earlier = (report["peers"].get("raw_engines") or {}).get("engines")
        if engines and not opts.skip_raw and earlier != engines:
            try:
                report["peers"]["raw_engines"] = raw_engines.run_child(
                    opts, work, base_args, model_path, images, videos, engines
                )
            except Exception as exc:  # noqa: BLE001 - keep the other rows; report the error
                report["ok"] = False
                report["errors"].append(f"{raw_engines.label(engines)}: {exc}")
                print(f"{raw_engines.label(engines)} failed: {exc}", file=sys.stderr, flush=True)
            save(report, opts.out)
        passes = [(name, False) for name in opts.passes]
        passes += [("profiled", True)] if opts.profile else []
        for name, profiling in passes:
            try:
                doc = worker_pass(
                    opts,
                    name,
                    bootstrap,
                    work,
                    model_path,
                    images,
                    videos,
                    allowed,
                    free_port(),
                    profiling,
                )
            except Exception as exc:  # noqa: BLE001 - keep what was measured; report the error
                report["ok"] = False
                report["errors"].append(f"worker {name}: {exc}")
                print(f"worker pass {name} failed: {exc}", file=sys.stderr, flush=True)
                continue
            report["profiled" if profiling else "worker"][name] = doc
            save(report, opts.out)
    save(report, opts.out, partial=False)
    if not opts.keep and opts.work_dir is None:  # logs stay for a look; caches are big
        for child in work.glob("features*"):
            shutil.rmtree(child, ignore_errors=True)
    return report


if __name__ == "__main__":
    raise SystemExit(main())
