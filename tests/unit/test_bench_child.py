"""bench/child.run_for_json with real child processes: the result a child wrote, or an error that
carries the child's last words; never a result left over from an earlier run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.child import run_for_json


def _child(tmp_path: Path, code: str) -> dict[str, object]:
    """Run `code`, which finds the result's path in sys.argv[1]."""
    result = tmp_path / "result.json"
    return run_for_json(
        [sys.executable, "-c", code, str(result)],
        result,
        tmp_path / "child.log",
        env=dict(os.environ),
        timeout_s=60,
        what="the child",
    )


def test_the_result_the_child_wrote_comes_back_with_its_log(tmp_path: Path) -> None:
    write = "import sys; print('loading'); open(sys.argv[1], 'w').write('{\"jobs_per_s\": 2.5}')"
    doc = _child(tmp_path, write)
    assert doc == {"jobs_per_s": 2.5, "log": str(tmp_path / "child.log")}
    assert (tmp_path / "child.log").read_text().strip() == "loading"


def test_a_failed_child_is_an_error_with_the_end_of_its_log(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"(?s)the child exited 3:.*engine died"):
        _child(tmp_path, "import sys; print('engine died', flush=True); sys.exit(3)")


def test_a_child_that_exits_0_without_a_result_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "result.json").write_text('{"jobs_per_s": 99}')  # an earlier run's
    with pytest.raises(RuntimeError, match="the child exited 0"):
        _child(tmp_path, "print('forgot to write')")
    assert not (tmp_path / "result.json").exists()
