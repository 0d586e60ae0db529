"""`mmworker` command line: run a worker, post jobs and backfills, replay failures, read results.

What a person meets first has to explain itself: every expected failure (a configuration mistake,
brokers out of reach, a model that is not there) ends in one line on stderr that names the cause,
where the setting came from and the fix, with exit code 2; `--debug` adds the traceback. `run`
makes the cheap checks (configuration, model, brokers) before the engine, the slow part, starts.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import json
import logging
import math
import os
import re
import sys
import tomllib
import traceback
import typing
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mmworker import __version__, logs
from mmworker.errors import ConfigError, WorkerError
from mmworker.exits import ExitCode, Interrupted, exit_now, signal_behind, stop_on_signals
from mmworker.set_items import parse_set

# Flags for the settings people change most; anything else goes through --set or the environment.
_RUN_FLAGS: dict[str, tuple[str, type]] = {
    "--bootstrap-servers": ("kafka.bootstrap_servers", str),
    "--group-id": ("kafka.group_id", str),
    "--input-topic": ("kafka.input_topic", str),
    "--output-topic": ("kafka.output_topic", str),
    "--dead-letter-topic": ("kafka.dead_letter_topic", str),
    "--model": ("engine.model", str),
    "--max-in-flight": ("limits.max_in_flight", int),
    "--cache-dir": ("cache.directory", str),
    "--metrics-port": ("metrics_port", int),
    "--worker-id": ("worker_id", str),
    "--processes": ("processes", int),
}
_METAVARS = {
    "--bootstrap-servers": "HOST:PORT[,...]",
    "--group-id": "GROUP",
    "--input-topic": "TOPIC",
    "--output-topic": "TOPIC",
    "--dead-letter-topic": "TOPIC",
    "--model": "ID_OR_DIR",
    "--max-in-flight": "N",
    "--cache-dir": "DIR",
    "--metrics-port": "PORT",
    "--worker-id": "NAME",
    "--processes": "N",
}
#: How long `run`, `submit` and `tail` try the brokers before saying they cannot be reached.
BROKER_CHECK_S = 10.0
#: How long `run` waits for the Hugging Face Hub to confirm a model it must download.
HUB_CHECK_S = 10.0


class _Parser(argparse.ArgumentParser):
    """A wrong option is one line, like every other expected failure: argparse's own error
    repeats the whole usage first (9 lines for `run`) above the one line that matters."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(ExitCode.USAGE, f"{self.prog}: {message} (`{self.prog} --help` lists them)\n")


class _Help(argparse.HelpFormatter):
    """Shows each option's default, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or default is None or default is False or default == []:
            return text
        if default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


def _field(path: str) -> Any:
    from mmworker.config import WorkerConfig

    section, _, leaf = path.partition(".")
    field = WorkerConfig.model_fields[section]
    if leaf and isinstance(field.annotation, type):
        field = field.annotation.model_fields[leaf]
    return field


def _describe(path: str) -> str:
    return _field(path).description or ""


def _default_shown(path: str) -> str:
    """The setting's default as the configuration reference shows it (no Markdown)."""
    from mmworker.config_reference import _default

    return _default(_field(path)).replace("`", "").replace("%", "%%")


class _NoneGiven:
    """`--metrics-port None`: a setting explicitly unset (argparse's own None means 'not
    given', which leaves the file's or the environment's value in place)."""

    def __repr__(self) -> str:
        return "None"


NONE_GIVEN = _NoneGiven()
_NONE_WORDS = ("none", "null")


def _flag_type(path: str, kind: type) -> Any:
    """`kind`, plus the word None for settings whose description says None disables them."""
    if type(None) not in typing.get_args(_field(path).annotation):
        return kind

    def convert(text: str) -> Any:
        return NONE_GIVEN if text.strip().lower() in _NONE_WORDS else kind(text)

    convert.__name__ = kind.__name__  # argparse names it: "invalid int value: 'x'"
    return convert


