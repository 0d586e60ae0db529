"""A start-up signal has its effect even when a library swallows the exception it raises."""

from __future__ import annotations

import subprocess
import sys

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
