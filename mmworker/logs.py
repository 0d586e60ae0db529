"""One logging policy for the worker and the libraries it carries: ours readable, theirs quiet.

vLLM, transformers, torch and kafka-python each log on their own terms (levels, streams, formats),
and vLLM's engine core is a process of its own that configures logging from the environment. Left
alone, a worker start printed ~95 lines of which 2-3 were the worker's, and `log_level = "WARNING"`
hid the worker's ready line but not vLLM's INFO. So `log_level` decides for everyone:

- DEBUG: every library at DEBUG, Python and torch C++ warnings shown: what a bug report needs.
- INFO (the default): the worker at INFO; vLLM and kafka-python at WARNING, minus the warnings
  that every start of this worker produces by its own choices (`KNOWN_NOISE`: eager mode and no
  chunked prefill on CPU, a float32 test model cast to bfloat16, ...); transformers at ERROR (its
  warnings are about its own processors' defaults, and the worker prepares pixels itself); Python
  FutureWarning/DeprecationWarning and torch's C++ warnings off.
- WARNING / ERROR: the libraries at that level too.

The policy travels to vLLM's processes as environment variables, which they read when they start:
`VLLM_LOGGING_CONFIG_PATH` (a dictConfig file: our format, stderr, `KNOWN_NOISE` dropped),
`TRANSFORMERS_VERBOSITY`, `TORCH_CPP_LOG_LEVEL` and `PYTHONWARNINGS`. A variable a person has set
already is left alone: an explicit choice wins over the policy.

`logging.format = "json"` turns every line, vLLM's included, into one JSON object
(python-json-logger): `time`, `level`, `logger`, `message`, `process` (the worker's tag under
`processes > 1`), and on every record logged while a job is being worked on its `job_id`,
`topic`, `partition`, `offset`, and `code` once it has failed: `bind_job` keeps them in a
context variable, which asyncio copies into each job's tasks, and `JobFields` puts them on the
records.

This module is imported inside vLLM's engine core too (the dictConfig names `KnownNoise` and
`json_formatter`), so it imports nothing beyond the standard library at import time.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Literal

LogFormat = Literal["text", "json"]

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Start of the format string of warnings every start of this worker produces by its own choices.
#: Shown again at log_level DEBUG. A message missing here costs one line, never a lost error.
KNOWN_NOISE: tuple[str, ...] = (
    # vLLM on CPU: no Triton, eager mode and no chunked prefill are what the worker asks for there.
    "Triton is installed, but doesn't include CPU backend",
    "Triton is not installed. triton-cpu is expected",
    "Model Runner V2 requires Triton",
    "Enforce eager set",
    "Inductor compilation was disabled",
    "This model does not officially support disabling chunked prefill",
    "Reset SSM cache type",
    "%s is not found in LD_PRELOAD",
    "CPU backend doesn't allow to use `torch.set_num_threads`",
    # The engine's seed is ours (engine.seed); the engine core runs in its own process anyway.
    "The global random seed is set to",
    # A float32 checkpoint (the tiny test model) loaded into bfloat16 parameters: one per weight.
    "Attempted to load weight %s with dtype %s into",
    # kafka-python 3: its I/O thread names every callback that took >100 ms, e.g. a CRC check on a
    # busy 2-core host; it says nothing a worker operator can act on.
    "Task <kafka.net.selector.Task object at ",
)

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

#: Python warnings off in the processes the worker starts (PYTHONWARNINGS), unless DEBUG.
_IGNORED_WARNINGS = (
    "ignore::FutureWarning",
    "ignore::DeprecationWarning",
    # vLLM's engine core holds one named semaphore (the uniprocess executor's worker lock). When
    # vLLM's shutdown has to SIGKILL the engine core (it did not exit within vLLM's 5 s grace, as
    # on a busy host) or the engine died, nobody unregisters it, and multiprocessing's resource
    # tracker, which the whole worker shares, unlinks it at the end, as it is there to do, and
    # says "There appear to be 1 leaked semaphore objects" after an otherwise clean exit. Nothing
    # is left behind; only the message goes.
    "ignore:resource_tracker:UserWarning",
)

#: Environment values this process set, so a later call (the level became known) may change them
#: but a value a person set is never touched.
_SET_BY_US: dict[str, str] = {}


class KnownNoise(logging.Filter):
    """Drops `KNOWN_NOISE` records; compares the unformatted message, so nothing is rendered."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        return not msg.startswith(KNOWN_NOISE)


class _OurHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The root handler this module installed (and may reconfigure)."""


#: The fields of the job the current task works on (see `bind_job`).
JOB_FIELDS = ("job_id", "topic", "partition", "offset", "code")
_job: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("job", default=None)


def bind_job(**fields: Any) -> None:
    """Name the job this task (and the tasks it starts) works on, for every record it logs.
    Fields accumulate: the source first, the job id once parsed, the code once failed."""
    known = {k: v for k, v in fields.items() if v is not None}
    _job.set({**(_job.get() or {}), **known})


class JobFields(logging.Filter):
    """Copies the bound job's fields onto each record (where the record has none of its own, so
    an explicit `extra=` wins); never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in (_job.get() or {}).items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def json_formatter(tag: str | None = None) -> logging.Formatter:
    """One JSON object per line. A factory (dictConfig's "()") so vLLM's processes build it too;
    python-json-logger is imported here, not when this module is."""
    from pythonjsonlogger.json import JsonFormatter

    return JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        static_fields={"process": tag} if tag else None,
    )


def library_level(level: str) -> str:
    """The level of vLLM and kafka-python for the worker's `level`."""
    return "DEBUG" if level == "DEBUG" else max(level, "WARNING", key=_LEVELS.index)