def _connection_args(p: argparse.ArgumentParser, flags: tuple[str, ...] = ()) -> None:
    """The options every command that reads the worker's configuration shares."""
    p.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="the worker's TOML file (also MMWORKER_CONFIG); MMWORKER_* variables apply too",
    )
    for flag in ("--bootstrap-servers", *flags):
        path, kind = _RUN_FLAGS[flag]
        p.add_argument(
            flag,
            type=_flag_type(path, kind),
            dest=path.replace(".", "__"),
            metavar=_METAVARS[flag],
            help=f"{_describe(path)} ({path}; default: {_default_shown(path)})",
        )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any setting by dotted path, e.g. --set engine.max_num_seqs=64; the value is read as "
        "JSON, so lists are --set 'preprocess.allowed_roots=[\"/data\"]'",
    )


def _config_args(p: argparse.ArgumentParser) -> None:
    _connection_args(p, tuple(flag for flag in _RUN_FLAGS if flag != "--bootstrap-servers"))


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """Flags and --set pairs → the nested dict load_config takes (explicit beats env and file)."""
    out: dict[str, Any] = {}
    pairs: list[tuple[str, Any]] = []
    for _flag, (path, _kind) in _RUN_FLAGS.items():
        value = getattr(args, path.replace(".", "__"), None)
        if value is not None:
            pairs.append((path, None if value is NONE_GIVEN else value))
    pairs += [parse_set(item) for item in getattr(args, "set", [])]
    for path, value in pairs:
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {path}: {part} is a setting, not a section")
            node = child
        node[leaf] = value
    return out


def _toml_path(args: argparse.Namespace) -> Path | None:
    given = getattr(args, "config", None)
    env = os.environ.get("MMWORKER_CONFIG")
    return given or (Path(env) if env else None)


def setting_source(path: str, args: argparse.Namespace) -> str:
    """Where the effective value of a dotted setting (or a whole section) came from: the flag,
    `--set`, the environment variable, the config file or the default. Error messages name it,
    because the fix is made there."""
    parts = path.split(".")
    for flag, (flag_path, _kind) in _RUN_FLAGS.items():
        if flag_path == path and getattr(args, flag_path.replace(".", "__"), None) is not None:
            return flag
    for item in getattr(args, "set", []):
        key = item.partition("=")[0].strip()
        if key == path or key.startswith(f"{path}."):
            return f"--set {key}"
    env = "MMWORKER_" + "__".join(p.upper() for p in parts)
    if env in os.environ:
        return env
    found = sorted(n for n in os.environ if n.startswith(f"{env}__"))
    if found:
        return ", ".join(found)
    if len(parts) > 1 and f"MMWORKER_{parts[0].upper()}" in os.environ:
        return f"MMWORKER_{parts[0].upper()}"
    toml = _toml_path(args)
    if toml is not None and toml.is_file():
        with contextlib.suppress(OSError, tomllib.TOMLDecodeError):
            node: Any = tomllib.loads(toml.read_text())
            for part in parts:
                node = node[part] if isinstance(node, dict) and part in node else None
            if node is not None:
                return f"config file {toml}"
    return "the default"


def explain_invalid(exc: ValidationError, args: argparse.Namespace) -> str:
    """pydantic's multi-line report as one line: each bad setting, its value, its source, and
    what to write instead."""
    parts: list[str] = []
    for err in exc.errors():
        if err["type"] == "default_factory_not_called":
            continue  # a default computed from settings that failed: those are named already
        path = ".".join(str(p) for p in err["loc"])
        source = setting_source(path, args)
        msg = str(err["msg"]).removeprefix("Value error, ")
        value = err.get("input")
        if err["type"] == "extra_forbidden":
            msg = f"no such setting{_did_you_mean(err['loc'])} (`mmworker config --reference` "
            msg += "lists them all)"
        elif err["type"] in ("tuple_type", "list_type", "dict_type", "model_type"):
            msg += f"; {_json_hint(path, value, source)}"
        shown = "" if isinstance(value, dict) else f"={value!r}"
        parts.append(f"{path}{shown} (from {source}): {msg}")
    return "invalid configuration: " + "; ".join(parts)


