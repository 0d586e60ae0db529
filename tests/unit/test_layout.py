"""The package layout a user installs, and the line between the runtime and development tooling."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Repository folder → the package it installs as (pyproject's package-dir).
FOLDERS = {
    "mmworker": "mmworker",
    "schemas": "mmworker.schemas",
    "preprocess": "mmworker.preprocess",
}


def _packages_on_disk() -> set[str]:
    found = set()
    for folder, name in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join((name, *rel.parts)) if rel.parts else name)
    return found


def test_pyproject_lists_every_package_folder() -> None:
    """setuptools' explicit list is what ships: a subpackage missing from it would be absent
    from the wheel while every test run from the checkout still passed."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(tool["packages"]) == _packages_on_disk()
    assert tool["package-dir"] == {
        "mmworker.schemas": "schemas",
        "mmworker.preprocess": "preprocess",
    }


def test_no_generic_top_level_packages_are_installed(tmp_path: Path) -> None:
    """Outside the checkout (so the working directory does not put the folders on sys.path)
    the installed packages are mmworker.schemas/mmworker.preprocess, and the generic names are free
    for the user's own packages."""
    code = (
        "import importlib.util, mmworker.schemas, mmworker.preprocess.prepare\n"
        "print(importlib.util.find_spec('schemas'), importlib.util.find_spec('preprocess'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["None", "None"], out.stdout


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at module level?) for every import in a file."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, id(node) in top))
    return found


def test_runtime_never_imports_the_devkit() -> None:
    """Production code reads apart from tooling: only the CLI's development commands (demo,
    broker, tiny-model, and `run` on the embedded defaults) reach mmworker.devkit, and only inside
    the function that needs it."""
    offenders = []
    for path in sorted((ROOT / "mmworker").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[1] == "devkit":
            continue
        for module, at_top in _imports(path):
            if not module.startswith("mmworker.devkit"):
                continue
            if rel.as_posix() == "mmworker/cli.py" and not at_top:
                continue
            offenders.append(f"{rel}: {module}")
    assert not offenders, offenders


def test_importing_every_runtime_module_loads_no_devkit_module() -> None:
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "mmworker").rglob("*.py")
        if "devkit" not in p.parts and p.name != "__main__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m.startswith('mmworker.devkit')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
