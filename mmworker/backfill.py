"""`mmworker backfill MANIFEST --out RESULTS`: caption every row of a manifest, resumably.

`submit` posts and forgets; a backfill of a million files needs more: ids that stay the same
across re-runs (so results join back to rows, and a re-run asks nothing twice), a bound on what
sits in the topic at once (so live jobs are not queued behind a million rows), a collector that
turns answers into one output row per manifest row, and a way back in after any crash.

The state that makes a restart safe is one append-only file beside the output, the *journal*
(`RESULTS.journal`): a line per posted job (with its payload, so it can be re-posted without the
manifest), a line per answer, and the collector's topic positions written after the answers
they cover. Answers and positions live in one file, so a SIGKILL can never leave positions ahead
of the answers they stand for (a Kafka commit and a local file cannot be written together). At
the end the journal is rewritten as the output (Parquet or JSONL, duplicates dropped by job id)
and removed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import glob
import hashlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mmworker.config import WorkerConfig
from mmworker.errors import ConfigError
from mmworker.exits import ExitCode, Interrupted
from mmworker.schemas import GenerationParams, Job, MediaRef
from mmworker.schemas.job import JOB_ID_MAX_LENGTH

#: Manifest suffixes and the reader each selects.
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
CSV_SUFFIXES = (".csv", ".tsv")
PARQUET_SUFFIXES = (".parquet", ".pq")
_URL_PREFIXES = ("http://", "https://", "file://")
#: Job fields a row's options may set; everything else about a job is the backfill's business.
OPTION_FIELDS = ("prompt", "task", "response_format", "generation", "image", "video")
#: Shorthands: `{"max_tokens": 8}` means `{"generation": {"max_tokens": 8}}`.
GENERATION_FIELDS = tuple(GenerationParams.model_fields)
#: Failure code of a row that never became a job (the worker's own code for a bad job).
INVALID_ROW = "invalid_schema"
#: The columns of every output row, in order (Parquet schema and JSONL keys alike).
OUTPUT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("job_id", "string"), ("row", "string"), ("source", "string"), ("outcome", "string"),
    ("caption", "string"), ("json", "string"), ("task", "string"), ("finish_reason", "string"),
    ("model", "string"), ("model_revision", "string"), ("prompt_tokens", "int64"),
    ("visual_tokens", "int64"), ("output_tokens", "int64"), ("queue_wait_s", "float64"),
    ("fetch_s", "float64"), ("preprocess_s", "float64"), ("engine_s", "float64"),
    ("total_s", "float64"), ("code", "string"), ("message", "string"), ("retryable", "bool_"),
    ("attempts", "int64"), ("worker_id", "string"), ("metadata", "string"),
    ("answered_at", "string"),
)  # fmt: skip


class ManifestError(ConfigError):
    """The manifest cannot be read as asked (format, missing column, unreadable file): found
    before anything is posted, reported in one line like every usage error."""


# --- the manifest -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Columns:
    """Which manifest columns mean what. Only `uri` is required."""

    uri: str = "uri"
    key: str | None = None
    prompt: str | None = None
    options: str | None = None
    metadata: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Row:
    """One manifest row as read: its original fields (for the retry manifest) and its number."""

    index: int
    fields: dict[str, Any]


def manifest_kind(spec: str) -> str:
    """'dir', 'glob', 'jsonl', 'csv' or 'parquet', from what `spec` names."""
    path = Path(spec)
    if path.is_dir():
        return "dir"
    if glob.has_magic(spec):
        return "glob"
    suffix = path.suffix.lower()
    for kind, suffixes in (
        ("jsonl", JSONL_SUFFIXES), ("csv", CSV_SUFFIXES), ("parquet", PARQUET_SUFFIXES)
    ):  # fmt: skip
        if suffix in suffixes:
            if not path.is_file():
                raise ManifestError(f"manifest {spec}: no such file")
            return kind
    raise ManifestError(
        f"manifest {spec}: not a directory, a glob, or a file ending in "
        f"{', '.join(JSONL_SUFFIXES + CSV_SUFFIXES + PARQUET_SUFFIXES)}"
    )


def read_manifest(spec: str) -> Iterator[Row]:
    """Rows in manifest order. Directories and globs yield `{"uri": path}` for each file whose
    bytes are an image or a video (by content, as `submit` decides), sorted."""
    kind = manifest_kind(spec)
    if kind in ("dir", "glob"):
        rows: Iterable[dict[str, Any]] = _media_files(spec, kind)
    elif kind == "jsonl":
        rows = _jsonl_rows(Path(spec))
    elif kind == "csv":
        rows = _csv_rows(Path(spec))
    else:
        rows = _parquet_rows(Path(spec))
    for index, fields in enumerate(rows):
        yield Row(index, fields)


def count_rows(spec: str) -> int | None:
    """The manifest's row count for the progress bar, where it is cheap; None otherwise."""
    kind = manifest_kind(spec)
    if kind == "parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(spec).metadata.num_rows)
    if kind == "jsonl":
        with open(spec, "rb") as f:
            return sum(1 for line in f if line.strip())
    if kind == "csv":
        return sum(1 for _ in _csv_rows(Path(spec)))
    return None