def _did_you_mean(loc: tuple[int | str, ...]) -> str:
    """'; did you mean kafka.bootstrap_servers?' for a misspelt setting, '' when nothing is
    close: the name is compared with those of the section it sits in."""
    from pydantic import BaseModel

    from mmworker.config import WorkerConfig

    model: Any = WorkerConfig
    parts = [str(p) for p in loc]
    i = 0
    while i < len(parts) - 1:
        field = model.model_fields.get(parts[i])
        if field is None:
            return ""
        annotation = field.annotation
        args = typing.get_args(annotation)
        if typing.get_origin(annotation) is dict and len(args) == 2 and isinstance(args[1], type):
            model, i = args[1], i + 2  # tasks.NAME.prompt: the table's key is any name
        elif isinstance(annotation, type):
            model, i = annotation, i + 1
        else:
            return ""
        if not issubclass(model, BaseModel):
            return ""
    if i != len(parts) - 1:
        return ""
    close = difflib.get_close_matches(parts[-1], list(model.model_fields), n=1)
    return f"; did you mean {'.'.join([*parts[:-1], close[0]])}?" if close else ""


def _json_hint(path: str, value: object, source: str) -> str:
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()] or ["/data/media"]
    else:
        items = ["/data/media"]
    example = json.dumps(items)
    leaf = path.rpartition(".")[2]
    if source.startswith("--set"):
        return f"lists are JSON: --set '{path}={example}'"
    if source.startswith("MMWORKER_"):
        return f"lists are JSON: {source}='{example}'"
    if source.startswith("config file"):
        return f"write {leaf} = {example} in the file"
    return f"write it as a list, e.g. {example}"


def _load(args: argparse.Namespace) -> Any:
    from mmworker.config import load_config

    return load_config(args.config, **overrides_from(args))


def _load_for_client(args: argparse.Namespace) -> Any:
    """The configuration of a command that talks to Kafka for a person: it reports lost brokers
    and refusals itself, so kafka-python's per-attempt lines are off unless asked for."""
    cfg = _load(args)
    logs.quiet_kafka_for_clients(cfg.log_level, asked=getattr(args, "debug", False))
    return cfg


def check_model(model: str, source: str) -> None:
    """Find out in a second what the engine would find out after its start-up (a 63-line
    traceback): a local model directory that is not there, or a Hub model that cannot be had."""
    from mmworker.config import TINY_MODEL

    if model == TINY_MODEL:
        return
    where = f"engine.model={model!r} (from {source})"
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"{where} is a directory without config.json: point engine.model at a Hugging "
                "Face model directory (config.json, tokenizer, *.safetensors)"
            )
        return
    if path.exists():
        return  # a single-file checkpoint (GGUF): vLLM decides
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", model) or model.startswith("."):
        raise ConfigError(
            f"{where}: no such directory: fix the path, or name a Hugging Face model such as "
            "Qwen/Qwen2.5-VL-3B-Instruct"
        )
    if os.environ.get("VLLM_USE_MODELSCOPE", "").lower() in ("1", "true"):
        return  # another hub: vLLM looks it up there
    _check_hub_model(model, where)


