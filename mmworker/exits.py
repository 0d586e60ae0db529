"""The worker's exit codes, in one place: orchestrators and the README read them.

An orchestrator restarts on any non-zero code; the codes tell an operator what to look at.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from enum import IntEnum
from types import FrameType


class ExitCode(IntEnum):
    #: Stopped as asked (SIGTERM/SIGINT): in-flight jobs drained, or none had started yet.
    OK = 0
    #: A worker process of a `processes = N` set failed to start.
    START_FAILED = 1
    #: Configuration or usage error, found before any job was taken.
    USAGE = 2
    #: The engine died more often than `limits.engine_restarts` allows in its window, or a new
    #: core could not start; nothing further was committed and the jobs inside it are suspects.
    ENGINE_DEAD = 3
    #: The broker refuses our records for a whole topic (authorization, invalid name).
    PUBLISH_REFUSED = 4
    #: A bug: a job or the poll loop failed with an error no code path expected.
    INTERNAL = 5
    #: A second SIGTERM/SIGINT: stop at once, without draining (jobs are redelivered).
    INTERRUPTED = 130
    #: A command's reader went away (`mmworker tail | head`): what a shell reports for SIGPIPE.
    PIPE_CLOSED = 141


class Interrupted(BaseException):
    """SIGTERM/SIGINT before the worker consumes: unwinds start-up (model load, broker connect)
    so the process stops at once, with `ExitCode.OK`. A BaseException, so that no
    `except Exception` in a library on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_on_signals() -> None:
    """Installed on the first line of the program: from then on a signal has a defined effect.
    The first SIGTERM/SIGINT raises `Interrupted` in the main thread; a second one exits at once.
    The poll loop later replaces these with handlers that drain in-flight jobs."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        if _seen:
            os._exit(ExitCode.INTERRUPTED)
        _seen.append(signum)
        raise Interrupted(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


#: Signals `stop_on_signals`' handler has taken: kept because the `Interrupted` it raises can
#: land inside a library that swallows every exception (seen: a SIGTERM at main's first line,
#: during the heavy imports, was lost and the worker went on to consume).
_seen: list[int] = []


def check_interrupted() -> None:
    """Raise `Interrupted` again if a start-up signal was taken: called at the start-up steps, so
    a swallowed one still stops the worker before it consumes."""
    if _seen:
        raise Interrupted(_seen[0])


def signal_behind(exc: BaseException) -> Interrupted | None:
    """The signal an error stands for, if a start-up signal was taken: the handler's
    `Interrupted` raised while a library runs code of ours can come out as that library's own
    error (one CI run: a SIGINT during pydantic's `model_dump_json` came out as
    `PydanticSerializationError: Interrupted: SIGINT`, and `backfill` exited 1, not 130).
    Commands that promise 130 on a signal ask this of any error before reporting it."""
    if isinstance(exc, Interrupted):
        return exc
    return Interrupted(_seen[0]) if _seen else None


def exit_now(code: int) -> None:
    """Leave without the interpreter's exit hooks, once everything that matters is closed: a
    Kafka client thread still waiting on a broker that never answered, or a thread waiting for a
    start signal that will never come, must not hold the exit (thread pools are joined then)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
