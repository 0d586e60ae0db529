"""The benchmarks are run by hand, not by CI, so CI checks what would break them silently: an
import of a name that a refactor moved (imports inside functions included, which `--help`
never reaches), and each script's `--help`."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = sorted((ROOT / "bench").rglob("*.py"))
SCRIPTS = [p for p in BENCH if '__name__ == "__main__"' in p.read_text()]


def _bench_imports(path: Path) -> list[tuple[str, str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench"):
            out += [(node.module or "", alias.name, node.lineno) for alias in node.names]
    return out


@pytest.mark.parametrize("path", BENCH, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_a_benchmark_imports_from_bench_exists(path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    try:
        for module, name, line in _bench_imports(path):
            mod = importlib.import_module(module)
            submodule = hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.{name}")
            assert hasattr(mod, name) or submodule, f"{path.name}:{line}: {module} has no {name}"
    finally:
        sys.path.remove(str(ROOT))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_benchmark_script_answers_help(path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(path), "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()
