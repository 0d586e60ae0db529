"""The whole GPU comparison in one command: peers, the worker cold twice and warm, peers again.

    python bench/compare.py [--name NAME] [--out-dir DIR] [--config MODEL/config.json] \
        [--resume] [bench/e2e.py flags: --model, --set K=V, --processes N, --images ...]

Why one command: issue 33 asks for a comparison a user can rerun on their own box, and sessions
16 and 20 glued five `bench/e2e.py` runs together by hand and built the table with the spread by
hand. The order is peers → worker cold 1 → worker cold 2 → worker warm → peers again: peers
before and after the worker show how far the host drifted while the worker ran (session 16), and
the warm pass reuses the feature cache cold 2 left in the same `--work-dir`, as e2e's
`--passes cold,warm` does. Every stage is its own `bench/e2e.py` process with the same flags
(they pass through as they are, so the engines see the same settings on both sides); the worker
stages add `--skip-raw --skip-naive --peers-from PEERS1`, so nothing e2e measures is done here
twice. What this file adds is the merge: per kind, every peer row of both runs, the best peer =
the faster of the two runs' best rows (`bench/e2e_report.best_peers` per run), each worker row
against it, the spread of the two peer runs and of the two cold runs, MFU (`bench/mfu.py`, with
`--config`), the start-up seconds of every run. Each stage's JSON stays beside the combined one,
which is rewritten after every stage, so a run cut off by a time limit keeps what finished;
`--resume` reuses the stages whose JSON is already there and ok (a device's 10-minute calls).

A stage that fails is recorded with its error and the rest still runs; the report lists the
rows that are missing and the exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import OUT, ROOT, fmt, print_table
from bench.e2e_report import best_peers, table_rows
from bench.mfu import H200_BF16_DENSE_TFLOPS, annotate

KINDS = ("image", "video")
#: (stage, what it runs): e2e pass name for worker stages, "peers" for a peers run.
STAGES: tuple[tuple[str, str], ...] = (
    ("peers1", "peers"),
    ("cold1", "cold"),
    ("cold2", "cold"),
    ("warm", "warm"),
    ("peers2", "peers"),
)
WORKER_LABELS = {"cold1": "worker cold 1", "cold2": "worker cold 2", "warm": "worker warm"}
RATE_DEFINITION = (
    "jobs/s = jobs / (last result read - first job started), as bench/e2e.py reports it: the"
    " worker's from its first job's start (jobs are posted before it starts, so start-up and the"
    " group join are not counted); 'from consuming' = the worker's jobs_per_s_from_ready: images"
    " from its 'consuming' log line, videos from the moment they were posted"
)
E2E = ROOT / "bench" / "e2e.py"


# ---------------------------------------------------------------------------------------------
# Merging (pure: stage reports in, the combined report out)


def spread(values: list[float]) -> dict[str, Any] | None:
    """min, max and (max - min) / min in %: how far repeated runs of one thing differ."""
    if not values:
        return None
    lo, hi = min(values), max(values)
    pct = round(100 * (hi - lo) / lo, 2) if lo > 0 else None
    return {"n": len(values), "min": lo, "max": hi, "spread_pct": pct}


def peer_rows(report: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The peer rows of a peers run (e2e's table rows minus any worker pass)."""
    if not report:
        return []
    rows = report.get("rows") or table_rows(report)
    return [dict(r) for r in rows if not str(r["peer"]).startswith("worker")]


def worker_row(report: dict[str, Any] | None, pass_name: str, kind: str) -> dict[str, Any] | None:
    """The worker pass's own row (not the peer rows `--peers-from` copied into its report)."""
    doc = ((report or {}).get("worker") or {}).get(pass_name) or {}
    return dict(doc[kind]) if kind in doc else None


def startup(stage: str, report: dict[str, Any] | None) -> dict[str, Any]:
    """Start-up seconds as e2e reports them: the plain engine's `LLM(...)`, the N engines' all
    ready (and each), the worker's process start → its 'consuming' line."""
    if not report:
        return {}
    if stage.startswith("peers"):
        peers = report.get("peers") or {}
        many = peers.get("raw_engines") or {}
        out: dict[str, Any] = {"raw_engine_s": peers.get("startup_s")}
        if many.get("per_engine"):
            out["raw_engines_all_ready_s"] = many.get("all_ready_s")
            out["raw_engines_each_s"] = [e.get("startup_s") for e in many["per_engine"]]
        return out
    doc = (report.get("worker") or {}).get(pass_of(stage)) or {}
    return {"worker_ready_s": doc.get("startup_s"), "processes": doc.get("processes")}


def pass_of(stage: str) -> str:
    return dict(STAGES)[stage]


def with_mfu(
    row: dict[str, Any], options: dict[str, Any], config: dict[str, Any] | None, peak: float
) -> dict[str, Any]:
    if config is None:
        return row
    annotated = annotate({"rows": [row], "options": options}, config, peak)[0]
    return {**row, "flops_per_job": annotated["flops_per_job"], "mfu": annotated["mfu"]}


