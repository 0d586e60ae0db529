"""The end-to-end report: its table, the ratios the issue asks for, and the base they divide by.

Apart from the runs so a report can be re-tabled (`--peers-from`, `--serve-from`) with exactly
the same rules, whichever invocation measured its rows.
"""

from __future__ import annotations

from typing import Any

from bench.common import fmt, print_table
from bench.peers import raw_engines


def best_peers(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per kind, the row every other row is divided by: the fastest of "raw" (one engine, median
    run), "raw ×N engines" (N plain engines on the same GPU) and, when given, `vllm serve` with N
    API servers (`--serve-from`). The worker is a way to run N
    engines, so it must beat what a user gets by simply starting N; "raw hot" is never the base:
    its caches are hot, which no new process is.
    """
    out: dict[str, dict[str, Any]] = {}
    for kind in ("image", "video"):
        if candidates := cold_raw_rows(report, kind):
            out[kind] = max(candidates, key=lambda r: float(r["jobs_per_s"]))
    return out


def cold_raw_rows(report: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    peers = report.get("peers") or {}
    rows = (
        ((peers.get("raw") or {}).get(kind) or {}).get("raw"),
        (peers.get("raw_engines") or {}).get(kind),
        (peers.get("serve") or {}).get(kind),
    )
    return [row for row in rows if row and row.get("jobs_per_s")]


def table_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Flatten peers and passes into rows with the ratios the issue asks for.

    Both worker passes are compared with the best cold raw peer (`best_peers`): raw never decodes
    (its inputs are prepared outside the timing) and every raw run sees each item for the first
    time, which is what a new worker process's engine sees in either pass; the warm pass differs
    only in the worker's own feature cache. `ratio_vs_raw` (one engine) stays in the JSON for
    older tables. Naive is one row for both passes: it has no cache, so its warm pass would equal
    its cold pass.
    """
    rows: list[dict[str, Any]] = []
    peers = report.get("peers") or {}
    best = best_peers(report)
    for kind in ("image", "video"):
        single = (peers.get("raw") or {}).get(kind, {})
        naive = (peers.get("naive") or {}).get(kind)
        many = (peers.get("raw_engines") or {}).get(kind)
        for label in ("raw", "raw hot"):
            if label in single:
                rows.append(dict(single[label]))
        if many:
            rows.append({k: v for k, v in many.items() if k != "per_engine"})
        if served := (peers.get("serve") or {}).get(kind):
            rows.append(dict(served))
        if naive:
            rows.append(dict(naive))
        for doc in (report.get("worker") or {}).values():
            if kind in doc:
                rows.append(dict(doc[kind]))
        for row in rows:
            if row["kind"] != kind:
                continue
            row["ratio_vs_best"] = _ratio(row, best.get(kind))
            row["best_peer"] = (best.get(kind) or {}).get("peer")
            row["ratio_vs_raw"] = _ratio(row, single.get("raw"))
            row["ratio_vs_naive"] = _ratio(row, naive)
    return rows


def _ratio(row: dict[str, Any], base: dict[str, Any] | None) -> float | None:
    if not base or not base.get("jobs_per_s"):
        return None
    return round(float(row["jobs_per_s"]) / float(base["jobs_per_s"]), 3)


def print_report(report: dict[str, Any]) -> None:
    headers = [
        "kind",
        "peer",
        "jobs",
        "jobs/s",
        "out tok/s",
        "p50 s",
        "p95 s",
        "busy",
        "×best peer",
        "×naive",
    ]
    rows = [
        [
            r["kind"],
            r["peer"],
            str(r["jobs"]),
            fmt(r["jobs_per_s"]),
            fmt(r["output_tokens_per_s"], ".0f"),
            fmt(r["latency_p50_s"], ".3f"),
            fmt(r["latency_p95_s"], ".3f"),
            fmt(r["engine_busy_fraction"]),
            fmt(r.get("ratio_vs_best")),
            fmt(r.get("ratio_vs_naive")),
        ]
        for r in report["rows"]
    ]
    o = report["options"]
    print_table(
        f"end to end: model={o['model']} load_format={o['load_format']} "
        f"max_tokens={o['max_tokens']} ignore_eos={o['ignore_eos']}",
        headers,
        rows,
    )
    for name, doc in (report.get("worker") or {}).items():
        for kind in ("image", "video"):
            if kind in doc:
                d = doc[kind]
                ms = {k: fmt(v and v * 1000, ".1f") for k, v in d["mean_s"].items()}
                print(
                    f"  worker {name} {kind}: mean ms {ms}; from-ready {d['jobs_per_s_from_ready']}"
                    f" jobs/s; cache hits {fmt(d['cache_hit_fraction'])}; out tokens "
                    f"{d['output_tokens_min_max']}; failures {d['failures']}"
                )
        if "startup_s" in doc:
            print(f"  worker {name}: ready after {doc['startup_s']}s, exit {doc.get('exit_code')}")
    peers = report.get("peers") or {}
    for kind, base in best_peers(report).items():
        others = [
            f"{row['peer']} {fmt(row['jobs_per_s'])}"
            for row in cold_raw_rows(report, kind)
            if row["peer"] != base["peer"]
        ]
        print(
            f"  ×best peer, {kind}: {base['peer']} ({fmt(base['jobs_per_s'])} jobs/s)"
            + (f"; also {', '.join(others)}" if others else "")
        )
    many = peers.get("raw_engines") or {}
    if many.get("per_engine"):
        sched = [e["scheduler"] for e in many["per_engine"]]
        print(
            f"  {raw_engines.label(many['engines'])}: loaded {many.get('start', 'together')}, "
            f"all after {many.get('all_ready_s')}s "
            f"(start-up {[e['startup_s'] for e in many['per_engine']]}s, KV blocks "
            f"{[s.get('num_gpu_blocks') for s in sched]}, batch limits "
            f"{ {k: v for k, v in sched[0].items() if k != 'num_gpu_blocks'} }); jobs/s per engine "
            + "; ".join(
                f"{kind} {[e['jobs_per_s'] for e in many[kind]['per_engine']]}"
                for kind in ("image", "video")
                if kind in many
            )
        )
    for kind, doc in (peers.get("raw") or {}).items():
        runs = doc.get("raw", {}).get("runs_jobs_per_s")
        if runs:
            print(f"  raw {kind} runs (jobs/s): {runs} — the spread is this host's noise")
    if peers.get("scheduler"):
        worker_sched = {n: d.get("scheduler") for n, d in (report.get("worker") or {}).items()}
        print(
            f"  engine batch limits: raw {peers['scheduler']}; worker (from its log) {worker_sched}"
        )
    if peers.get("preprocess"):
        print(
            f"  raw engine start-up {peers.get('startup_s')}s; decode+resize ms per item on one "
            f"core: {peers['preprocess']['prepare_ms_per_item_one_core']}"
        )
    for name, doc in (report.get("profiled") or {}).items():
        rates = {k: doc[k]["jobs_per_s"] for k in ("image", "video") if k in doc}
        print(f"  {name} pass (under py-spy, not in the table): jobs/s {rates}")
    for error in report["errors"]:
        print(f"  ERROR {error}")
    print(f"\nwritten {o['out']}")
