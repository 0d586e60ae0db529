"""A start-up signal has its effect even when a library swallows the exception it raises; exit
codes have one definition."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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