def _jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ManifestError(f"manifest {path}, line {number}: not JSON ({exc})") from None
            if not isinstance(doc, dict):
                raise ManifestError(f"manifest {path}, line {number}: not a JSON object")
            yield doc


def _csv_rows(path: Path) -> Iterator[dict[str, Any]]:
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    with path.open(newline="", encoding="utf-8") as f:
        yield from csv.DictReader(f, delimiter=delimiter)


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        yield from batch.to_pylist()


def _media_files(spec: str, kind: str) -> Iterator[dict[str, Any]]:
    from mmworker.tools import expand_sources

    if kind == "dir":
        sources = expand_sources([spec])
    else:
        matched = sorted(p for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        sources = expand_sources(matched)
    for source in sources:
        if source.skip is None:
            yield {"uri": source.name}
        else:
            print(f"skipped {source.name}: {source.skip}", file=sys.stderr)


# --- rows to jobs -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Defaults:
    """What the command line sets for every row; a row's own prompt and options win."""

    prompt: str | None = None
    task: str | None = None
    generation: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Planned:
    """A row made into a job, or the reason it could not be (then `job` is None)."""

    job_id: str
    key: str
    source: str
    metadata: dict[str, Any]
    job: Job | None = None
    problem: str | None = None


def job_id_for(name: str, key: str | None, identity: dict[str, Any]) -> str:
    """`name/key` when the manifest has a key column; else `name/` and a hash of the URI, the
    prompt and the options, so an edited row is a new job and a re-run of the same rows is not.
    Keys that could not travel as a job id (too long, control characters) are hashed too."""
    if key is not None:
        job_id = f"{name}/{key}"
        if len(job_id) <= JOB_ID_MAX_LENGTH and not any(ord(c) < 0x20 for c in job_id):
            return job_id
        identity = {"key": key}
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return f"{name}/{hashlib.sha256(canonical.encode()).hexdigest()[:32]}"


def plan(row: Row, name: str, cols: Columns, defaults: Defaults, base: Path) -> Planned:
    """The job for one row. Relative paths are read from `base` (the manifest's directory), so
    the ids and URIs do not depend on where the command was started."""
    fields = row.fields
    raw_key = fields.get(cols.key) if cols.key else None
    given_key = None if raw_key in (None, "") else str(raw_key)
    key = given_key if given_key is not None else str(row.index)
    uri_value = fields.get(cols.uri)
    source = "" if uri_value is None else str(uri_value)
    metadata: dict[str, Any] = {"source": source, "backfill": name, "row": key}
    columns = {c: _jsonable(fields.get(c)) for c in cols.metadata}
    if columns:
        metadata["columns"] = columns
    try:
        options = _options(fields.get(cols.options) if cols.options else None)
        prompt = fields.get(cols.prompt) if cols.prompt else None
        params: dict[str, Any] = {
            "prompt": options.pop("prompt", None) or (str(prompt) if prompt else defaults.prompt),
            "task": options.pop("task", defaults.task),
            "generation": {**defaults.generation, **options.pop("generation", {})},
            **options,
        }
        uri = _uri(source, cols.uri, base)
    except ValueError as exc:
        job_id = job_id_for(name, given_key, {"row": fields})
        return Planned(job_id, key, source, metadata, problem=str(exc))
    job_id = job_id_for(name, given_key, {"uri": uri, **params})
    try:
        job = Job(job_id=job_id, media=[MediaRef(uri=uri)], metadata=metadata, **params)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'job'}: {e['msg']}"
            for e in exc.errors(include_url=False)[:5]
        )
        return Planned(job_id, key, source, metadata, problem=problems)
    return Planned(job_id, key, source, metadata, job=job)