def vllm_level(level: str) -> str:
    """vLLM's level for the worker's `level`: a VLLM_LOGGING_LEVEL a person exported wins (it is
    how one asks for vLLM's own start-up lines: weights, compile, KV cache size, CUDA graphs),
    else `library_level`. Our own earlier value of the variable is not a person's choice."""
    person = os.environ.get("VLLM_LOGGING_LEVEL", "").upper()
    if person in _LEVELS and _SET_BY_US.get("VLLM_LOGGING_LEVEL", "").upper() != person:
        return person
    return library_level(level)


def setup(level: str = "INFO", tag: str | None = None, fmt: LogFormat = "text") -> None:
    """This process's logging: a stderr handler with our format on the root logger (unless one is
    there already, e.g. pytest's), `KNOWN_NOISE` dropped unless DEBUG, kafka-python's level."""
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(_OurHandler(sys.stderr))
    name = f"[{tag}] %(name)s" if tag else "%(name)s"
    for handler in root.handlers:
        if isinstance(handler, _OurHandler):
            handler.setFormatter(
                json_formatter(tag)
                if fmt == "json"
                else logging.Formatter(FORMAT.replace("%(name)s", name))
            )
        if not any(isinstance(f, JobFields) for f in handler.filters):
            handler.addFilter(JobFields())
    root.setLevel(level)
    _library_loggers(level)


def _library_loggers(level: str) -> None:
    """This process's share of the policy: library logger levels, `KNOWN_NOISE` off the root
    handlers (whoever installed them), FutureWarnings."""
    for handler in logging.getLogger().handlers:
        for old in [f for f in handler.filters if isinstance(f, KnownNoise)]:
            handler.removeFilter(old)
        if level != "DEBUG":
            handler.addFilter(KnownNoise())
    logging.getLogger("kafka").setLevel(library_level(level))
    logging.getLogger("vllm").setLevel(vllm_level(level))
    if level != "DEBUG":
        warnings.filterwarnings("ignore", category=FutureWarning)


def quiet_kafka_for_clients(level: str, asked: bool) -> None:
    """The commands a person runs against Kafka (`submit`, `tail`, `backfill`, `replay`) say
    themselves that the brokers are lost or refuse a job, in one line; kafka-python's own
    ERROR/WARNING per failed attempt (47 lines in 30 s of a lost broker) is then only noise, so
    it is off unless asked for (`--debug`, or `log_level` DEBUG): then at `library_level`."""
    shown = asked or level == "DEBUG"
    logging.getLogger("kafka").setLevel(library_level(level) if shown else logging.CRITICAL + 1)


def quiet_libraries(level: str, fmt: LogFormat = "text") -> None:
    """Carry the policy to the processes vLLM (and the preprocessing pool) will start, through
    the environment they inherit. Must run before vLLM is imported and its engine built."""
    _library_loggers(level)
    lib = library_level(level)
    env = {
        "VLLM_LOGGING_LEVEL": lib,
        "TRANSFORMERS_VERBOSITY": "debug" if level == "DEBUG" else "error",
        "VLLM_LOGGING_CONFIG_PATH": "",  # below, only when it is ours to write
    }
    if level != "DEBUG":
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        env["PYTHONWARNINGS"] = ",".join(_IGNORED_WARNINGS)
    for key, value in env.items():
        if key in os.environ and _SET_BY_US.get(key) != os.environ[key]:
            continue  # a person's choice
        chosen = value
        if key == "VLLM_LOGGING_CONFIG_PATH":
            # The file is what vLLM applies: a person's VLLM_LOGGING_LEVEL must reach it, or
            # their INFO is silently cut at our handler's WARNING.
            chosen = str(
                vllm_logging_config(vllm_level(level), drop_noise=level != "DEBUG", fmt=fmt)
            )
        os.environ[key] = _SET_BY_US[key] = chosen
    for key in set(_SET_BY_US) - set(env):  # DEBUG after INFO: warnings back on
        if os.environ.get(key) == _SET_BY_US.pop(key):
            del os.environ[key]


def vllm_logging_config(level: str, drop_noise: bool, fmt: LogFormat = "text") -> Path:
    """Write (once per content) the dictConfig vLLM applies in each of its processes."""
    handler: dict[str, object] = {
        "class": "logging.StreamHandler",
        "stream": "ext://sys.stderr",
        "formatter": "mmworker",
        "level": level,
    }
    formatter: dict[str, object] = (
        {"()": f"{__name__}.json_formatter"} if fmt == "json" else {"format": FORMAT}
    )
    config: dict[str, object] = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"mmworker": formatter},
        "handlers": {"mmworker": handler},
        "loggers": {"vllm": {"handlers": ["mmworker"], "level": level, "propagate": False}},
    }
    filters: dict[str, object] = {"job": {"()": f"{__name__}.JobFields"}}
    handler["filters"] = ["job"]
    if drop_noise:
        filters["noise"] = {"()": f"{__name__}.KnownNoise"}
        handler["filters"] = ["job", "noise"]
    config["filters"] = filters
    text = json.dumps(config, indent=1, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    # The file can run code (dictConfig's "()"), so it lives in a directory of this user, never
    # under a predictable name in a shared /tmp.
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mmworker"
    path = home / f"vllm-logging-{digest}.json"
    try:
        if not path.is_file() or path.read_text() != text:
            home.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(text)
            tmp.replace(path)
    except OSError:  # read-only home: a private temporary file (O_EXCL, mode 0600) instead
        fd, name = tempfile.mkstemp(prefix="mmworker-vllm-logging-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        path = Path(name)
    return path
