"""`mmworker replay`: post dead-lettered jobs again, once their cause is fixed.

Every `Failure` keeps the job's original message (`payload`), so a job that failed for a reason
that has gone away (a file that was missing, a fetch that timed out, a worker that lacked a task)
can be posted again as it was. What is posted is that payload with one change: the job's
`metadata.replays` counts the replays, so its next result or failure shows it was replayed and
how often. The worker gives a replayed job a fresh set of `limits.max_attempts`. A failure whose
payload the worker had to cut (over 64 KiB) is refused: posting a cut message would only turn
one failure into an `invalid_json` one.

A plain replay does not know which backfill a job belongs to. With `--backfill-out RESULTS` it
replays only that finished output's failed rows, waits for their answers (told from the earlier
failure by the replay count they carry) and writes them into the output in place, since the
backfill's own run is over and nothing else would bring them there.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from mmworker_schemas import MAX_PAYLOAD_BYTES, Failure
from mmworker_schemas.codes import ErrorCode
from pydantic import ValidationError

from mmworker.config import WorkerConfig
from mmworker.errors import ConfigError
from mmworker.exits import ExitCode, check_interrupted, signal_behind

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_when(text: str, now: datetime | None = None) -> datetime:
    """An ISO 8601 time (UTC when it names no zone) or an age such as 90s, 30m, 2h, 7d."""
    match = _DURATION.match(text.strip())
    if match:
        try:
            age = timedelta(**{_UNITS[match.group(2)]: float(match.group(1))})
            return (now or datetime.now(UTC)) - age
        except OverflowError:  # 1000000d: before the year 1
            raise ConfigError(
                f"{text!r} reaches back before any time a record can have: give a smaller age"
            ) from None
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
    matched: int = 0  # records of the selected jobs, their earlier failures included
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
    #: each job's latest failure, where it is, and how many records the job has
    latest: dict[str, tuple[Failure, tuple[int, int], int]] = {}
    try:
        found = consumer.partitions_for_topic(dlq)
        if not found:
            raise ConfigError(f"no topic {dlq!r} on the brokers (kafka.dead_letter_topic)")
        parts = [TopicPartition(dlq, p) for p in sorted(found)]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        ends = consumer.end_offsets(parts)
        while True:
            check_interrupted()  # a Ctrl-C that a library swallowed still stops the scan
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
                # The selection is of each job's latest failure: an earlier one that matches
                # (fetch_failed, then a permanent failure on its replay) is not replayed again.
                key = _key(failure)
                seen = latest[key][2] if key in latest else 0
                latest[key] = (failure, (record.partition, record.offset), seen + 1)
    finally:
        from mmworker.backfill import close_reader

        close_reader(consumer)  # kafka-python's own close races its I/O thread (issue #35)
    for key, (failure, where, records) in latest.items():
        if selection.wants(failure):
            out.chosen[key] = (failure, where)
            out.matched += records
    return out


def _post(cfg: WorkerConfig, topic: str, todo: list[tuple[str, Failure, tuple[int, int]]]) -> None:
    """Send each payload keyed by its job id, with a header naming the dead-letter record it
    came from, and wait until the broker has them all."""
    from mmworker.kafka_io import post_acknowledged, posting_producer

    producer = posting_producer(cfg.kafka)
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
    except BaseException as exc:
        interrupted = signal_behind(exc)
        if interrupted is None:
            raise
        print(
            f"mmworker replay: {interrupted}: stopped; some jobs may have been posted, and "
            "running it again posts them again (results are keyed by job id, so downstream "
            "drops the copy)",
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
    target = Path(args.backfill_out) if getattr(args, "backfill_out", None) else None
    failed_rows = backfill_failures(target) if target is not None else None
    found = scan(cfg, selection)
    if failed_rows is not None:  # only the failures that are that output's failed rows
        found.chosen = {
            k: (f, where)
            for k, (f, where) in found.chosen.items()
            if k in failed_rows and f.metadata.get("fingerprint") == failed_rows[k]
        }
    refused = {k: why for k, (f, _) in found.chosen.items() if (why := refusal(f)) is not None}
    for key, why in refused.items():
        print(f"refused {key} ({found.chosen[key][0].code.value}): {why}", file=sys.stderr)
    todo = [(k, f, where) for k, (f, where) in found.chosen.items() if k not in refused]
    unanswered = 0
    if todo and not args.dry_run:
        reader = AnswerReader(cfg) if failed_rows is not None else None
        try:
            _post(cfg, topic, todo)
            if reader is not None and target is not None:
                expected = {k: _replays(replay_payload(f)) for k, f, _ in todo}
                answers = reader.collect(expected, args.wait)
                unanswered = len(expected) - len(answers)
                update_backfill_output(target, answers, args.wait, unanswered)
        finally:
            if reader is not None:
                reader.close()
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
    return 1 if refused or unanswered else 0


# --- a replay that updates a finished backfill's output (--backfill-out) ------------------------


def backfill_failures(out: Path) -> dict[str, str | None]:
    """The job ids of the failed rows of a finished backfill's output, with what each row asks
    (its fingerprint): what `--backfill-out` replays, and only a failure of that very question
    (rows that never became jobs, `invalid_schema`, have nothing on the dead-letter topic). An
    unfinished backfill is refused: its own run collects the answers."""
    from mmworker.backfill import INVALID_ROW, journal_path, read_output

    if not out.exists():
        raise ConfigError(f"--backfill-out {out}: no such file")
    if journal_path(out).exists():
        raise ConfigError(
            f"--backfill-out {out}: that backfill is not finished ({journal_path(out).name} "
            "is there); run its command again to finish it first"
        )
    return {
        str(r["job_id"]): r.get("fingerprint")
        for r in read_output(out)
        if r.get("outcome") == "failed" and r.get("code") != INVALID_ROW
    }


def _replays(payload: bytes) -> int | None:
    """`metadata.replays` of a payload as posted: its answer carries the same count, which is
    how an answer to this replay is told from the earlier failure it replays."""
    try:
        doc = json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    replays = meta.get("replays") if isinstance(meta, dict) else None
    return replays if isinstance(replays, int) else None


class AnswerReader:
    """Reads the output and dead-letter topics from where they end before the replay posts
    (no consumer group), for the answers to the replayed jobs."""

    def __init__(self, cfg: WorkerConfig) -> None:
        from kafka import KafkaConsumer
        from kafka.structs import TopicPartition

        self._consumer = KafkaConsumer(
            group_id=None, enable_auto_commit=False, auto_offset_reset="earliest",
            fetch_max_bytes=cfg.kafka.fetch_max_bytes,
            max_partition_fetch_bytes=cfg.kafka.max_partition_fetch_bytes,
            **cfg.kafka.client_kwargs(),
        )  # fmt: skip
        parts = []
        for topic in (cfg.kafka.output_topic, cfg.kafka.dead_letter_topic):
            found = self._consumer.partitions_for_topic(topic) or set()
            parts += [TopicPartition(topic, p) for p in sorted(found)]
        self._consumer.assign(parts)
        # Tansu reports an end short of the true one (its last batch's first offset + 1), so a
        # record from before may be read again: the replay count tells it apart.
        for tp, end in self._consumer.end_offsets(parts).items():
            self._consumer.seek(tp, end)

    def collect(self, expected: dict[str, int | None], wait_s: float) -> dict[str, dict[str, Any]]:
        """Output rows by job id, for the jobs in `expected` whose answer carries the replay
        count they were posted with; until all have one or `wait_s` has passed."""
        from mmworker.backfill import output_row

        answers: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + wait_s
        while len(answers) < len(expected) and time.monotonic() < deadline:
            check_interrupted()  # a Ctrl-C that a library swallowed still stops the wait
            for records in self._consumer.poll(timeout_ms=500, max_records=2048).values():
                for record in records:
                    try:
                        doc = json.loads(record.value or b"")
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        continue  # not a worker's record
                    if not isinstance(doc, dict):
                        continue
                    job_id = str(doc.get("job_id"))
                    meta = doc.get("metadata")
                    replays = meta.get("replays") if isinstance(meta, dict) else None
                    if (
                        job_id in expected
                        and job_id not in answers
                        and (replays == expected[job_id])
                    ):
                        row = output_row(doc)
                        if row is not None:
                            answers[job_id] = row
        return answers

    def close(self) -> None:
        from mmworker.backfill import close_reader

        close_reader(self._consumer)


def update_backfill_output(
    out: Path, answers: dict[str, dict[str, Any]], wait_s: float, unanswered: int
) -> None:
    """Rewrite the output with the replays' answers in their rows (same order, same row, row
    number, source and metadata columns), atomically, and drop the rows that are ok now from
    the retry manifest, which lists the failed rows in the same order."""
    from mmworker.backfill import read_output, replace_durably, write_rows, written_format

    fmt = written_format(out)
    retry = out.with_name(out.stem + ".retry.jsonl")
    retry_lines = retry.read_text(encoding="utf-8").splitlines(True) if retry.exists() else []
    failed_before = sum(1 for r in read_output(out) if r.get("outcome") == "failed")
    keep_retry = len(retry_lines) == failed_before
    kept: list[str] = []
    now_ok = 0

    def rows() -> Iterator[dict[str, Any]]:
        nonlocal now_ok
        position = 0
        for before in read_output(out):
            was_failed = before.get("outcome") == "failed"
            answer = answers.get(str(before["job_id"])) if was_failed else None
            row = before
            if answer is not None:
                keep = {k: before[k] for k in ("row", "row_number", "source", "metadata")}
                fingerprint = answer.get("fingerprint") or before.get("fingerprint")
                row = {**answer, **keep, "fingerprint": fingerprint}
                now_ok += row["outcome"] == "ok"
            if was_failed:
                if keep_retry and row["outcome"] != "ok":
                    kept.append(retry_lines[position])
                position += 1
            yield row

    tmp = out.with_name(f".{out.name}.tmp")
    try:
        write_rows(tmp, fmt, rows())
        if keep_retry and retry_lines:
            if kept:
                retry_tmp = retry.with_name(f".{retry.name}.tmp")
                retry_tmp.write_text("".join(kept), encoding="utf-8")
                replace_durably(retry_tmp, retry)
            else:
                retry.unlink()
        replace_durably(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    note = "" if keep_retry else f"; {retry.name} left as it was (it does not match the output)"
    late = (
        f"; {unanswered} not answered within --wait {wait_s:g}s (their rows stay failed: run the "
        "same replay again later)"
        if unanswered
        else ""
    )
    print(
        f"updated {out}: {len(answers)} rows answered again, {now_ok} of them ok now{late}{note}",
        file=sys.stderr,
    )
