"""The CUDA-stub repair (mmworker.devkit.torchvision_repair) leaves a venv where vLLM imports.

Checked in fresh interpreters: a failed extension load poisons the process that tried it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from mmworker.devkit import torchvision_repair

pytestmark = pytest.mark.integration


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def test_torchvision_and_vllm_import_and_nms_runs_on_cpu() -> None:
    proc = _run(
        """
        import torch, torchvision, vllm
        from vllm import LLM
        from torchvision.ops import nms, roi_align
        boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0], [20.0, 20, 30, 30]])
        keep = nms(boxes, torch.tensor([0.9, 0.8, 0.7]), iou_threshold=0.5)
        assert keep.tolist() == [0, 2], keep
        rois = torch.tensor([[0.0, 0.0, 0.0, 4.0, 4.0]])
        pooled = roi_align(torch.ones(1, 1, 8, 8), rois, output_size=(2, 2))
        assert torch.allclose(pooled, torch.ones(1, 1, 2, 2))
        print("ok", torchvision.__version__)
        """
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ok" in proc.stdout


def test_repair_is_idempotent() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mmworker.devkit.torchvision_repair"],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "skipped" in proc.stdout


@pytest.mark.skipif(shutil.which("readelf") is None, reason="binutils' readelf not installed")
def test_elf_reader_agrees_with_readelf() -> None:
    """The repair parses ELF itself; readelf is the reference for what it must see."""
    site = torchvision_repair.default_site_packages()
    ext = site / "torchvision" / "_C.so"
    if not ext.is_file():
        pytest.skip("torchvision is not installed")
    info = torchvision_repair.read_elf(ext)
    dynamic = subprocess.run(
        ["readelf", "-dW", str(ext)], capture_output=True, text=True, check=True
    ).stdout
    needed = [
        line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line
    ]
    assert info.needed == needed
    symbols = subprocess.run(
        ["readelf", "--dyn-syms", "-W", str(ext)], capture_output=True, text=True, check=True
    ).stdout
    undefined = set()
    for line in symbols.splitlines():
        fields = line.split()
        if len(fields) >= 8 and fields[6] == "UND" and fields[4] == "GLOBAL":
            undefined.add(fields[7].split("@", 1)[0])
    assert {s.name for s in info.undefined} == undefined
