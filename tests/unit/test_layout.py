"""The package layout a user installs, and the line between the runtime and development tooling."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Repository folder → the package it installs as (pyproject's package-dir).
FOLDERS = {
    "mmworker": "mmworker",
    "schemas/mmworker_schemas": "mmworker_schemas",
    "preprocess/mmworker_preprocess": "mmworker_preprocess",
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
        "mmworker_schemas": "schemas/mmworker_schemas",
        "mmworker_preprocess": "preprocess/mmworker_preprocess",
    }


def test_no_generic_top_level_packages_are_installed(tmp_path: Path) -> None:
    """Outside the checkout (so the working directory does not put the folders on sys.path)
    the installed packages are mmworker_schemas/mmworker_preprocess, and the generic names are free
    for the user's own packages."""
    code = (
        "import importlib.util, mmworker_schemas, mmworker_preprocess.prepare\n"
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


def test_schemas_build_alone_as_their_own_distribution(tmp_path: Path) -> None:
    """Producers and consumers may depend on the wire contract alone (`pip install ./schemas`):
    the wheel holds the package and its JSON Schemas, nothing of the worker, and it imports
    without the worker installed."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         str(ROOT / "schemas"), "-w", str(tmp_path)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("mmworker_schemas-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = {n for n in z.namelist() if ".dist-info/" not in n}
        z.extractall(tmp_path / "site", members=names)
    on_disk = {
        p.relative_to(ROOT / "schemas").as_posix()
        for p in (ROOT / "schemas" / "mmworker_schemas").rglob("*")
        if p.suffix in (".py", ".json")
    }
    assert names == on_disk
    # -S: no site-packages, so neither the worker nor its editable install can be imported; only
    # pydantic's folder is put beside the unpacked wheel.
    import pydantic

    paths = [str(tmp_path / "site"), str(Path(pydantic.__file__).parents[1])]
    code = (
        f"import sys; sys.path[:0] = {paths!r}; import mmworker_schemas as s; "
        "print(s.__file__, s.Job.__name__, 'mmworker' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    where, job, worker = out.stdout.split()
    assert where.startswith(str(tmp_path / "site")) and job == "Job" and worker == "False"