def combine(
    stages: dict[str, dict[str, Any]],
    kinds: tuple[str, ...] = KINDS,
    config: dict[str, Any] | None = None,
    peak_tflops: float = H200_BF16_DENSE_TFLOPS,
) -> dict[str, Any]:
    """The combined report of whatever stages have run so far.

    `stages` maps a stage name to its record: at least `report` (the stage's e2e JSON, or None
    when it wrote none) and `ok`. Ratios are recomputed against the faster of the two peer runs,
    not taken from the worker JSONs, which divide by peers run 1 only.
    """
    out: dict[str, Any] = {"rate": RATE_DEFINITION, "kinds": {}, "missing": []}
    for kind in kinds:
        rows: list[dict[str, Any]] = []
        bests: list[dict[str, Any]] = []
        for stage in ("peers1", "peers2"):
            report = (stages.get(stage) or {}).get("report")
            options = (report or {}).get("options") or {}
            for row in peer_rows(report):
                if row["kind"] == kind:
                    rows.append({**with_mfu(row, options, config, peak_tflops), "run": stage})
            best = best_peers(report or {}).get(kind)
            if best:
                bests.append({"run": stage, "peer": best["peer"], "jobs_per_s": best["jobs_per_s"]})
            else:
                out["missing"].append(f"{kind} {stage} best peer")
        base = max(bests, key=lambda b: float(b["jobs_per_s"])) if bests else None
        workers: list[dict[str, Any]] = []
        for stage, label in WORKER_LABELS.items():
            report = (stages.get(stage) or {}).get("report")
            found = worker_row(report, pass_of(stage), kind)
            if found is None:
                out["missing"].append(f"{kind} {label}")
                continue
            found = with_mfu(found, (report or {}).get("options") or {}, config, peak_tflops)
            workers.append({**found, "run": stage, "label": label})
        for row in rows + workers:
            row["ratio_vs_best"] = (
                round(float(row["jobs_per_s"]) / float(base["jobs_per_s"]), 3)
                if base and base["jobs_per_s"]
                else None
            )
        same_peer: dict[str, list[float]] = {}
        for row in rows:
            same_peer.setdefault(row["peer"], []).append(float(row["jobs_per_s"]))
        cold = [float(w["jobs_per_s"]) for w in workers if w["run"].startswith("cold")]
        out["kinds"][kind] = {
            "peer_rows": rows,
            "best_peer_per_run": bests,
            "best_peer": base,
            "worker_rows": workers,
            "spread": {
                "peers_best": spread([float(b["jobs_per_s"]) for b in bests]),
                "peers_by_row": {peer: spread(v) for peer, v in same_peer.items()},
                "worker_cold": spread(cold),
            },
        }
    out["startup_s"] = {s: startup(s, (stages.get(s) or {}).get("report")) for s in stages}
    out["errors"] = [
        f"{s}: {e}"
        for s, rec in stages.items()
        for e in ([rec["error"]] if rec.get("error") else [])
        + list((rec.get("report") or {}).get("errors") or [])
    ]
    out["ok"] = (
        all(rec.get("ok") for rec in stages.values())
        and len(stages) == len(STAGES)
        and not out["missing"]
    )
    return out


# ---------------------------------------------------------------------------------------------
# The table


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def spread_text(s: dict[str, Any] | None) -> str:
    if not s:
        return "-"
    return f"min {fmt(s['min'])} max {fmt(s['max'])} ({fmt(s['spread_pct'], '.1f')}%, n={s['n']})"


def print_combined(combined: dict[str, Any], title: str) -> None:
    headers = ["kind", "run", "row", "jobs", "jobs/s", "×best peer", "from consuming", "MFU"]
    table: list[list[str]] = []
    for kind, k in combined["kinds"].items():
        for r in k["peer_rows"] + k["worker_rows"]:
            table.append(
                [
                    kind,
                    r["run"],
                    r.get("label", r["peer"]),
                    str(r["jobs"]),
                    fmt(r["jobs_per_s"]),
                    fmt(r.get("ratio_vs_best"), ".3f"),
                    fmt(r.get("jobs_per_s_from_ready")),
                    ("cached" if r.get("flops_per_job") else "-")
                    if r.get("mfu") is None
                    else pct(r["mfu"]),
                ]
            )
    print_table(title, headers, table)
    for kind, k in combined["kinds"].items():
        b = k["best_peer"]
        where = f"{b['peer']} of {b['run']}, {fmt(b['jobs_per_s'])} jobs/s" if b else "none"
        print(f"  {kind}: best peer {where}")
        sp = k["spread"]
        print(f"  {kind}: spread of the peer runs' best rows {spread_text(sp['peers_best'])}")
        print(f"  {kind}: spread of the cold worker runs {spread_text(sp['worker_cold'])}")
    for stage, s in combined["startup_s"].items():
        print(f"  start-up {stage}: {s or 'none'}")
    print(f"  rate: {combined['rate']}")
    for m in combined["missing"]:
        print(f"  MISSING {m}")
    for e in combined["errors"]:
        print(f"  ERROR {e}")


# ---------------------------------------------------------------------------------------------
# Running the stages


