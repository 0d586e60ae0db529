"""`mmworker submit` and `mmworker tail`: the producer and reader a person uses by hand.

Both read the worker's own configuration (`--config`, `MMWORKER_*`, `--set`): the same brokers,
TLS/SASL settings and topic names, so a deployment's settings are typed once. `submit` decides
what it can send before sending: media are recognised by their bytes (the worker's own sniffing),
and a file the worker would refuse to read is reported with the fix instead of becoming a
`forbidden_uri` failure later.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import re
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafka.errors import KafkaError
from mmworker_preprocess.errors import UnsupportedMedia
from mmworker_preprocess.sniff import sniff
from mmworker_schemas import GenerationParams, Job, MediaRef, ResponseFormat
from mmworker_schemas.job import TASK_NAME_PATTERN
from pydantic import TypeAdapter, ValidationError

from mmworker.client import Ack, Client
from mmworker.config import WorkerConfig
from mmworker.errors import ConfigError
from mmworker.exits import ExitCode, check_interrupted, signal_behind
from mmworker.progress import progress

#: Bytes read from a file to recognise it: signatures need a few dozen, FFmpeg's probe of an
#: unusual container a few KiB to find its streams.
SNIFF_BYTES = 256 * 1024
_URL_PREFIXES = ("http://", "https://", "file://")


@dataclass(frozen=True, slots=True)
class Source:
    """One thing to submit, or the reason it is skipped. `named`: given on the command line, so
    skipping it is a failure; a non-media file met in a directory is only reported."""

    name: str
    skip: str | None = None
    named: bool = True


def expand_sources(sources: list[str]) -> Iterator[Source]:
    """URLs pass through; files and the files under directories (sorted, recursive) are kept when
    their bytes are an image or a video, whatever their names say."""
    for source in sources:
        path = Path(source)
        if source.startswith(_URL_PREFIXES):
            yield Source(source)
        elif path.is_dir():
            for child in sorted(path.rglob("*")):
                if child.is_file():
                    yield Source(str(child), _not_media(child), named=False)
        elif path.is_file():
            yield Source(source, _not_media(path))
        else:
            yield Source(source, "no such file")


def _not_media(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            head = f.read(SNIFF_BYTES)
        sniff(head)
    except UnsupportedMedia as exc:
        return exc.message  # says what the bytes are instead
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    return None


def unreadable_by_worker(source: str, inline_max: int, roots: tuple[Path, ...]) -> str | None:
    """Why a worker would refuse this file (`forbidden_uri`), with the fix; None when it is fine.
    Files up to `inline_max` travel inside the job; larger ones as file:// URIs, which a worker
    reads only under its `preprocess.allowed_roots`."""
    if source.startswith(_URL_PREFIXES):
        return None
    path = Path(source).resolve()
    size = path.stat().st_size
    resolved = [root.resolve() for root in roots]
    if size <= inline_max or any(path.is_relative_to(root) for root in resolved):
        return None
    shown = json.dumps([str(r) for r in resolved]) if resolved else "empty"
    return (
        f"{size} bytes is over --inline-max-bytes ({inline_max}), so it would go as a file:// "
        f"URI, which a worker reads only under preprocess.allowed_roots ({shown}): raise "
        "--inline-max-bytes, or give the worker and this command "
        f"--set 'preprocess.allowed_roots={json.dumps([str(path.parent)])}'"
    )


def media_ref(source: str, inline_max: int) -> MediaRef:
    if source.startswith(_URL_PREFIXES):
        return MediaRef(uri=source)
    path = Path(source).resolve()
    if path.stat().st_size <= inline_max:
        return MediaRef(data=path.read_bytes())
    return MediaRef(uri=path.as_uri())


def job_for(source: str, ref: MediaRef, args: argparse.Namespace) -> Job:
    generation = GenerationParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    return Job(
        job_id=str(uuid.uuid4()),
        prompt=args.prompt,
        task=getattr(args, "task", None),
        response_format=getattr(args, "response_format", None),
        media=[ref],
        generation=generation,
        metadata={"source": source},
    )


def check_sampling(args: argparse.Namespace) -> None:
    """The sampling flags (and the task's name), checked before the brokers are reached or a
    file is read."""
    task = getattr(args, "task", None)
    if task is not None and not re.fullmatch(TASK_NAME_PATTERN, task):
        raise ConfigError(f"invalid --task {task!r}: a task name matches {TASK_NAME_PATTERN}")
    try:
        GenerationParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            seed=args.seed,
        )  # fmt: skip
    except ValidationError as exc:
        bad = "; ".join(
            f"--{str(e['loc'][0]).replace('_', '-')} {e['input']}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"invalid sampling option: {bad}") from None
    prompt = getattr(args, "prompt", None)
    try:
        Job(job_id="check", prompt=prompt, media=[MediaRef(uri="https://example.org/a.jpg")])
    except ValidationError as exc:
        # Not "invalid configuration: prompt='<20,000 characters>' (from the default)", which
        # the generic handler made of it: the flag, and what is wrong with it.
        why = "; ".join(e["msg"] for e in exc.errors())
        raise ConfigError(f"invalid --prompt ({len(prompt or ''):,} characters): {why}") from None


def check_task(task: str | None, cfg: WorkerConfig) -> None:
    """A task name the configuration does not have is refused here, before anything is posted:
    the worker, reading the same task list, would dead-letter every job as unknown_task."""
    if task is None or task in cfg.tasks:
        return
    close = difflib.get_close_matches(task, list(cfg.tasks), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(
        f"--task {task!r} is not one of the configured tasks ({', '.join(sorted(cfg.tasks))})"
        f"{hint}: a new one goes under [tasks.{task}] in the worker's config, which this "
        "command reads too (--config or MMWORKER_CONFIG)"
    )


_RESPONSE_FORMAT: TypeAdapter[ResponseFormat] = TypeAdapter(ResponseFormat)


def read_response_format(given: str) -> ResponseFormat:
    """`--response-format` as JSON text (starting with `{`) or a file holding it, checked against
    the job schema now, so a mistake is one line here instead of a dead-lettered job later."""
    if given.lstrip().startswith("{"):
        text, where = given, "--response-format"
    else:
        try:
            text = Path(given).read_text()
        except OSError as exc:
            raise ConfigError(
                f"--response-format {given}: cannot read it ({exc.strerror or exc}): give a file "
                'holding the JSON, or the JSON itself, e.g. \'{"type": "choice", "choices": '
                '["yes", "no"]}\''
            ) from None
        where = f"--response-format {given}"
    try:
        return _RESPONSE_FORMAT.validate_json(text)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'it'}: {e['msg']}"
            for e in exc.errors(include_url=False)[:5]
        )
        raise ConfigError(
            f"{where} is not a response_format ({problems}): write "
            '{"type": "json_schema", "schema": {...}}, {"type": "regex", "regex": "..."} or '
            '{"type": "choice", "choices": [...]}'
        ) from None


def submit(args: argparse.Namespace, cfg: WorkerConfig) -> int:
    """0: every source sent (non-media files met in directories are reported, not failures);
    1: a named source, or a file a worker would refuse, was not sent (each said why); 130:
    interrupted."""
    topic = args.topic or cfg.kafka.input_topic
    failed = 0
    sendable: list[str] = []
    for source in expand_sources(args.sources):
        why = source.skip
        if why is None:
            try:
                why = unreadable_by_worker(
                    source.name, args.inline_max_bytes, cfg.preprocess.allowed_roots
                )
            except OSError as exc:
                why = f"cannot read it: {exc.strerror or exc}"
            failed += why is not None
        else:
            failed += source.named
        if why is None:
            sendable.append(source.name)
        else:
            print(f"skipped {source.name}: {why}", file=sys.stderr)
    if not sendable:
        print("mmworker submit: nothing to submit", file=sys.stderr)
        return 1
    sendable *= args.repeat
    sent = 0
    refusals: list[str] = []
    client = Client(cfg)
    # One job needs no bar: its line on stdout and the summary say it all.
    with progress(len(sendable), "submitting", "job", show=len(sendable) > 1) as bar:

        def acknowledged(name: str, posted: Future[Ack]) -> None:
            exc = posted.exception()
            if exc is not None:
                refusals.append(name)
                bar.write(f"refused {name}: {type(exc).__name__}: {exc}")
            bar.update()

        try:
            for name in sendable:
                check_interrupted()  # a signal a library swallowed still stops the posting
                try:
                    ref = media_ref(name, args.inline_max_bytes)
                except OSError as exc:  # gone or unreadable since it was looked at
                    bar.write(f"skipped {name}: {exc.strerror or exc}")
                    failed += 1
                    bar.update()
                    continue
                job = job_for(name, ref, args)
                posted = client.post(job, topic)
                posted.add_done_callback(functools.partial(acknowledged, name))
                print(f"{job.job_id}\t{name}", flush=True)
                sent += 1
            client.flush()
        except BaseException as exc:
            interrupted = signal_behind(exc)  # also when a library wrapped it in its own error
            if interrupted is not None:
                bar.write(f"mmworker submit: {interrupted}: stopped after {sent} jobs")
                return ExitCode.INTERRUPTED
            if isinstance(exc, KafkaError):
                raise ConfigError(
                    f"cannot post to topic {topic!r} ({type(exc).__name__}: {exc}): create it "
                    "(the worker does with --create-topics N), or name another with --topic"
                ) from exc
            raise
        finally:
            client.close(timeout_s=5)
    failed += len(refusals)
    more = f"; {failed} not sent (see above)" if failed else ""
    done = sent - len(refusals)
    print(f"sent {done} job{'' if done == 1 else 's'} to {topic}{more}", file=sys.stderr)
    return 1 if failed else 0


def tail(args: argparse.Namespace, cfg: WorkerConfig) -> int:
    """Print what arrives; stops after `--timeout` idle, or at Ctrl-C with `--follow`. Brokers
    that go away and come back are said so in one line each, and reading goes on."""
    topics = args.topics or [cfg.kafka.output_topic, cfg.kafka.dead_letter_topic]
    client = Client(cfg, on_event=lambda message: _say("tail", message))
    seen = 0
    started = time.monotonic()
    try:
        missing = client.missing_topics(topics)
        if missing:
            _say(
                "tail",
                f"no topic {', '.join(missing)} on the brokers yet (a worker creates its topics "
                "with --create-topics N)",
            )
        idle = None if args.follow else args.timeout
        for record in client.records(topics, idle_timeout_s=idle, from_now=args.from_now):
            seen += 1
            print(_line(record, args.json), flush=True)
    except BaseException as exc:
        if signal_behind(exc) is None:  # Ctrl-C is how --follow ends, also when wrapped
            raise
    print(f"{seen} records in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0


def _say(command: str, message: str) -> None:
    print(f"mmworker {command}: {message}", file=sys.stderr, flush=True)


def _line(record: Any, raw: bool) -> str:
    if record.value is None:  # a tombstone (a suspect cleared): json.loads(None) stopped tail
        return f"[{record.topic}] no value (key {record.key!r})"
    try:
        doc = json.loads(record.value)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"[{record.topic}] not JSON: {record.value[:80]!r}"
    if raw:
        return json.dumps(doc)
    if not isinstance(doc, dict):
        return f"[{record.topic}] {json.dumps(doc)[:120]}"
    return summarise(record.topic, doc, record.key)


def summarise(topic: str, doc: dict[str, object], key: bytes | None = None) -> str:
    """One line per record, named by the source `submit` recorded in the job's metadata where
    there is one; a failure without a job_id is named by its record key."""
    job = doc.get("job_id") or (key.decode(errors="replace") if key else "?")
    meta = doc.get("metadata")
    source = meta.get("source") if isinstance(meta, dict) else None
    name = f"{source} (job {job})" if source else str(job)
    if "code" in doc:
        return f"[{topic}] FAILED {name}: {doc['code']}: {doc.get('message')}"
    media = doc.get("media")
    items = media if isinstance(media, list) else []
    kinds = ",".join(str(m.get("kind")) for m in items if isinstance(m, dict))
    hit = " (cache hit)" if doc.get("cache_hit") else ""
    task = f" {doc['task']}" if doc.get("task") else ""
    segments = doc.get("segments")
    if isinstance(segments, list):  # segment mode: a line per segment under this one
        from mmworker.segment_lines import segment_lines

        head = f"[{topic}] {name} [{kinds}]{task}{hit}: {len(segments)} segments"
        return "\n".join([head, *segment_lines(doc)])
    if doc.get("json") is not None:
        return f"[{topic}] {name} [{kinds}]{task}{hit}: {fields(doc['json'])}"
    text = str(doc.get("text"))
    shown = repr(text[:60] + ("…" if len(text) > 60 else ""))
    return f"[{topic}] {name} [{kinds}]{task}{hit}: {shown}"


def fields(parsed: object, width: int = 160) -> str:
    """A parsed answer on one line: `key=value` per field of an object, values as compact
    JSON, cut at `width` characters."""
    if isinstance(parsed, dict):
        line = " ".join(f"{k}={_compact(v)}" for k, v in parsed.items())
    else:
        line = _compact(parsed)
    return line if len(line) <= width else line[: width - 1] + "…"


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
