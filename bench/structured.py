"""What guided (structured) output costs: the same image jobs as the `tags` task and as free text.

One real `mmworker run` process on the embedded broker answers, in turn, N `task = "tags"` jobs (a
JSON Schema answer, guided by xgrammar) and N free-text jobs over the same N images, with the same
prompt (the tags task's own). Each free-text job generates exactly as many tokens as the tags job
on its image did in the pass before (`ignore_eos`, `max_tokens` = that count), so the passes
differ only in the guidance: same inputs, same prompts, same output lengths. A warm-up pair comes
first, so the feature cache, vLLM's caches, the worker's compile verdict and the engine's grammar
backend are equally warm for every measured pass; the pairs then repeat `--repeats` times, and the
median of the pairs' jobs/s ratios is the headline (a neighbour's load skews both passes of a pair
alike; each row also records the load average).

Numbers per pass: jobs/s = jobs / (last answer read − all jobs posted); output tok/s likewise;
p50 = the worker's `timings.total_s`; busy = Δ`mmworker_engine_busy_seconds` / wall. The one-off
compile of the schema (the worker's check) is read from the worker's log. `--max-tokens` (1024)
caps the tags answers: random weights fill every string to its maxLength, far past the task's 192.

Run (CPU, tiny random model, ~3 min on an idle 2-core machine):
    .venv/bin/python bench/structured.py --out bench/results/structured-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    OUT,
    PeerStats,
    ResultReader,
    environment,
    fmt,
    make_images,
    metric_delta,
    percentile,
    print_table,
    scrape,
)

#: Tags first: each free-text pass generates the token counts the tags pass before it did.
KINDS = ("tags", "free")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--images", type=int, default=60, help="jobs per pass (distinct images)")
    p.add_argument("--size", type=int, default=448, help="image side (448: 256 visual tokens)")
    p.add_argument(
        "--max-tokens", type=int, default=1024,
        help="of the tags jobs (the task's 192 is too few for random weights, which fill "
        "every string to maxLength)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=6, help="measured tags/free pass pairs")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for one pass")
    p.add_argument("--out", type=Path, default=OUT / "structured.json")
    return p.parse_args(argv)


def tags_prompt() -> str:
    from mmworker_schemas import Job, MediaRef

    from mmworker.config import load_config
    from mmworker.tasks import plan_job

    job = Job(job_id="x", task="tags", media=[MediaRef(uri="https://example.com/x.jpg")])
    _, plan = plan_job(job, load_config().tasks)
    return plan.instruction(["image"])


def jobs_for(
    kind: str, tag: str, images: list[Path], max_tokens: int, lengths: dict[int, int]
) -> list[tuple[str, bytes]]:
    """Tags jobs stop where their JSON closes; each free-text job is then made to generate
    exactly as many tokens as the tags job on its image did (`ignore_eos`)."""
    from mmworker_schemas import GenerationParams, Job, MediaRef

    prompt = tags_prompt()
    out = []
    for i, path in enumerate(images):
        if kind == "tags":
            extra: dict[str, Any] = {"task": "tags"}
            generation = GenerationParams(max_tokens=max_tokens)
        else:
            extra = {"prompt": prompt}
            generation = GenerationParams(max_tokens=lengths[i], ignore_eos=True)
        job = Job(
            job_id=f"{tag}-{kind}-{i}", media=[MediaRef(data=path.read_bytes())],
            generation=generation, **extra,
        )  # fmt: skip
        out.append((job.job_id, job.model_dump_json(exclude_defaults=True).encode()))
    return out


def post(bootstrap: str, topic: str, jobs: list[tuple[str, bytes]]) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=[bootstrap], acks="all", max_request_size=8 << 20)
    for key, value in jobs:
        producer.send(topic, key=key.encode(), value=value)
    producer.flush()
    producer.close()


def one_pass(
    kind: str,
    tag: str,
    ctx: dict[str, Any],
    images: list[Path],
    args: argparse.Namespace,
    lengths: dict[int, int],
) -> PeerStats:
    """`lengths`: image index → output tokens, written by a tags pass, read by a free one."""
    jobs = jobs_for(kind, tag, images, args.max_tokens, lengths)
    before = scrape(ctx["port"])
    t0 = time.time()
    post(ctx["bootstrap"], ctx["topics"]["input"], jobs)
    reader: ResultReader = ctx["reader"]
    ids = {job_id for job_id, _ in jobs}
    reader.wait_for(ids, args.timeout, alive=lambda: ctx["proc"].poll() is None)
    seen = [reader.seen[i] for i in ids]
    wall = max(s.received for s in seen) - t0
    after = scrape(ctx["port"])
    results = [s.doc for s in seen if "code" not in s.doc]
    failures = [s.doc["code"] for s in seen if "code" in s.doc]
    tokens = sum(d["usage"]["output_tokens"] for d in results)
    stats = PeerStats(
        peer=tag, kind=kind, jobs=len(jobs), wall_s=wall, output_tokens=tokens,
        latencies_s=[d["timings"]["total_s"] for d in results],
        busy_s=metric_delta(before, after, "mmworker_engine_busy_seconds"),
        failures=len(failures),
    )  # fmt: skip
    stats.extra["failure_codes"] = sorted(set(failures))
    # Another process on this machine skews a pass: the load average says whether one ran.
    stats.extra["load_1m_after"] = round(os.getloadavg()[0], 2)
    stats.extra["tokens_per_job"] = round(tokens / len(results), 1) if results else None
    stats.extra["finish_reasons"] = sorted({d["finish_reason"] for d in results})
    if kind == "tags":
        stats.extra["parsed"] = sum(d.get("json") is not None for d in results)
        stats.extra["example"] = next((d["json"] for d in results), None)
        lengths.clear()
        for d in results:
            lengths[int(d["job_id"].rsplit("-", 1)[1])] = d["usage"]["output_tokens"]
        if len(lengths) < len(images):
            raise RuntimeError(f"{len(images) - len(lengths)} tags jobs failed: {failures}")
    return stats


def wait_metrics(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    """The metrics endpoint is served before the engine starts; the warm-up pass waits for
    the engine."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            scrape(port)
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from mmworker.config import KafkaConfig
    from mmworker.devkit.broker import EmbeddedBroker, free_port
    from mmworker.devkit.demo import worker_command
    from mmworker.kafka_io import ensure_topics

    images = make_images(args.images, args.size)
    workdir = OUT / f"structured-{uuid.uuid4().hex[:6]}"
    workdir.mkdir(parents=True)
    rows: list[PeerStats] = []
    with EmbeddedBroker() as broker:
        tag = uuid.uuid4().hex[:6]
        topics = {k: f"bench-structured-{tag}.{k}" for k in ("input", "output", "dlq")}
        kafka = KafkaConfig(bootstrap_servers=broker.bootstrap)  # type: ignore[call-arg]
        ensure_topics(kafka, {t: 3 for t in topics.values()})
        port = free_port()
        cmd = worker_command(broker.bootstrap, workdir, topics, f"bench-{tag}",
                             {"metrics_port": port})  # fmt: skip
        log_path = workdir / "worker.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        reader = ResultReader(broker.bootstrap, [topics["output"], topics["dlq"]])
        ctx = {"bootstrap": broker.bootstrap, "topics": topics, "port": port, "proc": proc,
               "reader": reader}  # fmt: skip
        try:
            started = time.monotonic()
            wait_metrics(port, proc)
            lengths: dict[int, int] = {}
            for kind in KINDS:  # warm-up: every cache, and the grammar backend, made hot
                one_pass(kind, "warmup", ctx, images, args, lengths)
            print(f"worker up and warm after {time.monotonic() - started:.0f}s", flush=True)
            for r in range(args.repeats):
                for kind in KINDS:
                    rows.append(one_pass(kind, f"run{r}", ctx, images, args, lengths))
                    print(f"{kind} pass {r}: {rows[-1].jobs_per_s:.2f} jobs/s", flush=True)
        finally:
            reader.close()
            proc.terminate()
            proc.wait(timeout=120)
    log_text = log_path.read_text(errors="replace")
    compiles = [
        {"kind": k, "bytes": int(b), "verdict": v, "seconds": float(s)}
        for k, b, v, s in re.findall(
            r"response_format \((\w+), (\d+) bytes\) (\w+) in ([0-9.]+)s", log_text
        )
    ]
    return {"rows": rows, "compiles": compiles, "log": str(log_path)}


