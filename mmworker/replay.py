"""`mmworker replay`: post dead-lettered jobs again, once their cause is fixed.

Every `Failure` keeps the job's original message (`payload`), so a job that failed for a reason
that has gone away (a file that was missing, a fetch that timed out, a worker that lacked a task)
can be posted again as it was. What is posted is that payload with one change: the job's
`metadata.replays` counts the replays, so its next result or failure shows it was replayed and
how often. The worker gives a replayed job a fresh set of `limits.max_attempts`. A failure whose
payload the worker had to cut (over 64 KiB) is refused: posting a cut message would only turn
one failure into an `invalid_json` one.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from pydantic import ValidationError

from mmworker.config import WorkerConfig
from mmworker.errors import ConfigError
from mmworker.exits import ExitCode, Interrupted
from mmworker.schemas import MAX_PAYLOAD_BYTES, Failure
from mmworker.schemas.codes import ErrorCode

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_when(text: str, now: datetime | None = None) -> datetime:
    """An ISO 8601 time (UTC when it names no zone) or an age such as 90s, 30m, 2h, 7d."""
    match = _DURATION.match(text.strip())
    if match:
        age = timedelta(**{_UNITS[match.group(2)]: float(match.group(1))})
        return (now or datetime.now(UTC)) - age
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(
            f"{text!r} is not a time: give an ISO 8601 time (2026-12-01T09:30, UTC unless it "
            "says otherwise) or an age such as 30m, 2h, 7d"
        ) from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def parse_codes(codes: list[str]) -> set[ErrorCode]:
    known = {c.value: c for c in ErrorCode}
    chosen = {c.strip() for item in codes for c in item.split(",") if c.strip()}
    unknown = sorted(chosen - set(known))
    if unknown:
        raise ConfigError(
            f"--code {', '.join(unknown)}: no such failure code (known: {', '.join(known)})"
        )
    return {known[c] for c in chosen}


@dataclass(frozen=True, slots=True)
class Selection:
    codes: frozenset[ErrorCode] = frozenset()
    since: datetime | None = None
    until: datetime | None = None
    retryable_only: bool = False

    def wants(self, failure: Failure) -> bool:
        if self.codes and failure.code not in self.codes:
            return False
        if self.retryable_only and not failure.retryable:
            return False
        if self.since is not None and failure.failed_at < self.since:
            return False
        return self.until is None or failure.failed_at < self.until


def refusal(failure: Failure) -> str | None:
    """Why this failure cannot be replayed; None when it can."""
    if failure.payload_truncated:
        return (
            f"its payload was cut: the worker keeps at most {MAX_PAYLOAD_BYTES // 1024} KiB of a "
            "message on the dead-letter topic, so the job as posted is gone; post it again from "
            "its source (large media belong in file:// or http(s):// URIs, not inline)"
        )
    if not failure.payload:
        return "it has no payload to post"
    return None


def replay_payload(failure: Failure) -> bytes:
    """The original message, with `metadata.replays` one higher. A message that is not a JSON
    object with an object `metadata` (it failed as invalid_json, say) goes back byte for byte."""
    try:
        doc = json.loads(failure.payload)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return failure.payload
    if not isinstance(doc, dict):
        return failure.payload
    meta = doc.setdefault("metadata", {})
    if not isinstance(meta, dict):
        return failure.payload
    previous = meta.get("replays")
    meta["replays"] = (previous if isinstance(previous, int) else 0) + 1
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def _key(failure: Failure) -> str:
    """One replay per job: its id, or where it was read from when it had none."""
    s = failure.source
    return failure.job_id or f"{s.topic}/{s.partition}/{s.offset}"


@dataclass
class Scan:
    """The selected failures, one per job (its latest), and what the rest of the topic was."""

    chosen: dict[str, tuple[Failure, tuple[int, int]]] = field(default_factory=dict)
    scanned: int = 0
    matched: int = 0  # selected records, a job's earlier failures included
    unreadable: int = 0


def scan(cfg: WorkerConfig, selection: Selection) -> Scan:
    """Read the dead-letter topic to its end, without joining any consumer group."""
    from kafka import KafkaConsumer
    from kafka.structs import TopicPartition

    dlq = cfg.kafka.dead_letter_topic
    consumer = KafkaConsumer(
        group_id=None, enable_auto_commit=False, fetch_max_bytes=cfg.kafka.fetch_max_bytes,
        max_partition_fetch_bytes=cfg.kafka.max_partition_fetch_bytes,
        **cfg.kafka.client_kwargs(),
    )  # fmt: skip
    out = Scan()
    try:
        found = consumer.partitions_for_topic(dlq)
        if not found:
            raise ConfigError(f"no topic {dlq!r} on the brokers (kafka.dead_letter_topic)")
        parts = [TopicPartition(dlq, p) for p in sorted(found)]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        ends = consumer.end_offsets(parts)
        while True:
            batches = consumer.poll(timeout_ms=500)
            # Past the end offsets and nothing more: the end (an empty poll is needed too, as
            # the Tansu broker reports the end as its last batch's first offset + 1).
            if not batches and all(consumer.position(tp) >= end for tp, end in ends.items()):
                break
            for record in (r for records in batches.values() for r in records):
                out.scanned += 1
                try:
                    failure = Failure.model_validate_json(record.value or b"")
                except ValidationError:
                    out.unreadable += 1
                    continue
                if selection.wants(failure):
                    out.matched += 1  # a job's later failure replaces its earlier one
                    out.chosen[_key(failure)] = (failure, (record.partition, record.offset))
    finally:
        consumer.close()
    return out


def _post(cfg: WorkerConfig, topic: str, todo: list[tuple[str, Failure, tuple[int, int]]]) -> None:
    """Send each payload keyed by its job id, with a header naming the dead-letter record it
    came from, and wait until the broker has them all."""
    from kafka import KafkaProducer

    from mmworker.kafka_io import post_acknowledged

    producer = KafkaProducer(
        acks="all", linger_ms=20, max_block_ms=cfg.kafka.max_block_ms,
        max_request_size=cfg.kafka.max_request_size, **cfg.kafka.client_kwargs(),
    )  # fmt: skip
    dlq = cfg.kafka.dead_letter_topic
    records = [
        (key.encode(), replay_payload(failure), [("mmworker-replay-of", f"{dlq}/{p}/{o}".encode())])
        for key, failure, (p, o) in todo
    ]
    try:
        post_acknowledged(
            producer, topic, records, "name the input topic with --topic or kafka.input_topic"
        )
    finally:
        producer.close(timeout=5)


def replay(args: argparse.Namespace, cfg: WorkerConfig) -> int:
    """0: every selected failure was posted (or would be, with --dry-run); 1: some were refused
    (each said why); 130: interrupted."""
    try:
        return _replay(args, cfg)
    except Interrupted as exc:
        print(
            f"mmworker replay: {exc}: stopped; some jobs may have been posted, and running it "
            "again posts them again (results are keyed by job id, so downstream drops the copy)",
            file=sys.stderr,
        )
        return ExitCode.INTERRUPTED


def _replay(args: argparse.Namespace, cfg: WorkerConfig) -> int:
    selection = Selection(
        codes=frozenset(parse_codes(args.code)),
        since=parse_when(args.since) if args.since else None,
        until=parse_when(args.until) if args.until else None,
        retryable_only=args.retryable_only,
    )
    topic = args.topic or cfg.kafka.input_topic
    found = scan(cfg, selection)
    refused = {k: why for k, (f, _) in found.chosen.items() if (why := refusal(f)) is not None}
    for key, why in refused.items():
        print(f"refused {key} ({found.chosen[key][0].code.value}): {why}", file=sys.stderr)
    todo = [(k, f, where) for k, (f, where) in found.chosen.items() if k not in refused]
    if todo and not args.dry_run:
        _post(cfg, topic, todo)
    verb = "would replay" if args.dry_run else "replayed"
    for key, failure, _ in todo:
        print(f"{verb}\t{key}\t{failure.code.value}\t{failure.failed_at.isoformat()}")
    by_code = Counter(f.code.value for _, f, _ in todo)
    codes = ", ".join(f"{c} {n}" for c, n in sorted(by_code.items()))
    skipped = found.scanned - found.matched - found.unreadable
    print(
        f"{verb} {len(todo)} jobs to {topic}" + (f" ({codes})" if codes else "")
        + f"; {len(refused)} refused; of {found.scanned} dead-letter records, {skipped} not "
        f"selected, {found.matched - len(found.chosen)} earlier failures of a job replayed once"
        + (f", {found.unreadable} not failures" if found.unreadable else ""),
        file=sys.stderr,
    )  # fmt: skip
    return 1 if refused else 0