def _uri(value: str, column: str, base: Path) -> str:
    if not value:
        raise ValueError(f"no media: column {column!r} is empty or missing")
    if value.startswith(_URL_PREFIXES):
        return value
    path = Path(value).expanduser()
    return (path if path.is_absolute() else base / path).resolve().as_uri()


def _options(value: object) -> dict[str, Any]:
    """A row's options: a JSON object, or a string holding one (CSV, Parquet string columns)."""
    if value in (None, ""):
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"options: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"options: a JSON object is needed, not {type(value).__name__}")
    out: dict[str, Any] = {}
    generation = value.get("generation") or {}
    if not isinstance(generation, dict):
        raise ValueError("options: generation must be a JSON object")
    generation = dict(generation)
    for name, item in value.items():
        if name in GENERATION_FIELDS:
            generation[name] = item
        elif name in OPTION_FIELDS and name != "generation":
            out[name] = item
        elif name != "generation":
            known = ", ".join((*OPTION_FIELDS, *GENERATION_FIELDS))
            raise ValueError(f"options: unknown option {name!r} (known: {known})")
    if generation:
        out["generation"] = generation
    return out


def _jsonable(value: object) -> Any:
    """A metadata cell as JSON (Parquet dates and decimals become strings)."""
    return json.loads(json.dumps(value, default=str))


# --- answers to output rows ---------------------------------------------------------------------


def output_row(doc: dict[str, Any]) -> dict[str, Any] | None:
    """One output row from a Result or Failure document; None when it is neither."""
    raw = doc.get("metadata")
    meta: dict[str, Any] = raw if isinstance(raw, dict) else {}
    row: dict[str, Any] = dict.fromkeys(name for name, _ in OUTPUT_COLUMNS)
    row.update(
        job_id=doc.get("job_id"), row=_str(meta.get("row")), source=_str(meta.get("source")),
        model=doc.get("model"), model_revision=doc.get("model_revision"),
        worker_id=doc.get("worker_id"), task=doc.get("task"),
        metadata=json.dumps(meta.get("columns") or {}, sort_keys=True),
    )  # fmt: skip
    if "code" in doc:
        row.update(
            outcome="failed", code=doc.get("code"), message=doc.get("message"),
            retryable=bool(doc.get("retryable")), attempts=doc.get("attempts"),
            answered_at=doc.get("failed_at"),
        )  # fmt: skip
        return row
    if "text" not in doc:
        return None
    usage = doc.get("usage") or {}
    timings = doc.get("timings") or {}
    row.update(
        outcome="ok", caption=doc.get("text"), finish_reason=doc.get("finish_reason"),
        json=None if doc.get("json") is None else json.dumps(doc["json"]),
        answered_at=doc.get("created_at"),
        **{k: usage.get(k) for k in ("prompt_tokens", "visual_tokens", "output_tokens")},
        **{k: timings.get(k) for k in ("queue_wait_s", "fetch_s", "preprocess_s", "engine_s",
                                        "total_s")},
    )  # fmt: skip
    return row


def local_failure(p: Planned) -> dict[str, Any]:
    """The output row of a manifest row that never became a job."""
    row: dict[str, Any] = dict.fromkeys(name for name, _ in OUTPUT_COLUMNS)
    row.update(
        job_id=p.job_id, row=p.key, source=p.source, outcome="failed", code=INVALID_ROW,
        message=p.problem, retryable=False, attempts=0,
        metadata=json.dumps(p.metadata.get("columns") or {}, sort_keys=True),
    )  # fmt: skip
    return row


def _str(value: object) -> str | None:
    return None if value is None else str(value)


# --- the journal and the output -----------------------------------------------------------------


@dataclass
class State:
    """What the output and the journal say: the rows answered, the jobs posted and not yet
    answered (with their payloads and when they were posted), and the collector's positions."""

    outcomes: dict[str, str] = field(default_factory=dict)  # job id -> "ok" or a failure code
    posted: dict[str, tuple[float, bytes]] = field(default_factory=dict)
    positions: dict[str, int] = field(default_factory=dict)  # "topic:partition" -> next offset

    def answer(self, row: dict[str, Any]) -> bool:
        """Record an answer; False for a duplicate (at-least-once, or a job posted twice)."""
        job_id = row["job_id"]
        self.posted.pop(job_id, None)
        if job_id in self.outcomes:
            return False
        self.outcomes[job_id] = "ok" if row["outcome"] == "ok" else str(row["code"])
        return True


