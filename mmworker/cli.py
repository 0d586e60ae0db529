"""`mmworker` command line: run, demo, submit, tail, schema, config, tiny-model."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mmworker.errors import WorkerError
from mmworker.exits import ExitCode, Interrupted, stop_on_signals

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


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="TOML file (also MMWORKER_CONFIG)")
    for flag, (path, kind) in _RUN_FLAGS.items():
        p.add_argument(flag, type=kind, dest=path.replace(".", "__"), help=f"sets {path}")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any setting by dotted path, e.g. --set engine.max_num_seqs=64 (value parsed as JSON)",
    )


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """Flags and --set pairs → the nested dict load_config takes (explicit beats env and file)."""
    out: dict[str, Any] = {}
    pairs: list[tuple[str, Any]] = []
    for _flag, (path, _kind) in _RUN_FLAGS.items():
        value = getattr(args, path.replace(".", "__"), None)
        if value is not None:
            pairs.append((path, value))
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep:
            raise WorkerError(f"--set needs KEY=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        pairs.append((key.strip(), value))
    for path, value in pairs:
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _load(args: argparse.Namespace) -> Any:
    from mmworker.config import load_config

    return load_config(args.config, **overrides_from(args))


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _load(args)
    logging.getLogger().setLevel(cfg.log_level)
    if cfg.processes > 1:
        from mmworker.processes import run_processes

        code = run_processes(cfg, create_topics=args.create_topics)
    else:
        from mmworker.app import run_worker

        code = run_worker(cfg, create_topics=args.create_topics)
    _exit_now(code)
    return code  # pragma: no cover - unreachable


def _exit_now(code: int) -> None:
    """Everything that matters is closed by now; a Kafka client thread still waiting on a broker
    that never answered must not hold the exit (thread pools are joined at interpreter exit)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_config(args: argparse.Namespace) -> int:
    if args.reference:
        from mmworker.config_reference import render_reference

        print(render_reference())
        return 0
    print(json.dumps(_load(args).masked(), indent=2))
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from schemas.export import MODELS, render

    names = [args.name] if args.name else list(MODELS)
    for name in names:
        sys.stdout.write(render(MODELS[name]))
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from mmworker.tiny_model import build_tiny_model

    path = build_tiny_model(args.directory, arch=args.arch, seed=args.seed)
    print(f"wrote {args.arch} Qwen2.5-VL (random weights, for testing) to {path}")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from mmworker.tools import submit

    return submit(args)


def cmd_tail(args: argparse.Namespace) -> int:
    from mmworker.tools import tail

    return tail(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from mmworker.demo import run_demo

    return run_demo(keep_going=args.keep)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmworker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="consume jobs and publish captions until SIGTERM")
    _config_args(p)
    p.add_argument("--create-topics", type=int, metavar="PARTITIONS", help="create missing topics")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("demo", help="embedded broker + tiny model + sample jobs, then exit")
    p.add_argument("--keep", action="store_true", help="keep the worker's temp dir for a look")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("submit", help="post jobs for files, directories or URLs")
    p.add_argument("sources", nargs="+", help="image/video files, directories, or http(s) URLs")
    p.add_argument("--bootstrap-servers", default="localhost:9092")
    p.add_argument("--topic", default="mmworker.jobs")
    p.add_argument("--prompt", help="instruction; a default per media kind when absent")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--inline-max-bytes", type=int, default=768 * 1024,
        help="embed files up to this size; larger ones are sent as file:// URIs",
    )  # fmt: skip
    p.add_argument("--repeat", type=int, default=1, help="post each source this many times")
    p.set_defaults(fn=cmd_submit)

    p = sub.add_parser("tail", help="print results and failures")
    p.add_argument("--bootstrap-servers", default="localhost:9092")
    p.add_argument("--topics", nargs="+", default=["mmworker.results", "mmworker.dead-letter"])
    p.add_argument("--follow", "-f", action="store_true", help="keep waiting for new records")
    p.add_argument("--timeout", type=float, default=5.0, help="stop after this long idle")
    p.add_argument("--json", action="store_true", help="raw JSON lines instead of a summary")
    p.set_defaults(fn=cmd_tail)

    p = sub.add_parser("schema", help="print the JSON Schemas of the wire messages")
    p.add_argument("name", nargs="?", choices=["job", "result", "failure"])
    p.set_defaults(fn=cmd_schema)

    p = sub.add_parser("config", help="print the effective config (secrets masked)")
    _config_args(p)
    p.add_argument("--reference", action="store_true", help="every setting, as Markdown")
    p.set_defaults(fn=cmd_config)

    p = sub.add_parser("tiny-model", help="build a random-weight Qwen2.5-VL for tests")
    p.add_argument("directory", type=Path)
    p.add_argument("--arch", choices=["tiny", "3b"], default="tiny")
    p.add_argument("--seed", type=int, default=0)
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
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # kafka-python narrates every connection at INFO; its warnings still show.
    logging.getLogger("kafka").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except ValidationError as exc:
        print(f"mmworker: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:
        print(f"mmworker: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
