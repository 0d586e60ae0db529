"""A start-up signal has its effect even when a library swallows the exception it raises; exit
codes have one definition."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from mmworker.exits import ExitCode

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import os, signal
from mmworker.exits import Interrupted, check_interrupted, stop_on_signals
stop_on_signals()
try:
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal, delivered here
    except BaseException:  # a library on the way that swallows everything
        pass
    print("swallowed", flush=True)
    check_interrupted()
    print("went on", flush=True)
except Interrupted as exc:
    print("stopped", exc, flush=True)
"""


def test_a_swallowed_start_up_signal_still_stops_at_the_next_check() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split("\n")
    assert out[:2] == ["swallowed", "stopped SIGTERM"], out


_WRAPPED = """
import os, signal
from pydantic import BaseModel, field_serializer
import mmworker.backfill
from mmworker.exits import signal_behind, stop_on_signals

class Job(BaseModel):
    uri: str = "file:///a.png"

    @field_serializer("uri")
    def _signalled(self, uri: str) -> str:
        os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, taken while pydantic serializes
        return uri

def _backfill(args, cfg):
    try:
        return Job().model_dump_json()
    except Exception as exc:
        print(type(exc).__name__, flush=True)  # what reaches the command's handler
        raise

stop_on_signals()
print("before", signal_behind(ValueError("a real error")), flush=True)
mmworker.backfill._backfill = _backfill
print("backfill exits", mmworker.backfill.backfill(None, None), flush=True)
"""


def test_a_signal_that_a_library_wraps_in_its_own_error_is_still_a_signal() -> None:
    """One CI run: Ctrl-C during the backfill's `model_dump_json` came out as pydantic's error,
    and the backfill exited 1 with a traceback instead of 130 and "run the same command"."""
    done = subprocess.run(
        [sys.executable, "-c", _WRAPPED], capture_output=True, text=True, timeout=60, check=False
    )
    out = done.stdout.splitlines()
    assert out == [
        "before None",  # an error with no signal taken is not one
        "PydanticSerializationError",
        "backfill exits 130",
    ], done.stderr[-2000:]
    assert "stopped; run the same command to resume" in done.stderr


_OURS_WRAPPED = """
import os, signal, sys, time
import mmworker.cli as cli
from mmworker.errors import ConfigError

def broker_step(args):
    try:
        os.kill(os.getpid(), signal.SIG{sig})
        time.sleep(5)  # the handler raises before this ends
    except BaseException as exc:  # a step of ours that turns what it meets into a user error
        raise ConfigError("cannot reach the brokers") from exc

setattr(cli, "cmd_" + sys.argv[1], broker_step)
print("exit", cli.main(sys.argv[1:]), flush=True)
"""


@pytest.mark.parametrize(
    ("command", "sig", "code"),
    [(["status"], "TERM", ExitCode.OK), (["submit", "a.png"], "INT", ExitCode.INTERRUPTED)],
)
def test_a_signal_wrapped_in_a_user_error_exits_as_the_signal(
    command: list[str], sig: str, code: int
) -> None:
    """Not with exit 2 and "mmworker: cannot reach the brokers": an orchestrator's SIGTERM is a
    stop as asked (0), and Ctrl-C of a posting command is 130, whatever error it caused."""
    done = subprocess.run(
        [sys.executable, "-c", _OURS_WRAPPED.replace("{sig}", sig), *command],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.stdout.splitlines() == [f"exit {code}"], done.stderr[-2000:]
    assert "cannot reach the brokers" not in done.stderr


_WATCHED = """
import os, signal, time
from types import SimpleNamespace
import mmworker.status as status
from mmworker.exits import signal_behind, stop_on_signals

class Reader:
    def __init__(self, kafka):
        pass

    def read(self, recent_s):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except BaseException as exc:
            raise status.GroupQueryError("the brokers did not answer") from exc

    def close(self):
        pass

status.StatusReader = Reader
stop_on_signals()
try:
    status.run_status(SimpleNamespace(kafka=None), as_json=True, watch_s=0.1, since="1h")
except Exception as exc:
    print("ended by", signal_behind(exc), flush=True)
"""


def test_status_watch_ends_at_a_ctrl_c_that_came_out_as_a_broker_error() -> None:
    """`status -w` outlives brokers that do not answer; it took a Ctrl-C wrapped in that error
    for one of them, said "again in 0.1s", and only a second Ctrl-C ended it (exit 130)."""
    done = subprocess.run(
        [sys.executable, "-c", _WATCHED], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout.splitlines()) == (0, ["ended by SIGINT"]), done.stderr


_BUG = """
import sys
import mmworker.cli as cli

def broken(args):
    raise KeyError("job_id")

setattr(cli, "cmd_" + sys.argv[1], broken)
print("exit", cli.main(sys.argv[1:]), flush=True)
"""


@pytest.mark.parametrize(
    "command", [["backfill", "m.jsonl", "--out", "o.jsonl"], ["submit", "a.png"], ["replay"]]
)
def test_a_bug_in_a_posting_command_is_exit_5_not_1(command: list[str]) -> None:
    """Python's own exit for an unexpected error is 1, which these commands give for "some rows
    or sources failed": a script took the retry manifest of a run that never finished."""
    done = subprocess.run(
        [sys.executable, "-c", _BUG, *command], capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert done.stdout.splitlines() == [f"exit {ExitCode.INTERNAL}"], done.stderr[-2000:]
    assert "KeyError: 'job_id'" in done.stderr  # the traceback, for the bug report


def test_exit_codes_are_defined_once() -> None:
    """Orchestrators and the README read the codes: a second constant for one of them could
    drift from `ExitCode` unseen."""
    assert ExitCode.PIPE_CLOSED == 141  # what a shell reports for a process killed by SIGPIPE
    offenders = []
    for path in sorted((ROOT / "mmworker").rglob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("EXIT_")]
    assert not offenders, offenders