def journal_path(out: Path) -> Path:
    return out.with_name(out.name + ".journal")


def load_state(out: Path) -> State:
    """The output of an earlier run (rows already answered) merged with the journal of an
    interrupted one. A last line cut by a SIGKILL mid-write is dropped (and cut off the file
    before anything is appended, so the next line does not run on from it)."""
    state = State()
    if out.exists():
        for row in read_output(out):
            state.answer(row)
    path = journal_path(out)
    if not path.exists():
        return state
    with path.open("rb+") as f:
        end = 0
        for line in f:
            if not line.endswith(b"\n"):
                f.truncate(end)
                break
            end += len(line)
            _apply(state, json.loads(line))
    return state


def _apply(state: State, entry: dict[str, Any]) -> None:
    kind = entry["t"]
    if kind == "posted":
        if entry["id"] not in state.outcomes:
            state.posted[entry["id"]] = (entry["at"], entry["job"].encode())
    elif kind == "answer":
        state.answer(entry["row"])
    elif kind == "positions":
        state.positions.update(entry["pos"])


class Journal:
    """Append-only; each `write` is one `write(2)` of whole lines, flushed to the OS at once (a
    SIGKILLed process loses nothing the kernel has; a machine crash may lose the last lines,
    which a restart then re-posts or re-reads)."""

    def __init__(self, out: Path) -> None:
        self.path = journal_path(out)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, entries: Iterable[dict[str, Any]]) -> None:
        data = b"".join(json.dumps(e, separators=(",", ":")).encode() + b"\n" for e in entries)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        os.close(self._fd)


def output_format(out: Path, given: str | None) -> str:
    if given:
        return given
    if out.suffix.lower() in PARQUET_SUFFIXES:
        return "parquet"
    if out.suffix.lower() in (".jsonl", ".ndjson"):
        return "jsonl"
    raise ConfigError(f"--out {out}: name it .parquet or .jsonl, or say which with --format")


def read_output(out: Path) -> Iterator[dict[str, Any]]:
    if out.suffix.lower() in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(out).iter_batches(batch_size=4096):
            yield from batch.to_pylist()
        return
    with out.open("rb") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def merged_rows(out: Path) -> Iterator[dict[str, Any]]:
    """The earlier output's rows, then the journal's answers, each job id once (first wins)."""
    seen: set[str] = set()
    sources: list[Iterable[dict[str, Any]]] = []
    if out.exists():
        sources.append(read_output(out))
    path = journal_path(out)
    if path.exists():
        sources.append(_journal_answers(path))
    for source in sources:
        for row in source:
            if row["job_id"] not in seen:
                seen.add(row["job_id"])
                yield row


def _journal_answers(path: Path) -> Iterator[dict[str, Any]]:
    with path.open("rb") as f:
        for line in f:
            if line.endswith(b"\n"):
                entry = json.loads(line)
                if entry["t"] == "answer":
                    yield entry["row"]


def write_output(out: Path, fmt: str) -> int:
    """Rewrite the output from itself and the journal (atomically: a kill mid-write leaves the
    old output and the journal), then drop the journal. Returns the rows written."""
    tmp = out.with_name(f".{out.name}.tmp")
    written = 0
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([(name, getattr(pa, kind)()) for name, kind in OUTPUT_COLUMNS])
        with pq.ParquetWriter(tmp, schema) as writer:
            for chunk in _chunks(merged_rows(out), 8192):
                writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
                written += len(chunk)
    else:
        with tmp.open("w", encoding="utf-8") as f:
            for row in merged_rows(out):
                f.write(json.dumps({name: row.get(name) for name, _ in OUTPUT_COLUMNS}) + "\n")
                written += 1
    os.replace(tmp, out)
    with contextlib.suppress(FileNotFoundError):
        journal_path(out).unlink()
    return written