def summary(rows: list[PeerStats]) -> dict[str, Any]:
    def total(kind: str, attr: str) -> float:
        return sum(getattr(r, attr) for r in rows if r.kind == kind)

    out: dict[str, Any] = {}
    for kind in KINDS:
        wall = total(kind, "wall_s")
        lat = [x for r in rows if r.kind == kind for x in r.latencies_s]
        answered = total(kind, "jobs") - total(kind, "failures")
        out[kind] = {
            "jobs_per_s": round(total(kind, "jobs") / wall, 3),
            "output_tokens_per_s": round(total(kind, "output_tokens") / wall, 1),
            "tokens_per_job": round(total(kind, "output_tokens") / answered, 1)
            if answered
            else None,
            "latency_p50_s": round(percentile(lat, 50) or 0.0, 3),
            "failures": int(total(kind, "failures")),
        }
    # Each tags pass beside the free pass right after it: a neighbour's load skews both alike,
    # so the median of the pairs is the figure to quote.
    tags = [r for r in rows if r.kind == "tags"]
    free = [r for r in rows if r.kind == "free"]
    pairs = [t.jobs_per_s / f.jobs_per_s for t, f in zip(tags, free, strict=True)]
    out["pair_ratios"] = [round(x, 3) for x in pairs]
    out["tags_vs_free_median_pair"] = round(percentile(pairs, 50) or 0.0, 3)
    # The worker and its engine keep about as many cores busy as there are; a 1-minute load
    # average above that by more than half a core means another process was running.
    quiet_load = (os.cpu_count() or 1) + 0.5
    quiet = [
        x
        for x, t, f in zip(pairs, tags, free, strict=True)
        if max(t.extra["load_1m_after"], f.extra["load_1m_after"]) <= quiet_load
    ]
    out["quiet_pairs"] = len(quiet)
    out["tags_vs_free_median_quiet_pair"] = round(percentile(quiet, 50) or 0.0, 3) or None
    out["tags_vs_free_jobs_per_s"] = round(out["tags"]["jobs_per_s"] / out["free"]["jobs_per_s"], 3)
    out["tags_vs_free_tokens_per_s"] = round(
        out["tags"]["output_tokens_per_s"] / out["free"]["output_tokens_per_s"], 3
    )
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    rows: list[PeerStats] = report["rows"]
    print_table(
        f"free text vs tags schema, {args.images} images of {args.size}px, max_tokens "
        f"{args.max_tokens}",
        ["pass", "kind", "jobs", "failed", "wall s", "jobs/s", "tok/s", "tok/job", "p50 s",
         "busy", "load"],
        [[r.peer, r.kind, str(r.jobs), str(r.failures), fmt(r.wall_s), fmt(r.jobs_per_s),
          fmt(r.tokens_per_s, ".0f"), fmt(r.extra["tokens_per_job"], ".1f"),
          fmt(percentile(r.latencies_s, 50)), fmt(r.busy_fraction),
          fmt(r.extra["load_1m_after"])] for r in rows],
    )  # fmt: skip
    totals = summary(rows)
    print(f"\ntotals: {json.dumps(totals)}\ncompiles: {json.dumps(report['compiles'])}")
    doc = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": vars(args) | {"out": str(args.out)},
        "environment": environment(),
        "summary": totals,
        "compiles": report["compiles"],
        "rows": [r.to_json() for r in rows],
        "worker_log": report["log"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r.failures == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
