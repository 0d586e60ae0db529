"""`mmworker backfill MANIFEST --out RESULTS`: caption every row of a manifest, resumably.

`submit` posts and forgets; a backfill of a million files needs more: ids that stay the same
across re-runs (so results join back to rows, and a re-run asks nothing twice), a bound on what
sits in the topic at once (so live jobs are not queued behind a million rows), a collector that
turns answers into one output row per manifest row, and a way back in after any crash.

The state that makes a restart safe is one append-only file beside the output, the *journal*
(`RESULTS.journal`): a line per posted job (with its payload, so it can be re-posted without the
manifest), a line per answer, and the collector's topic positions written after the answers
they cover. Answers and positions live in one file, so a SIGKILL can never leave positions ahead
of the answers they stand for (a Kafka commit and a local file cannot be written together).

An answer stands for a row only while the row asks the same thing: each job carries a
fingerprint of its question (media, prompt, task, options), and an answer counts under its job
id and fingerprint. So a re-run with other options, an edited manifest or a late answer to an
old question can never give a row two outputs or the wrong one (issue #35). At the end the
output is written from the manifest, in its order, one row per job, with the retry manifest of
its failed rows in the same pass, and the journal is removed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import glob
import hashlib
import json
import logging
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from mmworker_schemas import GenerationParams, Job, MediaRef
from mmworker_schemas.job import JOB_ID_MAX_LENGTH
from pydantic import ValidationError

from mmworker.config import WorkerConfig
from mmworker.errors import ConfigError, WorkerError
from mmworker.exits import ExitCode, check_interrupted, signal_behind

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
    ("job_id", "string"), ("row", "string"), ("row_number", "int64"), ("source", "string"),
    ("outcome", "string"),
    ("caption", "string"), ("json", "string"), ("task", "string"), ("finish_reason", "string"),
    ("model", "string"), ("model_revision", "string"), ("prompt_tokens", "int64"),
    ("visual_tokens", "int64"), ("output_tokens", "int64"), ("queue_wait_s", "float64"),
    ("fetch_s", "float64"), ("preprocess_s", "float64"), ("engine_s", "float64"),
    ("total_s", "float64"), ("code", "string"), ("message", "string"), ("retryable", "bool_"),
    ("attempts", "int64"), ("worker_id", "string"), ("metadata", "string"),
    ("answered_at", "string"), ("fingerprint", "string"),
)  # fmt: skip
#: A JSONL manifest's columns are the keys of its rows: the check reads this many of them.
COLUMN_SAMPLE_ROWS = 1000


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


#: Bytes a posted job's record takes beyond its JSON: key, headers, batch framing.
RECORD_OVERHEAD = 1024
#: Longest CSV field read: a row's prompt or options, not a file's worth of text.
MAX_CSV_FIELD = 16 * 1024 * 1024
#: The first (and last) four bytes of every Parquet file.
PARQUET_MAGIC = b"PAR1"


def manifest_kind(spec: str) -> str:
    """'dir', 'glob', 'jsonl', 'csv' or 'parquet', from what `spec` names."""
    path = Path(spec)
    if path.is_dir():
        return "dir"
    if glob.has_magic(spec) and not path.is_file():  # "batch[2024].jsonl" is a file's name
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
        return int(_parquet_file(spec).metadata.num_rows)
    if kind == "jsonl":
        with open(spec, "rb") as f:
            return sum(1 for line in f if line.strip())
    if kind == "csv":
        return sum(1 for _ in _csv_rows(Path(spec)))
    return None


def columns_from(args: argparse.Namespace) -> Columns:
    """The column flags of `mmworker backfill`."""
    return Columns(
        uri=args.uri_column, key=args.key_column, prompt=args.prompt_column,
        options=args.options_column,
        metadata=tuple(c for item in args.metadata_columns for c in item.split(",") if c),
    )  # fmt: skip


def check_columns(spec: str, cols: Columns) -> None:
    """Every column the options name is in the manifest, or one line says which is not.

    Why before anything is posted: a misspelt `--uri-column` otherwise turns every row into an
    `invalid_schema` failure, one by one, and a misspelt key or options column silently gives
    other job ids or other jobs. A CSV header and a Parquet schema list the columns; a JSONL
    manifest's are the keys its rows use (of its first `COLUMN_SAMPLE_ROWS` rows), and a
    directory or glob has just `uri`."""
    named = [
        ("--uri-column", cols.uri), ("--key-column", cols.key),
        ("--prompt-column", cols.prompt), ("--options-column", cols.options),
        *(("--metadata-columns", c) for c in cols.metadata),
    ]  # fmt: skip
    found, where = _manifest_columns(spec)
    if found is None:
        return  # no rows at all: nothing to check, nothing will be posted
    missing = [(flag, c) for flag, c in named if c is not None and c not in found]
    if missing:
        what = ", ".join(f"{c!r} ({flag})" for flag, c in missing)
        raise ManifestError(
            f"manifest {spec} has no column {what}; its columns{where}: "
            f"{', '.join(found) or 'none'}"
        )


def _manifest_columns(spec: str) -> tuple[list[str] | None, str]:
    """The manifest's column names (None for a manifest without rows) and where they come
    from, for the message."""
    kind = manifest_kind(spec)
    if kind == "glob" and not any(Path(p).is_file() for p in glob.iglob(spec, recursive=True)):
        # a mistyped pattern was an empty backfill that ended "ok" with exit 0
        raise ManifestError(f"manifest {spec}: the glob matches no file")
    if kind in ("dir", "glob"):
        return ["uri"], " (a directory or glob gives one)"
    if kind == "parquet":
        return list(_parquet_file(spec).schema_arrow.names), ""
    if kind == "csv":
        return _csv_header(Path(spec)), ""
    names: dict[str, None] = {}
    rows = 0
    for rows, doc in enumerate(_jsonl_rows(Path(spec)), 1):
        names.update(dict.fromkeys(doc))
        if rows == COLUMN_SAMPLE_ROWS:
            break
    return (list(names) if rows else None), f" (the keys of its first {rows:,} rows)"


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
    with _csv_reader(path, csv.DictReader) as rows:
        yield from rows


def _csv_header(path: Path) -> list[str] | None:
    with _csv_reader(path, csv.reader) as rows:
        return next(rows, None)


@contextlib.contextmanager
def _csv_reader(path: Path, kind: Callable[..., Any]) -> Iterator[Any]:
    """A reader of a CSV or TSV manifest: UTF-8, with or without the byte-order mark that
    spreadsheets write ("CSV UTF-8", whose first column was read as "\ufeffuri"); a file in
    another encoding is the manifest's error (one line), not a traceback mid-run."""
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    # A field may be as long as a row may be (a prompt, options); the default is 128 KiB.
    csv.field_size_limit(max(csv.field_size_limit(), MAX_CSV_FIELD))
    with path.open(newline="", encoding="utf-8-sig") as f:
        # strict: a quote left open read the rest of the file into one field, rows silently lost
        reader = kind(f, delimiter=delimiter, strict=True)
        try:
            yield reader
        except UnicodeDecodeError as exc:
            raise ManifestError(
                f"manifest {path}: not UTF-8 ({exc.reason} at byte {exc.start} of a read); "
                "save it as UTF-8"
            ) from None
        except csv.Error as exc:
            raise ManifestError(
                f"manifest {path}: line {reader.line_num}: {exc} (a quote left open?)"
            ) from None


