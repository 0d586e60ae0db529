"""Benchmark children: a peer that loads its own engine runs in a process of its own (its GPU
memory and threads go when it exits, and a crash is a row marked failed, not a lost run); it
writes its result as JSON, and its output goes to a log kept beside the result."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from bench.common import ROOT


def run_for_json(
    cmd: list[str], result: Path, log: Path, *, env: dict[str, str], timeout_s: float, what: str
) -> dict[str, Any]:
    """Run `cmd` and return the JSON document it wrote to `result`, with `log` named in it.
    A non-zero exit, or no result, is a RuntimeError that ends with the log's last lines."""
    result.unlink(missing_ok=True)  # a result left by an earlier run must not pass for this one
    with log.open("wb") as out:
        proc = subprocess.run(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            timeout=timeout_s,
            check=False,
        )
    if proc.returncode != 0 or not result.exists():
        text = log.read_text(errors="replace")
        raise RuntimeError(f"{what} exited {proc.returncode}:\n{text[-3000:]}")
    doc: dict[str, Any] = json.loads(result.read_text())
    doc["log"] = str(log)
    return doc