def _chunks(rows: Iterable[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def repost_due(posted: dict[str, tuple[float, bytes]], now: float, grace_s: float) -> list[str]:
    """Jobs an earlier run posted that still have no answer once the collector has caught up,
    and were posted at least `grace_s` ago: the ones younger than that may still be on their
    way through a worker, and re-posting them would only make duplicates."""
    return [job_id for job_id, (at, _) in posted.items() if now - at >= grace_s]


# --- the run ------------------------------------------------------------------------------------


@dataclass
class Tally:
    """Counts for the progress bar and the summary."""

    total: int | None
    posted: int = 0  # this run, re-posts included
    reposted: int = 0
    answered: int = 0  # this run
    duplicates: int = 0  # answers dropped: that job id was answered already
    duplicate_rows: int = 0  # manifest rows whose job id an earlier row already has
    outcomes: Counter[str] = field(default_factory=Counter)


def backfill(args: argparse.Namespace, cfg: WorkerConfig) -> int:
    """0: every row answered with a caption; 1: every row has an outcome and some failed (a
    retry manifest lists them); 130: interrupted, at any point (run the same command to
    resume: the journal has everything up to the signal)."""
    try:
        return _backfill(args, cfg)
    except Interrupted as exc:
        print(f"mmworker backfill: {exc}: stopped; run the same command to resume", file=sys.stderr)
        return ExitCode.INTERRUPTED


def _backfill(args: argparse.Namespace, cfg: WorkerConfig) -> int:
    from kafka import KafkaProducer
    from tqdm import tqdm

    out = Path(args.out)
    fmt = output_format(out, args.format)
    spec = str(args.manifest)
    name = args.name or _default_name(spec)
    cols = Columns(
        uri=args.uri_column, key=args.key_column, prompt=args.prompt_column,
        options=args.options_column,
        metadata=tuple(c for item in args.metadata_columns for c in item.split(",") if c),
    )  # fmt: skip
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                "top_p": args.top_p, "seed": args.seed}  # fmt: skip
    defaults = Defaults(
        prompt=args.prompt, task=args.task,
        generation={k: v for k, v in sampling.items() if v is not None},
    )  # fmt: skip
    base = Path(spec).parent if manifest_kind(spec) not in ("dir", "glob") else Path.cwd()
    out.parent.mkdir(parents=True, exist_ok=True)
    state = load_state(out)
    tally = Tally(total=count_rows(spec))
    collector = Collector(cfg, [cfg.kafka.output_topic, cfg.kafka.dead_letter_topic], name, state)
    journal = Journal(out)
    producer = KafkaProducer(
        acks="all", linger_ms=20, max_block_ms=cfg.kafka.max_block_ms,
        max_request_size=cfg.kafka.max_request_size, **cfg.kafka.client_kwargs(),
    )  # fmt: skip
    topic = args.topic or cfg.kafka.backfill_topic or cfg.kafka.input_topic
    poster = Poster(producer, topic, journal, state)
    started = time.monotonic()
    bar = tqdm(total=tally.total, unit="row", desc=f"backfill {name}", file=sys.stderr,
               initial=len(state.outcomes), smoothing=0.1)  # fmt: skip
    plans = (plan(row, name, cols, defaults, base) for row in read_manifest(spec))
    try:
        _pump(plans, state, tally, collector, poster, args.window, args.grace, bar)
    finally:
        bar.close()
        journal.close()
        collector.close()
        close_producer(producer)
    written = write_output(out, fmt)
    failed = {job_id for job_id, outcome in state.outcomes.items() if outcome != "ok"}
    retry = _write_retry_manifest(out, spec, name, cols, defaults, base, failed)
    _summary(name, out, written, retry, tally, state, time.monotonic() - started)
    return 1 if failed else 0


def close_producer(producer: Any) -> None:
    """Close, and let a flush that times out go: it must not replace the signal being handled.

    A signal's `Interrupted` can be raised inside kafka-python's `send` (one CI run: while it
    registered a record's future), which leaves a batch that never completes, so the flush in
    `close` times out. Nothing is lost by giving up on it: a batch is journaled as posted only
    once the broker has acknowledged it, so the unsent one is posted again on resume."""
    from kafka.errors import KafkaTimeoutError

    try:
        producer.close(timeout=5)
    except KafkaTimeoutError as exc:
        print(
            f"mmworker backfill: closed the producer with unacknowledged records ({exc}); "
            "they were not journaled and are posted again on resume",
            file=sys.stderr,
        )


def _pump(
    plans: Iterator[Planned], state: State, tally: Tally, collector: Collector, poster: Poster,
    window: int, grace_s: float, bar: Any,
) -> None:  # fmt: skip
    """Post while the window has room, collect answers, until every row has its answer. Jobs
    an earlier run left unanswered hold their places in the window; once the collector has
    caught up, those past the grace period are posted again."""
    stale = set(state.posted)
    seen: set[str] = set()
    exhausted = False
    collector.catch_up(poster.journal, tally)
    while True:
        stale &= state.posted.keys()
        due = repost_due({k: state.posted[k] for k in stale}, time.time(), grace_s)
        stale.difference_update(due)
        batch = [(job_id, state.posted[job_id][1]) for job_id in due]
        tally.reposted += len(due)
        room = window - len(state.posted)  # re-posts hold their places already
        while not exhausted and room > 0:
            planned = _next_job(plans, state, seen, poster.journal, tally)
            if planned is None:
                exhausted = True
            elif planned.job is not None:
                batch.append((planned.job_id, planned.job.model_dump_json(exclude_defaults=True)
                              .encode()))  # fmt: skip
                room -= 1
        poster.post(batch)
        tally.posted += len(batch)
        if exhausted and not state.posted:
            break
        collector.poll(poster.journal, tally, timeout_ms=200)
        _show(bar, tally, state)
    _show(bar, tally, state)


def _next_job(
    plans: Iterator[Planned], state: State, seen: set[str], journal: Journal, tally: Tally
) -> Planned | None:
    """The next row that needs posting; rows that are answered, already posted, duplicates of
    an earlier row, or not jobs at all (journaled as failures at once) are passed over."""
    for planned in plans:
        if planned.job_id in seen:
            tally.duplicate_rows += 1
            continue
        seen.add(planned.job_id)
        if planned.job_id in state.outcomes or planned.job_id in state.posted:
            continue
        if planned.job is None:
            failure = local_failure(planned)
            journal.write([{"t": "answer", "row": failure}])
            state.answer(failure)
            tally.outcomes[INVALID_ROW] += 1
            continue
        return planned
    return None


@dataclass
class Poster:
    """Posts batches of jobs; the journal follows what the broker has acknowledged."""

    producer: Any
    topic: str
    journal: Journal
    state: State

    def post(self, batch: list[tuple[str, bytes]]) -> None:
        """Send, wait for the broker's acknowledgement, then journal: a job is journaled as
        posted only once it is in the topic (a kill in between re-posts it: a duplicate, never
        a loss)."""
        if not batch:
            return
        from mmworker.kafka_io import post_acknowledged

        now = time.time()
        post_acknowledged(
            self.producer,
            self.topic,
            [(job_id.encode(), value, []) for job_id, value in batch],
            "create it (the worker does with --create-topics N), or name another with --topic",
        )
        self.journal.write(
            {"t": "posted", "id": job_id, "at": now, "job": value.decode()}
            for job_id, value in batch
        )
        for job_id, value in batch:
            self.state.posted[job_id] = (now, value)


def _show(bar: Any, tally: Tally, state: State) -> None:
    failed = sum(n for code, n in tally.outcomes.items() if code != "ok")
    bar.n = len(state.outcomes) + tally.duplicate_rows
    bar.set_postfix(
        posted=tally.posted, answered=tally.answered, failed=failed, outstanding=len(state.posted),
        refresh=False,
    )  # fmt: skip
    bar.refresh()


def _default_name(spec: str) -> str:
    """The manifest's name: the same on every re-run of the same command."""
    stem = Path(spec.rstrip("/")).stem if not glob.has_magic(spec) else "glob-" + hashlib.sha256(
        spec.encode()
    ).hexdigest()[:8]  # fmt: skip
    return stem or "backfill"


def _write_retry_manifest(
    out: Path, spec: str, name: str, cols: Columns, defaults: Defaults, base: Path,
    failed: set[str],
) -> Path | None:  # fmt: skip
    """The failed rows as a JSONL manifest with the original columns, in manifest order: run
    it with the same column flags (and a new --out) once the cause is fixed."""
    path = out.with_name(out.stem + ".retry.jsonl")
    if not failed:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return None
    with path.open("w", encoding="utf-8") as f:
        for row in read_manifest(spec):
            if plan(row, name, cols, defaults, base).job_id in failed:
                f.write(json.dumps(row.fields, default=str) + "\n")
    return path


def _summary(
    name: str, out: Path, written: int, retry: Path | None, tally: Tally, state: State,
    elapsed: float,
) -> None:  # fmt: skip
    outcomes = Counter(state.outcomes.values())
    ok = outcomes.pop("ok", 0)
    failed = ", ".join(f"{code} {n}" for code, n in sorted(outcomes.items()))
    lines = [
        f"backfill {name}: {written} rows in {out}: {ok} ok, {sum(outcomes.values())} failed"
        + (f" ({failed})" if failed else ""),
        f"this run: {tally.posted} posted ({tally.reposted} re-posted), {tally.answered} "
        f"answered in {elapsed:.1f}s ({tally.answered / max(elapsed, 1e-9):.1f} rows/s); "
        f"{tally.duplicates} duplicate answers dropped; {tally.duplicate_rows} manifest rows "
        "had the job id of an earlier row (the same key, or the same URI, prompt and options)",
    ]
    if retry is not None:
        lines.append(f"retry manifest of the failed rows: {retry}")
    print("\n".join(lines), file=sys.stderr)


# --- the collector ------------------------------------------------------------------------------


class Collector:
    """Reads the output and dead-letter topics from the journaled positions (from their ends
    on a first run: nothing of ours can be there yet). It reads by assignment, not as a group
    member, because its positions are kept in the journal beside the answers (see the module
    doc); no other consumer group is touched."""

    def __init__(self, cfg: WorkerConfig, topics: list[str], name: str, state: State) -> None:
        from kafka import KafkaConsumer
        from kafka.structs import TopicPartition

        self._prefix = f"{name}/"
        self._state = state
        self._consumer = KafkaConsumer(
            group_id=None, enable_auto_commit=False, auto_offset_reset="earliest",
            fetch_max_bytes=cfg.kafka.fetch_max_bytes,
            max_partition_fetch_bytes=cfg.kafka.max_partition_fetch_bytes,
            **cfg.kafka.client_kwargs(),
        )  # fmt: skip
        parts: list[Any] = []
        for topic in topics:
            found = self._consumer.partitions_for_topic(topic)
            if not found:
                self._consumer.close()
                raise ConfigError(
                    f"no topic {topic!r} on the brokers: a worker creates its topics with "
                    "--create-topics N; the backfill reads answers there"
                )
            parts += [TopicPartition(topic, p) for p in sorted(found)]
        self._consumer.assign(parts)
        self._ends = self._consumer.end_offsets(parts)
        for tp in parts:
            known = state.positions.get(f"{tp.topic}:{tp.partition}")
            self._consumer.seek(tp, known if known is not None else self._ends[tp])

    def catch_up(self, journal: Journal, tally: Tally) -> None:
        """Read what arrived while no backfill was running, before anything is re-posted."""
        # Past the end offsets and one empty poll: the Tansu broker reports the end as its last
        # batch's first offset + 1, so the end offsets alone can stop short.
        while self.poll(journal, tally, timeout_ms=500) or any(
            self._consumer.position(tp) < end for tp, end in self._ends.items()
        ):
            pass

    def poll(self, journal: Journal, tally: Tally, timeout_ms: int) -> int:
        """Journal the answers that arrived, then the positions after them; returns how many
        records were read (ours or not)."""
        entries: list[dict[str, Any]] = []
        read = 0
        for records in self._consumer.poll(timeout_ms=timeout_ms, max_records=2048).values():
            read += len(records)
            for record in records:
                row = self._ours(record.value)
                if row is None:
                    continue
                if self._state.answer(row):
                    entries.append({"t": "answer", "row": row})
                    tally.answered += 1
                    tally.outcomes["ok" if row["outcome"] == "ok" else str(row["code"])] += 1
                else:
                    tally.duplicates += 1
        positions = {
            f"{tp.topic}:{tp.partition}": self._consumer.position(tp)
            for tp in self._consumer.assignment()
        }
        if entries or positions != self._state.positions:
            self._state.positions = positions
            journal.write([*entries, {"t": "positions", "pos": positions}])
        return read

    def _ours(self, value: bytes | None) -> dict[str, Any] | None:
        if not value:
            return None
        try:
            doc = json.loads(value)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None  # not a worker's record: someone else's business
        if not isinstance(doc, dict) or not str(doc.get("job_id") or "").startswith(self._prefix):
            return None
        return output_row(doc)

    def close(self) -> None:
        self._consumer.close()