def _check_hub_model(model: str, where: str) -> None:
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(model, "config.json"), str):
        return
    cache = constants.HF_HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(
            f"{where} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set: "
            f"download it where there is network (`hf download {model}`) into that cache, or "
            "set engine.model to a local model directory"
        )
    try:
        HfApi().model_info(model, timeout=HUB_CHECK_S)
    except RepositoryNotFoundError as exc:
        raise ConfigError(
            f"{where}: the Hugging Face Hub has no such model, or it needs a login "
            f"({type(exc).__name__}): check the name, or set HF_TOKEN"
        ) from exc
    except HfHubHTTPError as exc:
        raise ConfigError(
            f"{where}: the Hugging Face Hub ({constants.ENDPOINT}) refused the lookup "
            f"({str(exc).splitlines()[0]}): set HF_TOKEN if the model needs one, or set "
            "engine.model to a local model directory"
        ) from exc
    except _transport_errors() as exc:
        raise ConfigError(
            f"{where} is not in the Hugging Face cache ({cache}) and the Hub "
            f"({constants.ENDPOINT}) cannot be reached ({type(exc).__name__}: {exc}): fix the "
            f"network or proxy, or download it elsewhere (`hf download {model}`) and set "
            "engine.model to its directory"
        ) from exc


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's connection errors: huggingface_hub moved from requests (OSError) to
    httpx and httpx2 across the versions the two vLLM builds pull in."""
    found: list[type[BaseException]] = [OSError]
    for name in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError):
            found.append(importlib.import_module(name).HTTPError)
    return tuple(found)


def _warn_of_idle_gpus(engine: Any) -> None:
    from mmworker import fast_defaults, hardware

    used = fast_defaults.gpus_per_model(
        engine.tensor_parallel_size, engine.pipeline_parallel_size, engine.data_parallel_size
    )
    if warning := fast_defaults.idle_gpus(hardware.probe(), used):
        logging.getLogger("mmworker").warning("%s", warning)


def _check_brokers(cfg: Any, args: argparse.Namespace) -> None:
    from mmworker.kafka_io import check_brokers

    check_brokers(cfg.kafka, BROKER_CHECK_S, source=setting_source("kafka.bootstrap_servers", args))


def _warn_if_nobody_consumes(cfg: Any) -> None:
    """`submit` and `backfill` post for the worker group: one line on stderr when it has no
    member, or the jobs sit there unseen (issue #35)."""
    from mmworker.group_members import idle_group_warning

    warning = idle_group_warning(cfg.kafka)
    if warning:
        print(warning, file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    from mmworker.config import TINY_MODEL

    cfg = _load(args)
    logs.setup(cfg.log_level, fmt=cfg.logging.format)
    _warn_of_idle_gpus(cfg.engine)
    check_model(cfg.engine.model, setting_source("engine.model", args))
    _check_brokers(cfg, args)
    if cfg.engine.model == TINY_MODEL:  # the embedded default: development tooling builds it
        from mmworker.app import model_cache_dir
        from mmworker.devkit.tiny_model import ensure_tiny_model

        ensure_tiny_model(model_cache_dir())
    logs.quiet_libraries(cfg.log_level, cfg.logging.format)
    if cfg.processes > 1:
        from mmworker.processes import run_processes

        code = run_processes(cfg, create_topics=args.create_topics)
    else:
        from mmworker.app import run_worker

        code = run_worker(cfg, create_topics=args.create_topics)
    exit_now(code)
    return code  # pragma: no cover - unreachable


def cmd_config(args: argparse.Namespace) -> int:
    if args.reference:
        from mmworker.config_reference import render_reference

        print(render_reference())
        return 0
    cfg = _load(args)
    print(json.dumps(cfg.masked(), indent=2))
    from mmworker import fast_defaults, hardware

    # Beside the JSON, not in it: stdout stays a config a script can read.
    hw = hardware.probe()
    print(f"# this host: {hw.describe()}", file=sys.stderr)
    for name, value, why in fast_defaults.explain(cfg, hw):
        print(f"# {name} = {json.dumps(value)} ({why})", file=sys.stderr)
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from mmworker_schemas.export import MODELS, render

    names = [args.name] if args.name else list(MODELS)
    for name in names:
        sys.stdout.write(render(MODELS[name]))
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from mmworker.devkit.tiny_model import build_tiny_model

    path = build_tiny_model(args.directory, arch=args.arch, seed=args.seed)
    print(f"wrote {args.arch} Qwen2.5-VL (random weights, for testing) to {path}")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from mmworker.tools import check_sampling, check_task, read_response_format, submit

    cfg = _load_for_client(args)
    check_sampling(args)
    check_task(args.task, cfg)
    if args.response_format is not None:
        args.response_format = read_response_format(args.response_format)
    if args.repeat < 1:  # 0 posted nothing and exited 0, as if every job had been sent
        raise ConfigError(f"--repeat {args.repeat}: post each source at least once")
    _check_brokers(cfg, args)
    _warn_if_nobody_consumes(cfg)
    return submit(args, cfg)


def cmd_backfill(args: argparse.Namespace) -> int:
    from mmworker.backfill import (
        backfill,
        check_columns,
        columns_from,
        manifest_kind,
        output_format,
    )
    from mmworker.tools import check_sampling, check_task

    cfg = _load_for_client(args)
    check_sampling(args)
    check_task(args.task, cfg)
    if args.window < 1:
        raise ConfigError(f"--window {args.window}: at least 1 job must be allowed outstanding")
    if not 0 <= args.grace < math.inf:  # nan: an unanswered job was never posted again
        raise ConfigError(f"--grace {args.grace}: seconds, 0 or more")
    manifest_kind(str(args.manifest))  # the cheap mistakes first, before the brokers
    check_columns(str(args.manifest), columns_from(args))
    output_format(args.out, args.format)
    _check_brokers(cfg, args)
    _warn_if_nobody_consumes(cfg)
    return backfill(args, cfg)


def cmd_replay(args: argparse.Namespace) -> int:
    from mmworker.replay import parse_codes, parse_when, replay

    cfg = _load_for_client(args)
    parse_codes(args.code)  # mistakes first, before the brokers are reached
    for when in (args.since, args.until):
        if when:
            parse_when(when)
    if not 0 <= args.wait < math.inf:
        raise ConfigError(f"--wait {args.wait}: seconds, 0 or more")
    _check_brokers(cfg, args)
    return replay(args, cfg)


def cmd_tail(args: argparse.Namespace) -> int:
    from mmworker.tools import tail

    cfg = _load_for_client(args)
    _check_brokers(cfg, args)
    return tail(args, cfg)


def cmd_status(args: argparse.Namespace) -> int:
    from mmworker.replay import parse_when
    from mmworker.status import run_status

    cfg = _load_for_client(args)
    parse_when(args.since)  # a mistake first, before the brokers are reached
    if args.watch is not None and not 0 < args.watch < math.inf:  # nan passed `<= 0`
        raise ConfigError(f"-w {args.watch}: refresh every so many seconds, more than 0")
    _check_brokers(cfg, args)
    return run_status(cfg, as_json=args.json, watch_s=args.watch, since=args.since)


def cmd_broker(args: argparse.Namespace) -> int:
    from mmworker.devkit.broker import run_broker

    return run_broker(args.port, args.partitions)


def cmd_demo(args: argparse.Namespace) -> int:
    from mmworker.devkit.demo import run_demo

    return run_demo(keep_going=args.keep)


def _job_args(p: argparse.ArgumentParser) -> None:
    """The job settings `submit` and `backfill` share."""
    p.add_argument("--prompt", help="instruction; the task's, or a default per media kind")
    p.add_argument(
        "--task", metavar="NAME",
        help="a task of the worker's config (caption, tags, summary, objects, ocr, safety, or "
        "one it adds): its prompt and response_format",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=128, metavar="N", help="longest caption")
    p.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 is greedy decoding"
    )
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass")
    p.add_argument("--seed", type=int, metavar="N", help="sampling seed (repeatable captions)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mmworker", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"mmworker {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an expected failure too"
    )
    # Also accepted after the command (`mmworker run --debug`); SUPPRESS keeps the one above.
    common = _Parser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, helptext: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=helptext, description=helptext, parents=[common], formatter_class=_Help
        )

    p = command("run", "consume jobs and publish captions until SIGTERM/Ctrl-C")
    _config_args(p)
    p.add_argument(
        "--create-topics", type=int, metavar="PARTITIONS",
        help="create the worker's topics that are missing, with this many partitions",
    )  # fmt: skip
    p.set_defaults(fn=cmd_run)

    p = command("demo", "embedded broker + tiny model + sample jobs, then exit")
    p.add_argument("--keep", action="store_true", help="keep the worker's temp dir for a look")
    p.set_defaults(fn=cmd_demo)

    p = command("submit", "post one job per image/video file, directory entry or URL")
    p.add_argument(
        "sources", nargs="+", metavar="PATH_OR_URL",
        help="files, directories (walked; media found by content, not name) or http(s):// URLs",
    )  # fmt: skip
    _connection_args(p)
    p.add_argument("--topic", metavar="TOPIC", help="where to post (default: kafka.input_topic)")
    _job_args(p)
    p.add_argument(
        "--inline-max-bytes", type=int, default=768 * 1024, metavar="BYTES",
        help="embed files up to this size in the job; larger ones are sent as file:// URIs, "
        "which the worker reads only under preprocess.allowed_roots",
    )  # fmt: skip
    p.add_argument(
        "--repeat", type=int, default=1, metavar="N", help="post each source this many times"
    )
    p.add_argument(
        "--response-format", metavar="FILE|JSON",
        help="constrain the answer (replaces the task's): JSON, or a file holding it, e.g. "
        """'{"type": "choice", "choices": ["yes", "no"]}'; also json_schema (with a schema) """
        "and regex (with a regex)",
    )  # fmt: skip
    p.set_defaults(fn=cmd_submit)

    p = command("backfill", "caption every row of a manifest into a results file, resumably")
    p.add_argument(
        "manifest", metavar="MANIFEST",
        help="a .jsonl, .csv/.tsv or .parquet file with a URI column, or a directory or glob "
        "of media files (recognised by content)",
    )  # fmt: skip
    p.add_argument(
        "--out", required=True, type=Path, metavar="RESULTS",
        help="results file, .parquet or .jsonl: one row per manifest row; an existing one is "
        "resumed (its rows are not asked again)",
    )  # fmt: skip
    p.add_argument("--format", choices=["parquet", "jsonl"], help="of --out (default: by suffix)")
    p.add_argument(
        "--name", metavar="NAME",
        help="prefix of every job id (default: the manifest's file name without suffix); the "
        "same name and rows give the same ids",
    )  # fmt: skip
    p.add_argument("--uri-column", default="uri", metavar="COLUMN",
                   help="column with the media: a path (relative: to the manifest), file:// or "
                   "http(s)://")  # fmt: skip
    p.add_argument(
        "--key-column", metavar="COLUMN",
        help="column with a unique row key: job id NAME/KEY (default: a hash of URI, prompt "
        "and options)",
    )  # fmt: skip
    p.add_argument("--prompt-column", metavar="COLUMN", help="column with a per-row prompt")
    p.add_argument(
        "--options-column", metavar="COLUMN",
        help='column with per-row job options as a JSON object, e.g. {"max_tokens": 32, '
        '"task": "tags", "image": {"max_pixels": 200704}}',
    )  # fmt: skip
    p.add_argument(
        "--metadata-columns", action="append", default=[], metavar="COLUMN[,COLUMN...]",
        help="columns copied into each job's metadata and the results' metadata column",
    )  # fmt: skip
    p.add_argument(
        "--window", type=int, default=256, metavar="N",
        help="most jobs posted and not yet answered at once",
    )  # fmt: skip
    p.add_argument(
        "--grace", type=float, default=300.0, metavar="SECONDS",
        help="on a resume, how long a job posted before the interruption may still be answered "
        "before it is posted again",
    )  # fmt: skip
    _connection_args(p)
    p.add_argument(
        "--topic", metavar="TOPIC",
        help="where to post (default: kafka.backfill_topic if set, else kafka.input_topic)",
    )  # fmt: skip
    _job_args(p)
    p.set_defaults(fn=cmd_backfill)

    p = command("replay", "post dead-lettered jobs to the input topic again, as they were")
    _connection_args(p)
    p.add_argument(
        "--code", action="append", default=[], metavar="CODE[,CODE...]",
        help="only failures with these codes (default: every code)",
    )  # fmt: skip
    p.add_argument(
        "--since", metavar="WHEN",
        help="only failures from then on: ISO 8601 (UTC unless it says) or an age (30m, 2h, 7d)",
    )  # fmt: skip
    p.add_argument("--until", metavar="WHEN", help="only failures before then (as --since)")
    p.add_argument(
        "--retryable-only", action="store_true",
        help="only failures whose cause may have gone away (fetch errors, time-outs, engine "
        "errors)",
    )  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="list what would be posted; post nothing")
    p.add_argument("--topic", metavar="TOPIC", help="where to post (default: kafka.input_topic)")
    p.add_argument(
        "--backfill-out", metavar="RESULTS",
        help="only the failed rows of this finished backfill's output: wait for their answers "
        "and write them into it (and its retry manifest)",
    )  # fmt: skip
    p.add_argument(
        "--wait", type=float, default=600.0, metavar="SECONDS",
        help="with --backfill-out: how long to wait for the answers",
    )  # fmt: skip
    p.set_defaults(fn=cmd_replay)

    p = command("tail", "print results and failures, one line each")
    _connection_args(p)
    p.add_argument(
        "--topics", nargs="+", metavar="TOPIC",
        help="what to read (default: kafka.output_topic and kafka.dead_letter_topic)",
    )  # fmt: skip
    p.add_argument(
        "--follow", "-f", action="store_true", help="keep waiting for new records until Ctrl-C"
    )
    p.add_argument("--from-now", action="store_true", help="only records that arrive from now on")
    p.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS",
        help="without -f: stop after this long without a new record",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="raw JSON lines instead of a summary")
    p.set_defaults(fn=cmd_tail)

    p = command(
        "status",
        "is anyone consuming: the group's members, lag per partition, the oldest waiting job, "
        "recent dead letters and suspects",
    )
    _connection_args(p, ("--group-id", "--input-topic", "--dead-letter-topic"))
    p.add_argument("--json", action="store_true", help="one JSON object (a line per refresh)")
    p.add_argument(
        "-w", "--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
        help="refresh every SECONDS (2 if not given) until Ctrl-C",
    )  # fmt: skip
    p.add_argument(
        "--since", default="1h", metavar="WHEN",
        help="count dead letters and suspects from then on: an age (30m, 2h, 7d) or ISO 8601",
    )  # fmt: skip
    p.set_defaults(fn=cmd_status)

    p = command("broker", "an in-memory Kafka-protocol broker on 127.0.0.1, until Ctrl-C (dev)")
    p.add_argument("--port", type=int, default=9092, help="port on 127.0.0.1")
    p.add_argument(
        "--partitions", type=int, default=3, metavar="N",
        help="create the default worker topics with N partitions (0: none)",
    )  # fmt: skip
    p.set_defaults(fn=cmd_broker)

    p = command("schema", "print the JSON Schemas of the wire messages")
    p.add_argument(
        "name", nargs="?", choices=["job", "result", "failure"], help="one message (default: all)"
    )
    p.set_defaults(fn=cmd_schema)

    p = command("config", "print the effective config (secrets masked)")
    _config_args(p)
    p.add_argument("--reference", action="store_true", help="every setting, as Markdown")
    p.set_defaults(fn=cmd_config)

    p = command("tiny-model", "build a random-weight Qwen2.5-VL for tests")
    p.add_argument("directory", type=Path, help="where to write the model (created)")
    p.add_argument("--arch", choices=["tiny", "3b"], default="tiny", help="architecture")
    p.add_argument("--seed", type=int, default=0, help="weight seed")
    p.set_defaults(fn=cmd_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    stop_on_signals()  # first: a signal from here on has a documented effect
    try:
        return _main(argv)
    except Interrupted as exc:
        logging.getLogger("mmworker").info("%s before consuming started: stopped", exc)
        return ExitCode.OK


def _main(argv: list[str] | None) -> int:
    logs.setup("INFO")
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except BaseException as exc:
        # Whatever error a signal caused on its way out (a library may wrap it in its own, and
        # ours may wrap that) is the signal: first, so no one-line error stands for it.
        interrupted = signal_behind(exc)
        if interrupted is None:
            if isinstance(exc, ValidationError | WorkerError | BrokenPipeError):
                return _failed(exc, args)
            if args.fn in (cmd_submit, cmd_backfill, cmd_replay) and isinstance(exc, Exception):
                # Python's own exit for it is 1, which these commands give for "some rows or
                # sources failed": a script would go on to the retry manifest of a run that
                # never finished.
                traceback.print_exc()
                return ExitCode.INTERNAL
            raise
        if args.fn in (cmd_submit, cmd_backfill, cmd_replay):
            # Stopped before their own handler: 130 all the same, as a shell's `&&` must see a
            # posting command that did not finish (their documented code).
            return ExitCode.INTERRUPTED
        raise interrupted from None if exc is interrupted else exc


def _failed(exc: ValidationError | WorkerError | BrokenPipeError, args: argparse.Namespace) -> int:
    """The exit code, and one line, for the errors a user can act on."""
    if isinstance(exc, ValidationError):
        return _fail(explain_invalid(exc, args), args)
    if isinstance(exc, WorkerError):
        return _fail(exc.message, args)
    # The reader (`| head`) has gone: stop quietly, and let nothing flush into the pipe again.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return ExitCode.PIPE_CLOSED


def _fail(message: str, args: argparse.Namespace) -> int:
    if getattr(args, "debug", False):
        traceback.print_exc()
    # One line, whatever the message carries (a broker's output, a nested error).
    line = " | ".join(part.strip() for part in message.splitlines() if part.strip())
    print(f"mmworker: {line}", file=sys.stderr)
    return ExitCode.USAGE


if __name__ == "__main__":
    raise SystemExit(main())
