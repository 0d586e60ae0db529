"""The pieces of the CUDA-stub repair, on small libraries compiled here (no torch needed).

The stand-ins must satisfy the dynamic loader (soname, symbol versions, load-time registration
calls) yet fail loudly, naming the symbol, if CUDA code is ever reached.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mmworker.devkit import torchvision_repair as tr

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

CUDART = "libcudart.so.13"


def _plan() -> tr.Plan:
    plan = tr.Plan()
    for name, is_object in (
        ("_ZN3c104cuda12device_countEv", False),
        ("_ZN3c104cuda20CUDACachingAllocator9allocatorE", True),
    ):
        plan.common_symbols[name] = tr.UndefinedSymbol(name, is_object, False, None)
    for name in ("cudaGetDevice", "__cudaRegisterFatBinary"):
        plan.versioned_symbols.setdefault(CUDART, {})[name] = tr.UndefinedSymbol(
            name, False, False, (CUDART, CUDART)
        )
    plan.required_versions[CUDART] = {CUDART}
    plan.missing_sonames = {CUDART}
    return plan


@pytest.fixture
def stub(tmp_path: Path) -> Path:
    return tr.build_stub(CUDART, _plan(), tmp_path, "gcc")


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def test_stub_has_soname_symbols_and_version(stub: Path) -> None:
    info = tr.read_elf(stub)
    assert stub.name == CUDART and info.soname == CUDART
    assert {
        "_ZN3c104cuda12device_countEv",
        "_ZN3c104cuda20CUDACachingAllocator9allocatorE",
        "cudaGetDevice",
        "__cudaRegisterFatBinary",
    } <= info.defined
    if shutil.which("readelf"):
        versions = subprocess.run(
            ["readelf", "-V", str(stub)], capture_output=True, text=True, check=True
        ).stdout
        assert f"Name: {CUDART}" in versions


def test_load_time_calls_succeed_and_cuda_calls_abort_with_name(stub: Path) -> None:
    ok = _python(
        f"""
        import ctypes
        lib = ctypes.CDLL({str(stub)!r})
        lib.__cudaRegisterFatBinary.restype = ctypes.c_void_p
        assert lib.__cudaRegisterFatBinary(None)
        obj = ctypes.c_char.in_dll(lib, "_ZN3c104cuda20CUDACachingAllocator9allocatorE")
        assert obj.value == b"\\x00"
        """
    )
    assert ok.returncode == 0, ok.stderr
    dead = _python(f"import ctypes; ctypes.CDLL({str(stub)!r}).cudaGetDevice()")
    assert dead.returncode != 0
    assert "cudaGetDevice" in dead.stderr and "CPU build" in dead.stderr


def test_patch_rpath_prepends_once_and_keeps_rpath_kind(tmp_path: Path) -> None:
    src = tmp_path / "ext.c"
    src.write_text("int ext_answer(void) { return 42; }\n")
    ext = tmp_path / "pkg" / "ext.so"
    ext.parent.mkdir()
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-Wl,--disable-new-dtags",
            "-Wl,-rpath,/nowhere",
            "-o",
            ext,
            src,
        ],
        check=True,
    )
    stub_dir = tmp_path / tr.STUB_DIR_NAME
    try:
        patchelf = tr.find_patchelf()
    except tr.RepairError as err:
        pytest.skip(str(err))
    assert tr.patch_rpath(ext, stub_dir, patchelf) is True
    assert tr.patch_rpath(ext, stub_dir, patchelf) is False  # idempotent
    info = tr.read_elf(ext, symbols=False)
    assert info.has_rpath_tag and not info.has_runpath_tag
    assert info.rpath == ["$ORIGIN/../mmworker_cuda_stubs", "/nowhere"]


def test_torch_cuda_build_is_read_from_version_file(tmp_path: Path) -> None:
    torch_dir = tmp_path / "torch"
    torch_dir.mkdir()
    version = torch_dir / "version.py"
    version.write_text("from typing import Optional\ncuda: Optional[str] = None\n")
    assert tr.torch_is_cuda_build(tmp_path) is False
    version.write_text("from typing import Optional\ncuda: Optional[str] = '13.0'\n")
    assert tr.torch_is_cuda_build(tmp_path) is True
    assert tr.torch_is_cuda_build(tmp_path / "absent") is None
