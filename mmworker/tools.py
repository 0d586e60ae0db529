"""`mmworker submit` and `mmworker tail`: the producer and reader a person uses by hand."""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from kafka import KafkaConsumer, KafkaProducer
from tqdm import tqdm

from schemas import GenerationParams, Job, MediaRef

_MEDIA_SUFFIXES = {
    ".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff",
    ".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v", ".ts",
}  # fmt: skip


def expand_sources(sources: list[str]) -> Iterator[str]:
    """Directories become their media files (sorted, recursive); URLs and files pass through."""
    for source in sources:
        path = Path(source)
        if source.startswith(("http://", "https://", "file://")):
            yield source
        elif path.is_dir():
            for child in sorted(path.rglob("*")):
                if child.is_file() and child.suffix.lower() in _MEDIA_SUFFIXES:
                    yield str(child)
        else:
            yield source


def job_for(source: str, prompt: str | None, max_tokens: int, inline_max: int) -> Job:
    if source.startswith(("http://", "https://", "file://")):
        ref = MediaRef(uri=source)
    else:
        path = Path(source).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {source}")
        ref = (
            MediaRef(data=path.read_bytes())
            if path.stat().st_size <= inline_max
            else MediaRef(uri=path.as_uri())
        )
    return Job(
        job_id=str(uuid.uuid4()),
        prompt=prompt,
        media=[ref],
        generation=GenerationParams(max_tokens=max_tokens),
    )


def submit(args: argparse.Namespace) -> int:
    sources = list(expand_sources(args.sources)) * args.repeat
    if not sources:
        print("mmworker submit: nothing to submit", file=sys.stderr)
        return 2
    producer = KafkaProducer(
        bootstrap_servers=args.bootstrap_servers.split(","),
        acks="all",
        linger_ms=20,
        max_request_size=8 * 1024 * 1024,
    )
    failed = 0
    with tqdm(total=len(sources), unit="job", desc="submitting", file=sys.stderr) as bar:
        for source in sources:
            try:
                job = job_for(source, args.prompt, args.max_tokens, args.inline_max_bytes)
            except (OSError, ValueError) as exc:
                tqdm.write(f"skipped {source}: {exc}", file=sys.stderr)
                failed += 1
                bar.update()
                continue
            value = job.model_dump_json(exclude_defaults=True).encode()
            producer.send(args.topic, key=job.job_id.encode(), value=value).add_callback(
                lambda _meta: bar.update()
            )
            print(f"{job.job_id}\t{source}")
        producer.flush()
    producer.close()
    return 1 if failed else 0


def tail(args: argparse.Namespace) -> int:
    consumer = KafkaConsumer(
        *args.topics,
        bootstrap_servers=args.bootstrap_servers.split(","),
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        group_id=None,
        consumer_timeout_ms=None if args.follow else int(args.timeout * 1000),
    )
    seen = 0
    started = time.monotonic()
    try:
        for record in consumer:
            seen += 1
            doc = json.loads(record.value)
            line = json.dumps(doc) if args.json else summarise(record.topic, doc, record.key)
            print(line, flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()
    print(f"{seen} records in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0


def summarise(topic: str, doc: dict[str, object], key: bytes | None = None) -> str:
    """One line per record; a failure without a job_id is named by its record key."""
    if "code" in doc:
        name = doc.get("job_id") or (key.decode(errors="replace") if key else "?")
        return f"[{topic}] FAILED {name}: {doc['code']}: {doc.get('message')}"
    media = doc.get("media")
    items = media if isinstance(media, list) else []
    kinds = ",".join(str(m.get("kind")) for m in items if isinstance(m, dict))
    hit = " (cache hit)" if doc.get("cache_hit") else ""
    text = str(doc.get("text"))
    shown = repr(text[:60] + ("…" if len(text) > 60 else ""))
    return f"[{topic}] {doc.get('job_id')} [{kinds}]{hit}: {shown}"
