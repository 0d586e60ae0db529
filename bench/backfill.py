"""Rows/s of `mmworker backfill` against `mmworker submit` plus reading the output topic.

The question: does the closed loop (at most `--window` jobs outstanding, answers collected and
written to a results file, a journal line per job) cost throughput against posting everything at
once and reading the answers back? One real `mmworker run` process (tiny random model) on the
embedded broker answers both passes: the same `--rows` jobs over the same small images, `file://`
URIs under the worker's allowed roots, `--max-tokens` output tokens each. A warm-up pass over
every image first, so the feature cache and vLLM's caches are equally warm for both.

* backfill: wall time of the `mmworker backfill` process, start to exit (manifest read, posting,
  collecting, the Parquet output and the retry manifest included);
* submit: from the start of `mmworker submit DIR --repeat N` until the last of its jobs is
  read back from the output topic (what a person does by hand instead).

Run by hand (CPU, ~2 min for 10,000 rows on an idle 2-core machine, most of it the worker):
    .venv/bin/python bench/backfill.py --rows 10000 --json /tmp/backfill-bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kafka import KafkaConsumer, KafkaProducer
from kafka.structs import TopicPartition
from mmworker_schemas import GenerationParams, Job, MediaRef

from mmworker.config import KafkaConfig
from mmworker.devkit.broker import EmbeddedBroker
from mmworker.devkit.demo import worker_command
from mmworker.devkit.samples import sample_image
from mmworker.kafka_io import ensure_topics


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=10_000, help="jobs per pass")
    p.add_argument("--images", type=int, default=16, help="distinct images the rows cycle over")
    p.add_argument("--size", type=int, default=64, help="image side in pixels")
    p.add_argument("--max-tokens", type=int, default=1, help="output tokens per job")
    p.add_argument("--window", type=int, default=128, help="backfill --window")
    p.add_argument("--max-in-flight", type=int, default=64, help="the worker's limit")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    return p.parse_args(argv)


def _mmworker(*args: str) -> list[str]:
    return [sys.executable, "-m", "mmworker", *args]


class Answers:
    """Counts answers on the output and dead-letter topics from where they end now."""

    def __init__(self, bootstrap: str, topics: list[str]) -> None:
        self._consumer = KafkaConsumer(bootstrap_servers=[bootstrap], group_id=None)
        parts = [TopicPartition(t, p) for t in topics
                 for p in sorted(self._consumer.partitions_for_topic(t) or {0})]  # fmt: skip
        self._consumer.assign(parts)
        self._consumer.seek_to_end(*parts)
        self.ids: set[str] = set()

    def until(self, wanted: set[str], timeout_s: float) -> float:
        """Read until every wanted job has an answer; returns when the last one was read."""
        deadline = time.monotonic() + timeout_s
        while not wanted <= self.ids:
            if time.monotonic() > deadline:
                raise SystemExit(f"only {len(wanted & self.ids)} of {len(wanted)} answered")
            for records in self._consumer.poll(timeout_ms=200).values():
                for r in records:
                    self.ids.add(str(json.loads(r.value).get("job_id")))
        return time.monotonic()

    def close(self) -> None:
        self._consumer.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        media = work / "media"
        media.mkdir()
        for k in range(args.images):
            (media / f"img{k:03d}.jpg").write_bytes(sample_image(args.size, args.size, seed=k))
        tag = uuid.uuid4().hex[:6]
        topics = {k: f"bench-{tag}.{k}" for k in ("input", "output", "dlq")}
        kafka = KafkaConfig(bootstrap_servers=broker.bootstrap)  # type: ignore[call-arg]
        ensure_topics(kafka, {t: 1 if k == "dlq" else 3 for k, t in topics.items()})
        sets = ["--bootstrap-servers", broker.bootstrap,
                "--set", f"kafka.input_topic={topics['input']}",
                "--set", f"kafka.output_topic={topics['output']}",
                "--set", f"kafka.dead_letter_topic={topics['dlq']}",
                "--set", f"preprocess.allowed_roots={json.dumps([str(work)])}"]  # fmt: skip
        extra = {"limits.max_in_flight": args.max_in_flight, "kafka.max_poll_records": 64}
        cmd = worker_command(broker.bootstrap, work, topics, f"bench-{tag}", extra)
        log = (work / "worker.log").open("wb")
        worker = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
        try:
            numbers = _passes(args, broker.bootstrap, work, media, topics, sets)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
            log.close()
    print(f"{'pass':<10} {'rows':>7} {'seconds':>8} {'rows/s':>8}")
    for name in ("backfill", "submit"):
        row = numbers[name]
        print(f"{name:<10} {row['rows']:>7} {row['seconds']:>8.1f} {row['rows_per_s']:>8.1f}")
    print(f"backfill / submit: {numbers['ratio']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(numbers, indent=2) + "\n")
    return 0


def _passes(
    args: argparse.Namespace, bootstrap: str, work: Path, media: Path, topics: dict[str, str],
    sets: list[str],
) -> dict[str, Any]:  # fmt: skip
    answers = Answers(bootstrap, [topics["output"], topics["dlq"]])
    gen = GenerationParams(max_tokens=args.max_tokens)
    images = sorted(media.iterdir())
    warm = {f"warm-{p.stem}": Job(job_id=f"warm-{p.stem}", media=[MediaRef(uri=p.as_uri())],
                                  generation=gen) for p in images}  # fmt: skip
    producer = KafkaProducer(bootstrap_servers=[bootstrap], acks="all")
    for job_id, job in warm.items():
        producer.send(topics["input"], key=job_id.encode(), value=job.model_dump_json().encode())
    producer.close()
    answers.until(set(warm), 600)  # the engine's start-up, then every image once

    manifest = work / "rows.jsonl"
    manifest.write_text("".join(
        json.dumps({"key": f"r{i}", "uri": str(images[i % len(images)])}) + "\n"
        for i in range(args.rows)
    ))  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(
        _mmworker("backfill", str(manifest), "--out", str(work / "rows.parquet"), "--name", "b",
                  "--key-column", "key", "--window", str(args.window),
                  "--max-tokens", str(args.max_tokens), *sets),
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    backfill_s = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"backfill exited {done.returncode}: {done.stderr[-2000:]}")

    repeat = -(-args.rows // len(images))
    started = time.monotonic()
    sent = subprocess.run(
        _mmworker("submit", str(media), "--repeat", str(repeat), "--inline-max-bytes", "0",
                  "--max-tokens", str(args.max_tokens), *sets),
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if sent.returncode != 0:
        raise SystemExit(f"submit exited {sent.returncode}: {sent.stderr[-2000:]}")
    ids = {line.split("\t")[0] for line in sent.stdout.splitlines()}
    submit_s = answers.until(ids, 1200) - started
    answers.close()
    rows = {"backfill": args.rows, "submit": len(ids)}
    seconds = {"backfill": backfill_s, "submit": submit_s}
    out: dict[str, Any] = {
        name: {"rows": rows[name], "seconds": round(seconds[name], 2),
               "rows_per_s": round(rows[name] / seconds[name], 2)}
        for name in rows
    }  # fmt: skip
    out["ratio"] = round(out["backfill"]["rows_per_s"] / out["submit"]["rows_per_s"], 3)
    out["settings"] = {k: str(v) for k, v in vars(args).items()}
    out["load_average"] = os.getloadavg()
    return out


if __name__ == "__main__":
    raise SystemExit(main())