def stage_argv(
    stage: str, passthrough: list[str], out: Path, work_dir: Path, peers_from: Path | None
) -> list[str]:
    """The e2e flags of one stage: the user's, then the stage's own (argparse keeps the last)."""
    what = pass_of(stage)
    own = ["--work-dir", str(work_dir), "--out", str(out)]
    if what == "peers":
        return [*passthrough, "--passes", "", *own]
    own += ["--skip-raw", "--skip-naive", "--passes", what]
    return [*passthrough, *own, *(["--peers-from", str(peers_from)] if peers_from else [])]


def finished(report: dict[str, Any] | None) -> bool:
    """bench/e2e.py writes its report after every stage; one cut off mid-way says `partial`."""
    return bool(report and report.get("ok") and not report.get("partial"))


def load(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def run_stage(stage: str, argv: list[str], out: Path) -> dict[str, Any]:
    out.unlink(missing_ok=True)  # an older run's JSON must not stand in for this one's
    print(f"\n=== compare: {stage}: bench/e2e.py {' '.join(argv)}", flush=True)
    t0 = time.monotonic()
    try:
        done = subprocess.run([sys.executable, str(E2E), *argv], check=False, cwd=ROOT)
        rc: int | None = done.returncode
        error = None if rc == 0 else f"bench/e2e.py exited {rc}"
    except OSError as exc:
        rc, error = None, f"could not start bench/e2e.py: {exc}"
    report = load(out)
    if report is None and error is None:
        error = f"no report at {out}"
    return {
        "argv": argv,
        "json": str(out),
        "rc": rc,
        "wall_s": round(time.monotonic() - t0, 1),
        "report": report,
        "ok": error is None and finished(report),
        "error": error,
    }


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: e2e's `--out` must not be taken for this parser's `--out-dir`.
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--name", default="compare", help="prefix of every file this run writes")
    p.add_argument("--out-dir", type=Path, default=OUT, help="where the JSON files go")
    p.add_argument("--config", type=Path, help="model config.json: adds MFU per row")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    p.add_argument(
        "--resume", action="store_true", help="reuse the stages whose JSON is there and ok"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    from bench.e2e import build_parser as e2e_parser

    args, passthrough = build_parser().parse_known_args(argv)
    e2e_args = e2e_parser().parse_args(passthrough)  # e2e's own check of the flags
    defaults = e2e_parser().parse_args([])
    for flag, dest in (("--passes", "passes"), ("--out", "out"), ("--peers-from", "peers_from")):
        if getattr(e2e_args, dest) != getattr(defaults, dest):
            raise SystemExit(f"compare.py sets {flag} for each stage itself; leave it out")
    kinds = tuple(k for k, n in (("image", e2e_args.images), ("video", e2e_args.videos)) if n)
    config = json.loads(args.config.read_text()) if args.config else None
    args.out_dir.mkdir(parents=True, exist_ok=True)
    own_work = e2e_args.work_dir is None
    work_dir = e2e_args.work_dir or args.out_dir / f"{args.name}-work"
    combined_path = args.out_dir / f"{args.name}.json"
    stages: dict[str, dict[str, Any]] = {}
    combined: dict[str, Any] = {}
    # A resumed stage's wall is the one its own run took, which only the earlier combined report
    # holds (session 33's resumed GPU run otherwise reported 0 s for the four stages it reused).
    earlier_walls = {
        stage: rec.get("wall_s", 0.0)
        for stage, rec in ((load(combined_path) if args.resume else None) or {})
        .get("stages", {})
        .items()
    }
    for stage, _ in STAGES:
        out = args.out_dir / f"{args.name}-{stage}.json"
        peers1 = args.out_dir / f"{args.name}-peers1.json"
        peers_from = peers1 if (stages.get("peers1") or {}).get("report") else None
        stage_args = stage_argv(stage, passthrough, out, work_dir, peers_from)
        earlier = load(out) if args.resume else None
        if finished(earlier):
            print(f"=== compare: {stage}: reusing {out}", flush=True)
            wall = earlier_walls.get(stage, 0.0)
            rec = {"argv": stage_args, "json": str(out), "rc": 0, "wall_s": wall}
            stages[stage] = {**rec, "report": earlier, "ok": True, "error": None, "reused": True}
        else:
            stages[stage] = run_stage(stage, stage_args, out)
        combined = {
            "name": args.name,
            "passthrough": passthrough,
            "work_dir": str(work_dir),
            "config": str(args.config) if args.config else None,
            "peak_tflops": args.peak_tflops if config else None,
            **combine(stages, kinds, config, args.peak_tflops),
            "stages": {s: {k: v for k, v in r.items() if k != "report"} for s, r in stages.items()},
        }
        combined_path.write_text(json.dumps(combined, indent=2, default=str))
    if own_work:  # the feature cache is big; the logs stay for a look
        for child in work_dir.glob("features*"):
            shutil.rmtree(child, ignore_errors=True)
    print_combined(combined, f"compare {args.name}: {' '.join(passthrough) or 'e2e defaults'}")
    print(f"\nwritten {combined_path} (each stage: {args.out_dir}/{args.name}-STAGE.json)")
    return 0 if combined["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