def _parquet_file(path: Path | str) -> Any:
    """The manifest's ParquetFile; a file that is not Parquet, or a damaged one, is the
    manifest's error (one line), not pyarrow's traceback."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ManifestError(f"manifest {path}: not a readable Parquet file ({exc})") from None


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    for batch in _parquet_file(path).iter_batches(batch_size=4096):
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
    index: int  # the row's 0-based position in the manifest
    source: str
    metadata: dict[str, Any]
    job: Job | None = None
    problem: str | None = None
    #: What the row asks (media, prompt, task, options), hashed; it travels in the job's
    #: metadata and comes back with the answer, so an answer is used only for the very question
    #: the row asks now (a re-run with other options, under the same key, asks again).
    fingerprint: str | None = None


def job_id_for(name: str, key: str | None, identity: dict[str, Any]) -> str:
    """`name/key` when the manifest has a key column; else `name/` and a hash of the URI, the
    prompt and the options, so an edited row is a new job and a re-run of the same rows is not.
    Keys that could not travel as a job id (too long, control characters) are hashed too."""
    if key is not None:
        job_id = f"{name}/{key}"
        if len(job_id) <= JOB_ID_MAX_LENGTH and not any(ord(c) < 0x20 for c in job_id):
            return job_id
        identity = {"key": key}
    return f"{name}/{_digest(identity)[:32]}"


def plan(
    row: Row, name: str, cols: Columns, defaults: Defaults, base: Path,
    max_bytes: int | None = None,
) -> Planned:  # fmt: skip
    """The job for one row. Relative paths are read from `base` (the manifest's directory), so
    the ids and URIs do not depend on where the command was started. `max_bytes`: the most a
    posted job may take (the producer's `kafka.max_request_size`); a job over it is the row's
    failure, not a refusal that stopped the whole backfill, and again at every re-run."""
    fields = row.fields
    raw_key = fields.get(cols.key) if cols.key else None
    # NaN: a gap in a float column written by pandas; as a key ("nan") every such row was one
    missing = raw_key in (None, "") or (isinstance(raw_key, float) and math.isnan(raw_key))
    given_key = None if missing else str(raw_key)
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
        return Planned(job_id, key, row.index, source, metadata, problem=str(exc))
    identity = {"uri": uri, **params}
    job_id = job_id_for(name, given_key, identity)
    fingerprint = _digest(identity)[:16]
    try:
        job = Job(job_id=job_id, media=[MediaRef(uri=uri)],
                  metadata={**metadata, "fingerprint": fingerprint}, **params)  # fmt: skip
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'job'}: {e['msg']}"
            for e in exc.errors(include_url=False)[:5]
        )
        return Planned(job_id, key, row.index, source, metadata, problem=problems)
    if max_bytes is not None:
        size = len(job.model_dump_json(exclude_defaults=True).encode()) + RECORD_OVERHEAD
        if size > max_bytes:
            problem = (
                f"the job is {size} bytes with its record's overhead, over "
                f"kafka.max_request_size ({max_bytes}): shorten its options or prompt"
            )
            return Planned(job_id, key, row.index, source, metadata, problem=problem)
    return Planned(job_id, key, row.index, source, metadata, job, fingerprint=fingerprint)


def _digest(identity: dict[str, Any]) -> str:
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


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
        fingerprint=_str(meta.get("fingerprint")),
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
        job_id=p.job_id, row=p.key, row_number=p.index, source=p.source, outcome="failed",
        code=INVALID_ROW,
        message=p.problem, retryable=False, attempts=0,
        metadata=json.dumps(p.metadata.get("columns") or {}, sort_keys=True),
    )  # fmt: skip
    return row


def _str(value: object) -> str | None:
    return None if value is None else str(value)


# --- the journal and the output -----------------------------------------------------------------

#: What `State.answer` made of an answer.
NEW, DUPLICATE, STALE = "new", "duplicate", "stale"


class Sent(NamedTuple):
    """A job posted and not yet answered: when, its payload (to post it again), what it asks."""

    at: float
    payload: bytes
    fingerprint: str | None


def answer_key(job_id: str, fingerprint: str | None) -> str:
    """An answer stands for one job id asking one thing: both are its key."""
    return f"{job_id}\0{fingerprint or ''}"


@dataclass
class State:
    """What the output and the journal say: the answers (by job id and fingerprint), the jobs
    posted and not yet answered, and the collector's positions."""

    outcomes: dict[str, str] = field(default_factory=dict)  # answer key -> "ok" or a code
    posted: dict[str, Sent] = field(default_factory=dict)  # job id -> what was posted
    positions: dict[str, int] = field(default_factory=dict)  # "topic:partition" -> next offset

    def answer(self, row: dict[str, Any]) -> str:
        """Record an answer: NEW; DUPLICATE (at-least-once, or a job posted twice); STALE, the
        answer to what an earlier run asked under this job id before the row changed (its
        fingerprint is not the one posted now), which must not stand for the new question."""
        job_id, fingerprint = row["job_id"], row.get("fingerprint")
        sent = self.posted.get(job_id)
        if sent is not None:
            if fingerprint is None:  # a failure that lost the job's metadata: it is the posted
                row["fingerprint"] = fingerprint = sent.fingerprint
            if fingerprint != sent.fingerprint:
                return STALE
            del self.posted[job_id]
        key = answer_key(job_id, fingerprint)
        if key in self.outcomes:
            return DUPLICATE
        self.outcomes[key] = "ok" if row["outcome"] == "ok" else str(row["code"])
        return NEW

    def outcome(self, planned: Planned) -> str | None:
        """The answer to what the row asks now; or, for an output written before answers had
        fingerprints (no such column), the answer its job id has."""
        found = self.outcomes.get(answer_key(planned.job_id, planned.fingerprint))
        return found if found is not None else self.outcomes.get(answer_key(planned.job_id, None))


def journal_path(out: Path) -> Path:
    return out.with_name(out.name + ".journal")


def load_state(out: Path) -> State:
    """The output of an earlier run (rows already answered) merged with the journal of an
    interrupted one. A last line cut by a SIGKILL mid-write is dropped (and cut off the file
    before anything is appended, so the next line does not run on from it)."""
    state = State()
    if out.exists():
        for row in read_output(out):
            if row.get("code") != INVALID_ROW:  # re-checked on every run, never kept
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


def check_journal_name(out: Path, state: State, name: str) -> None:
    """An interrupted run's journal resumes under its own name only. Its posted jobs fill the
    window, and the answers to them, named for the other backfill, are not this one's: under
    another `--name` (or a renamed manifest) the resume posted nothing and waited for ever."""
    other = next((job_id for job_id in state.posted if not job_id.startswith(f"{name}/")), None)
    if other is not None:
        raise ConfigError(
            f"--out {out}: its journal ({journal_path(out).name}) is of another backfill than "
            f"{name!r} (it posted job {other!r}): resume it with the --name that started it, "
            "or remove the journal to start over"
        )


def _apply(state: State, entry: dict[str, Any]) -> None:
    kind = entry["t"]
    if kind == "posted":
        fingerprint = entry.get("fp")
        if answer_key(entry["id"], fingerprint) not in state.outcomes:
            state.posted[entry["id"]] = Sent(entry["at"], entry["job"].encode(), fingerprint)
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


def written_format(out: Path) -> str:
    """The format an existing output is in, from its bytes: `--format` may have overridden its
    name's suffix (`--out res.out --format parquet`), and a re-run or a replay must read, and
    rewrite, what was written."""
    with out.open("rb") as f:
        return "parquet" if f.read(4) == PARQUET_MAGIC else "jsonl"


def read_output(out: Path) -> Iterator[dict[str, Any]]:
    """The rows of an earlier output. A file that is none (`--out` naming the manifest, another
    tool's JSONL, a directory, a damaged Parquet file) is a one-line error: it raised KeyError or
    pyarrow's error mid-run, and the file would be overwritten at the end."""
    n = 0
    try:
        for n, row in enumerate(_output_rows(out), 1):
            if not _is_output_row(row):
                raise ConfigError(
                    f"--out {out}: row {n} is not a row of a backfill's output (no job_id, or "
                    "no outcome ok / failed with a code): name another file (this one is "
                    "rewritten at the end)"
                )
            yield row
    except (OSError, ValueError) as exc:  # ValueError: not JSON, pyarrow's ArrowInvalid
        raise ConfigError(
            f"--out {out}: not a backfill's output ({type(exc).__name__}: {exc} near row "
            f"{n + 1}): name another file (this one is rewritten at the end)"
        ) from None


def _is_output_row(row: object) -> bool:
    """What the readers use of a row. A job_id alone let another tool's JSONL through (`tail
    --json` writes results with job ids), and the run ended in a KeyError."""
    if not isinstance(row, dict) or not isinstance(row.get("job_id"), str):
        return False
    outcome = row.get("outcome")
    return outcome == "ok" or (outcome == "failed" and "code" in row)


def _output_rows(out: Path) -> Iterator[Any]:
    if written_format(out) == "parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(out).iter_batches(batch_size=4096):
            yield from batch.to_pylist()
        return
    with out.open("rb") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _journal_answers(path: Path) -> Iterator[dict[str, Any]]:
    with path.open("rb") as f:
        for line in f:
            if line.endswith(b"\n"):
                entry = json.loads(line)
                if entry["t"] == "answer":
                    yield entry["row"]


class RowMissing(WorkerError):
    """The final pass found a manifest row without an answer: the output is not written (the
    journal stays, so the same command carries on)."""


@dataclass
class Written:
    """What the final pass wrote: the counts the summary gives come from here, so they agree
    with the output and the retry manifest by construction."""

    rows: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    retry: Path | None = None
    unused: int = 0  # answers of earlier runs that no manifest row asks for now


def write_results(
    out: Path, fmt: str, rows: Iterable[tuple[Row, Planned]], retry_path: Path
) -> Written:
    """Rewrite the output from the manifest, in its order, one row per job (a row whose job id
    an earlier row has is that row's), with the answer to what each row asks now; write the
    failed rows' original fields as the retry manifest in the same pass; then drop the journal.

    Answers are looked up in an index on disk (the earlier output, then the journal: a later
    answer replaces an earlier one), so a million rows are not held in memory. A kill before
    the final rename leaves the old output and the journal as they were."""
    index = _AnswerIndex(out.with_name(f".{out.name}.index"))
    try:
        if out.exists():
            index.add(r for r in read_output(out) if r.get("code") != INVALID_ROW)
        if journal_path(out).exists():
            index.add(_journal_answers(journal_path(out)))
        written = _write_in_order(out, fmt, rows, retry_path, index)
        written.unused = index.size() - index.used
    finally:
        index.close()
    with contextlib.suppress(FileNotFoundError):
        journal_path(out).unlink()
    return written


def _write_in_order(
    out: Path, fmt: str, rows: Iterable[tuple[Row, Planned]], retry_path: Path,
    index: _AnswerIndex,
) -> Written:  # fmt: skip
    tmp = out.with_name(f".{out.name}.tmp")
    retry_tmp = retry_path.with_name(f".{retry_path.name}.tmp")
    try:
        return _write_files(out, fmt, rows, retry_path, index, tmp, retry_tmp)
    finally:
        tmp.unlink(missing_ok=True)
        retry_tmp.unlink(missing_ok=True)


def _write_files(
    out: Path, fmt: str, rows: Iterable[tuple[Row, Planned]], retry_path: Path,
    index: _AnswerIndex, tmp: Path, retry_tmp: Path,
) -> Written:  # fmt: skip
    written = Written()
    emitted: set[str] = set()

    def ordered() -> Iterator[dict[str, Any]]:
        with retry_tmp.open("w", encoding="utf-8") as retry:
            for row, planned in rows:
                if planned.job_id in emitted:
                    continue  # the job of an earlier row (the same key, or the same question)
                emitted.add(planned.job_id)
                result = _result_for(planned, index)
                written.rows += 1
                written.outcomes["ok" if result["outcome"] == "ok" else str(result["code"])] += 1
                if result["outcome"] != "ok":
                    retry.write(json.dumps(row.fields, default=str) + "\n")
                yield result

    write_rows(tmp, fmt, ordered())
    failed = written.rows - written.outcomes["ok"]
    if failed:
        replace_durably(retry_tmp, retry_path)
        written.retry = retry_path
    else:
        retry_tmp.unlink()
        with contextlib.suppress(FileNotFoundError):
            retry_path.unlink()
    replace_durably(tmp, out)
    return written


def replace_durably(tmp: Path, dest: Path) -> None:
    """`os.replace`, with the new file's bytes, then the rename, on disk first. The journal
    that could redo the output is dropped right after: a reboot then (the file system not yet
    flushed) left an empty or cut output, and nothing to write it again from."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, dest)
    fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def with_absolute_media(row: Row, planned: Planned, uri_column: str, base: Path) -> Row:
    """The row as a retry manifest holds it: a relative media path made the absolute URI the
    job used (`base`: the manifest's directory). Relative paths are read from a manifest's own
    directory, and the retry manifest sits beside the output: its rows pointed at other files,
    or none. Rows that never became a job (bad options, too large) too: their fix is an edit
    of the retry manifest."""
    relative = planned.source and not planned.source.startswith(_URL_PREFIXES)
    if not relative:
        return row
    if planned.job is not None and planned.job.media[0].uri:
        uri = planned.job.media[0].uri
    else:
        try:
            uri = _uri(planned.source, uri_column, base)
        except ValueError:  # no path at all (a NUL byte): the row stays as it was written
            return row
    return replace(row, fields={**row.fields, uri_column: uri})


def write_rows(path: Path, fmt: str, rows: Iterable[dict[str, Any]]) -> None:
    """Output rows as Parquet or JSONL, with the output's columns in their order."""
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([(name, getattr(pa, kind)()) for name, kind in OUTPUT_COLUMNS])
        with pq.ParquetWriter(path, schema) as writer:
            for chunk in _chunks(rows, 8192):
                writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
    else:
        with path.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({name: row.get(name) for name, _ in OUTPUT_COLUMNS}) + "\n")


def _result_for(planned: Planned, index: _AnswerIndex) -> dict[str, Any]:
    """The output row of one manifest row: its answer, under the row's own key, number, source
    and metadata columns as the manifest has them now."""
    if planned.problem is not None:
        return local_failure(planned)
    found = index.get(answer_key(planned.job_id, planned.fingerprint))
    if found is None:  # an output from before answers had fingerprints (State.outcome)
        found = index.get(answer_key(planned.job_id, None))
    if found is None:
        raise RowMissing(
            f"manifest row {planned.index} ({planned.job_id}) has no answer: the output was not "
            "written; run the same command again"
        )
    found.update(
        row=planned.key, row_number=planned.index, source=planned.source,
        metadata=json.dumps(planned.metadata.get("columns") or {}, sort_keys=True),
    )  # fmt: skip
    return found


class _AnswerIndex:
    """Answers by answer key in a scratch SQLite file beside the output."""

    def __init__(self, path: Path) -> None:
        import sqlite3

        self.path = path
        path.unlink(missing_ok=True)
        self._db = sqlite3.connect(path)
        self._db.execute("PRAGMA journal_mode=OFF")
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.execute("CREATE TABLE answers (k TEXT PRIMARY KEY, row TEXT)")
        self.used = 0

    def add(self, rows: Iterable[dict[str, Any]]) -> None:
        self._db.executemany(
            "INSERT OR REPLACE INTO answers VALUES (?, ?)",
            ((answer_key(r["job_id"], r.get("fingerprint")), json.dumps(r)) for r in rows),
        )

    def get(self, key: str) -> dict[str, Any] | None:
        found = self._db.execute("SELECT row FROM answers WHERE k = ?", (key,)).fetchone()
        if found is None:
            return None
        self.used += 1
        row: dict[str, Any] = json.loads(found[0])
        return row

    def size(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM answers").fetchone()[0])

    def close(self) -> None:
        self._db.close()
        self.path.unlink(missing_ok=True)


def _chunks(rows: Iterable[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def repost_due(posted: dict[str, Sent], now: float, grace_s: float) -> list[str]:
    """Jobs an earlier run posted that still have no answer once the collector has caught up,
    and were posted at least `grace_s` ago: the ones younger than that may still be on their
    way through a worker, and re-posting them would only make duplicates."""
    return [job_id for job_id, sent in posted.items() if now - sent.at >= grace_s]


# --- the run ------------------------------------------------------------------------------------


@dataclass
class Tally:
    """Counts for the progress line and the summary."""

    total: int | None
    done: int = 0  # manifest rows of this manifest whose outcome is known
    posted: int = 0  # this run, re-posts included
    reposted: int = 0
    answered: int = 0  # this run
    duplicates: int = 0  # answers dropped: that job id was answered already
    stale: int = 0  # answers to what a row asked before it changed, dropped
    duplicate_rows: int = 0  # manifest rows whose job id an earlier row already has
    outcomes: Counter[str] = field(default_factory=Counter)  # this run's, invalid rows included
    #: Jobs of rows passed by the planner that still wait for their answer.
    awaiting: set[str] = field(default_factory=set)


def backfill(args: argparse.Namespace, cfg: WorkerConfig) -> int:
    """0: every row answered with a caption; 1: every row has an outcome and some failed (a
    retry manifest lists them); 130: interrupted, at any point (run the same command to
    resume: the journal has everything up to the signal)."""
    try:
        return _backfill(args, cfg)
    except BaseException as exc:
        interrupted = signal_behind(exc)
        if interrupted is None:
            raise
        print(
            f"mmworker backfill: {interrupted}: stopped; run the same command to resume",
            file=sys.stderr,
        )
        return ExitCode.INTERRUPTED


def _backfill(args: argparse.Namespace, cfg: WorkerConfig) -> int:
    from mmworker.progress import progress

    out = Path(args.out)
    fmt = output_format(out, args.format)
    spec = str(args.manifest)
    name = args.name or _default_name(spec)
    cols = columns_from(args)
    check_columns(spec, cols)
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                "top_p": args.top_p, "seed": args.seed}  # fmt: skip
    defaults = Defaults(
        prompt=args.prompt, task=args.task,
        generation={k: v for k, v in sampling.items() if v is not None},
    )  # fmt: skip
    base = Path(spec).parent if manifest_kind(spec) not in ("dir", "glob") else Path.cwd()

    def planned_rows() -> Iterator[tuple[Row, Planned]]:
        for row in read_manifest(spec):
            yield row, plan(row, name, cols, defaults, base, cfg.kafka.max_request_size)

    out.parent.mkdir(parents=True, exist_ok=True)
    state = load_state(out)
    check_journal_name(out, state, name)
    tally = Tally(total=count_rows(spec))
    collector = Collector(cfg, [cfg.kafka.output_topic, cfg.kafka.dead_letter_topic], name, state)
    journal = Journal(out)
    topic = args.topic or cfg.kafka.backfill_topic or cfg.kafka.input_topic
    poster = Poster(cfg, topic, journal, state)
    link = BrokerLink(f"kafka.bootstrap_servers={cfg.kafka.bootstrap_servers}")
    started = time.monotonic()
    bar = progress(tally.total, f"backfill {name}", "row")
    try:
        plans = (p for _, p in planned_rows())
        _pump(plans, state, tally, collector, poster, args.window, args.grace, bar, link)
    finally:
        bar.close()
        journal.close()
        collector.close()
        poster.close()
    retry_path = out.with_name(out.stem + ".retry.jsonl")
    rows = ((with_absolute_media(row, p, cols.uri, base), p) for row, p in planned_rows())
    written = write_results(out, fmt, rows, retry_path)
    _summary(name, out, written, tally, time.monotonic() - started)
    return 1 if written.rows - written.outcomes["ok"] else 0


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
    window: int, grace_s: float, bar: Any, link: BrokerLink,
) -> None:  # fmt: skip
    """Post while the window has room, collect answers, until every row has its answer. Jobs
    an earlier run left unanswered hold their places in the window; once the collector has
    caught up, those past the grace period are posted again. Once every row is planned, the
    earlier run's jobs that no row asks for any more are let go (their answers, should they
    come, are not waited for). While the brokers are gone it keeps trying, and once they are
    back the jobs still unanswered are treated as on a resume."""
    stale = set(state.posted)
    seen: set[str] = set()
    exhausted = False
    if state.posted:
        print(
            f"mmworker backfill: resuming: {len(state.posted)} jobs posted before are "
            "unanswered; reading the answers that arrived meanwhile",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    collector.catch_up(poster.journal, tally, link)
    while True:
        check_interrupted()  # a signal a library swallowed (it logs its error) still stops it
        stale &= state.posted.keys()
        due = repost_due({k: state.posted[k] for k in stale}, time.time(), grace_s)
        stale.difference_update(due)
        batch = [(job_id, state.posted[job_id].payload, state.posted[job_id].fingerprint)
                 for job_id in due]  # fmt: skip
        tally.reposted += len(due)
        room = window - len(state.posted) - len(poster.pending)  # re-posts hold theirs
        while not exhausted and room > 0:
            planned = _next_job(plans, state, seen, tally)
            if planned is None:
                exhausted = True
                for job_id in state.posted.keys() - seen:
                    del state.posted[job_id]
            elif planned.job is not None:
                payload = planned.job.model_dump_json(exclude_defaults=True).encode()
                batch.append((planned.job_id, payload, planned.fingerprint))
                room -= 1
        sent = len(poster.pending) + len(batch)
        posted = poster.post(batch)
        tally.posted += sent if posted else 0
        if exhausted and not state.posted and not poster.pending:
            break
        collector.poll(poster.journal, tally, timeout_ms=200)
        connected = collector.connected()
        why = poster.failure or "no connection"
        if link.observe(posted and connected, why, since=poster.failing_since):
            stale |= state.posted.keys()  # a broker that restarted empty lost them
        _show(bar, tally, state)
    _show(bar, tally, state)


def _next_job(
    plans: Iterator[Planned], state: State, seen: set[str], tally: Tally
) -> Planned | None:
    """The next row that needs posting. Passed over: rows whose question has its answer,
    rows whose job is posted and unanswered with the same question, duplicates of an earlier
    row, and rows that are no jobs at all (the final pass writes their failure). A row whose job
    id was posted with another question (its options changed meanwhile) is posted again: the
    earlier answer, when it comes, is stale."""
    for planned in plans:
        if planned.job_id in seen:
            tally.duplicate_rows += 1
            tally.done += 1
            continue
        seen.add(planned.job_id)
        if planned.job is None:
            tally.outcomes[INVALID_ROW] += 1
            tally.done += 1
            continue
        if state.outcome(planned) is not None:
            tally.done += 1
            continue
        tally.awaiting.add(planned.job_id)
        sent = state.posted.get(planned.job_id)
        if sent is not None and sent.fingerprint == planned.fingerprint:
            continue
        return planned
    return None


class Poster:
    """Posts batches of jobs; the journal follows what the broker has acknowledged. The
    producer is made at the first batch: a re-run that has nothing to post opens none. A batch
    the brokers do not take (they are gone) is kept and posted again at the next call."""

    def __init__(self, cfg: WorkerConfig, topic: str, journal: Journal, state: State) -> None:
        self._cfg = cfg
        self.topic = topic
        self.journal = journal
        self.state = state
        self.failure = ""  # why the last batch did not go out
        self.pending: list[tuple[str, bytes, str | None]] = []
        self._producer: Any = None
        self._delivered = False  # once the topic took a batch, a failure is a lost broker
        self._refusals = 0  # failures in a row that no lost connection explains
        #: time.monotonic() when the first of the failed posts in a row began (None: no failure)
        self.failing_since: float | None = None

    def post(self, batch: list[tuple[str, bytes, str | None]]) -> bool:
        """Send what is pending and `batch`, wait for the broker's acknowledgement, then
        journal: a job is journaled as posted only once it is in the topic (a kill in between
        re-posts it: a duplicate, never a loss). False when the brokers did not take it."""
        from kafka.errors import KafkaError

        self.pending += batch
        if not self.pending:
            return True
        now = time.time()
        began = time.monotonic()
        try:
            self._send(self.pending)
        except KafkaError as exc:
            if self.failing_since is None:
                self.failing_since = began
            transient = _transient(exc)
            self._refusals = 0 if transient else self._refusals + 1
            if not self._delivered or self._refusals > REFUSALS:
                raise ConfigError(
                    f"cannot post to topic {self.topic!r} ({type(exc).__name__}: {exc}): create "
                    "it (the worker does with --create-topics N), or name another with --topic"
                ) from exc
            if not transient:
                # The topic took batches before: a broker that restarted without the
                # producer's state (the in-memory test broker answers InitProducerId with an
                # unknown error) is cured by a fresh producer; a real refusal repeats.
                self._drop_producer()
            self.failure = f"{type(exc).__name__} while posting"
            return False
        self._delivered = True
        self._refusals = 0
        self.failure = ""
        self.failing_since = None
        self.journal.write(
            {"t": "posted", "id": job_id, "at": now, "fp": fp, "job": value.decode()}
            for job_id, value, fp in self.pending
        )
        for job_id, value, fp in self.pending:
            self.state.posted[job_id] = Sent(now, value, fp)
        self.pending = []
        return True

    def _send(self, batch: list[tuple[str, bytes, str | None]]) -> None:
        if self._producer is None:
            from mmworker.kafka_io import posting_producer

            self._producer = posting_producer(self._cfg.kafka)
        futures = [self._producer.send(self.topic, key=k.encode(), value=v) for k, v, _ in batch]
        self._producer.flush(timeout=30)
        for future in futures:
            future.get(timeout=30)

    def _drop_producer(self) -> None:
        from kafka.errors import KafkaError

        producer, self._producer = self._producer, None
        try:
            producer.close(timeout=1)
        except KafkaError as exc:  # its unacknowledged batch is pending here, posted again
            logging.getLogger(__name__).debug("closing a producer the broker forgot: %r", exc)

    def close(self) -> None:
        if self._producer is not None:
            close_producer(self._producer)


#: Posting failures in a row, each with a fresh producer, that are not a lost connection, a
#: time-out or a retriable error, before the backfill stops with the error.
REFUSALS = 3


def _transient(exc: BaseException) -> bool:
    """A failure a broker that is gone, or not back yet, causes; not a wrong setting."""
    from kafka.errors import KafkaConnectionError, KafkaTimeoutError

    return isinstance(exc, KafkaConnectionError | KafkaTimeoutError) or bool(
        getattr(exc, "retriable", False)
    )


class BrokerLink:
    """One line of the command's own when the brokers are gone, and one when they are back.

    kafka-python retries by itself and logs every attempt (issue #35: dozens of lines a minute,
    none saying what happens to the backfill). A loss is reported once it has lasted `after_s`:
    kafka-python also drops and remakes connections by itself, which is no loss."""

    def __init__(
        self, where: str, after_s: float = 3.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._where = where
        self._after_s = after_s
        self._clock = clock
        self._down_since: float | None = None
        self.reported = False
        self.outages = 0

    def observe(self, up: bool, why: str, since: float | None = None) -> bool:
        """Note whether the brokers answer now (`why` they do not); True once, when they are
        back after a loss that was reported. `since`: when (on this clock) the attempt that
        failed began. A post to a lost broker blocks for up to its flush timeout (30 s) before
        it fails, so the loss counts from the attempt's start, not from when it gave up: else
        two blocked posts pass before the line comes (a minute of silence)."""
        now = self._clock()
        if up:
            since, self._down_since = self._down_since, None
            if since is None or not self.reported:
                return False
            self.reported = False
            print(
                f"mmworker backfill: the brokers are back after {now - since:.0f}s; jobs still "
                "unanswered are posted again once --grace has passed since they were posted (a "
                "broker that restarted empty has lost them)",
                file=sys.stderr, flush=True,
            )  # fmt: skip
            return True
        if self._down_since is None:
            self._down_since = now if since is None else min(since, now)
        if not self.reported and now - self._down_since >= self._after_s:
            self.reported = True
            self.outages += 1
            print(
                f"mmworker backfill: lost the brokers ({self._where}; {why}): waiting for them "
                "to come back; the journal keeps every job posted and every answer",
                file=sys.stderr, flush=True,
            )  # fmt: skip
        return False


def _show(bar: Any, tally: Tally, state: State) -> None:
    failed = sum(n for code, n in tally.outcomes.items() if code != "ok")
    bar.set_postfix_str(
        f"posted={tally.posted}, answered={tally.answered}, failed={failed}, "
        f"outstanding={len(state.posted)}"
    )
    bar.set_count(tally.done)


def _default_name(spec: str) -> str:
    """The manifest's name: the same on every re-run of the same command."""
    stem = Path(spec.rstrip("/")).stem if not glob.has_magic(spec) else "glob-" + hashlib.sha256(
        spec.encode()
    ).hexdigest()[:8]  # fmt: skip
    return stem or "backfill"


def _summary(name: str, out: Path, written: Written, tally: Tally, elapsed: float) -> None:
    """Counts of the output as written (they agree with the retry manifest), then this run's."""
    outcomes = Counter(written.outcomes)
    ok = outcomes.pop("ok", 0)
    failed = ", ".join(f"{code} {n}" for code, n in sorted(outcomes.items()))
    lines = [
        f"backfill {name}: {written.rows} rows in {out}: {ok} ok, {sum(outcomes.values())} failed"
        + (f" ({failed})" if failed else ""),
        f"this run: {tally.posted} posted ({tally.reposted} re-posted), {tally.answered} "
        f"answered in {elapsed:.1f}s ({tally.answered / max(elapsed, 1e-9):.1f} rows/s); "
        f"{tally.duplicates} duplicate answers dropped; {tally.duplicate_rows} manifest rows "
        "had the job id of an earlier row (the same key, or the same URI, prompt and options)",
    ]
    if written.unused or tally.stale:
        lines.append(
            f"{written.unused} earlier answers left out of the output and {tally.stale} stale "
            "answers dropped: their rows ask something else now, or are no longer in the manifest"
        )
    if written.retry is not None:
        lines.append(f"retry manifest of the {sum(outcomes.values())} failed rows: {written.retry}")
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
                close_reader(self._consumer)
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

    def catch_up(self, journal: Journal, tally: Tally, link: BrokerLink) -> None:
        """Read what arrived while no backfill was running, before anything is re-posted.

        Until the end offsets it found at the start, and one empty poll (the Tansu broker
        reports the end as its last batch's first offset + 1, so the end offsets alone can stop
        short). Brokers lost meanwhile are said so, as in the run (`link`); and at each empty
        poll short of the ends, the ends are asked again and the lower kept: brokers that came
        back empty have lower ones, which it waited for without end."""
        while True:
            check_interrupted()  # brokers gone is when Ctrl-C comes; a library may swallow it
            if self.poll(journal, tally, timeout_ms=500):
                continue
            up = self.connected()
            link.observe(up, "no connection")
            if up and self._reached_ends():
                return

    def _reached_ends(self) -> bool:
        """Every position at its end; if not, the ends are asked again (see `catch_up`)."""
        from kafka.errors import KafkaError

        positions = {tp: self._consumer.position(tp, timeout_ms=POSITION_MS) for tp in self._ends}
        if all(p is not None and p >= self._ends[tp] for tp, p in positions.items()):
            return True
        try:
            now = self._consumer.end_offsets(list(self._ends), timeout_ms=POSITION_MS * 5)
        except KafkaError:
            return False  # no answer: asked again after the next poll
        self._ends = {tp: min(end, now.get(tp, end)) for tp, end in self._ends.items()}
        return all(p is not None and p >= self._ends[tp] for tp, p in positions.items())

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
                verdict = self._state.answer(row)
                if verdict == NEW:
                    entries.append({"t": "answer", "row": row})
                    tally.answered += 1
                    tally.outcomes["ok" if row["outcome"] == "ok" else str(row["code"])] += 1
                    if row["job_id"] in tally.awaiting:
                        tally.awaiting.discard(row["job_id"])
                        tally.done += 1
                elif verdict == STALE:
                    tally.stale += 1
                else:
                    tally.duplicates += 1
        positions = dict(self._state.positions)
        for tp in self._consumer.assignment():
            # Bounded: with the brokers gone, a position being reset (a topic that came back
            # empty) waits for an answer; the journal keeps the last known one meanwhile.
            position = self._consumer.position(tp, timeout_ms=POSITION_MS)
            if position is not None:
                positions[f"{tp.topic}:{tp.partition}"] = position
        if entries or positions != self._state.positions:
            self._state.positions = positions
            journal.write([*entries, {"t": "positions", "pos": positions}])
        return read

    def connected(self) -> bool:
        """Whether the reader holds a connection to a broker now. kafka-python retries on its
        own and says so per attempt; this is what the backfill's one line of its own is based
        on (private API of the pinned release, hence here)."""
        conns = self._consumer._manager._conns.values()
        return any(getattr(conn, "connected", False) for conn in conns)

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
        close_reader(self._consumer)


#: How long the collector waits for a partition's position (journaled after each poll).
POSITION_MS = 200
#: How long a reader's close waits for a metadata request in flight to be answered.
SETTLE_MS = 2000


def close_reader(consumer: Any, settle_ms: int = SETTLE_MS) -> None:
    """Close a consumer that is in no group without kafka-python's close-time noise.

    Issue #35: re-running a finished backfill printed a traceback one run in four or eight
    (`AttributeError: 'NoneType' object has no attribute 'recv'`, then `ERROR kafka.cluster:
    Metadata refresh: failed Cancelled`). kafka-python 3 drives a consumer's sockets from an I/O
    thread, while `close()` closes them from the caller's: a read woken by the close finds its
    socket gone, and a metadata request in flight (the consumer asks for one as it is assigned
    its partitions) is cancelled and logged as an error. So: wait, on the I/O thread, for the
    metadata request in flight (up to `settle_ms`; a broker that does not answer by then is
    gone, and the cancel is the truth), stop the I/O thread, and close with nothing running
    beside the close. Private API of the pinned release (3.0.12), hence the one place."""
    from kafka.errors import KafkaError

    manager, cluster = consumer._manager, consumer._cluster

    async def settle() -> None:
        pending = cluster._refresh_future
        if pending is not None and not pending.is_done:
            await manager.wait_for(pending, settle_ms)

    try:
        manager.run(settle)
    except KafkaError as exc:  # failed or timed out: its own error line says so; close anyway
        logging.getLogger(__name__).debug("metadata request in flight at close: %r", exc)
    consumer._net.stop()
    consumer.close()
