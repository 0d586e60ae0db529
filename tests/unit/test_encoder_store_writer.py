"""The encoder store's background writer: every submitted output is on disk once it is closed,
in order, and a writer that falls behind drops outputs instead of holding memory without bound.
(On CPU there is no device copy to wait for; the GPU half, the pinned copy and its event, runs
in the H200 benchmarks.)"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch

from mmworker.engine.encoder_store import BackgroundWriter


def _save(final: str, tensor: torch.Tensor) -> None:
    safetensors.torch.save_file({"ec_cache": tensor.contiguous()}, final)


def test_every_submitted_output_is_written_by_close(tmp_path: Path) -> None:
    writer = BackgroundWriter(_save)
    tensors = {str(tmp_path / f"{i}.safetensors"): torch.full((4, 8), float(i)) for i in range(50)}
    for final, tensor in tensors.items():
        writer.submit(final, tensor)
    writer.close()
    assert writer.dropped == 0
    for final, tensor in tensors.items():
        assert torch.equal(safetensors.torch.load_file(final)["ec_cache"], tensor)


def test_a_writer_behind_drops_outputs_past_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(BackgroundWriter, "MAX_PENDING", 3)
    gate, busy = threading.Event(), threading.Event()
    written: list[str] = []

    def slow(final: str, tensor: torch.Tensor) -> None:
        busy.set()
        gate.wait(10)
        written.append(final)

    writer = BackgroundWriter(slow)
    writer.submit(str(tmp_path / "0"), torch.zeros(1))
    assert busy.wait(10)  # the thread holds the first
    for i in range(1, 10):  # three wait, six find the queue full
        writer.submit(str(tmp_path / str(i)), torch.zeros(1))
    gate.set()
    writer.close()
    assert writer.dropped == 6
    assert len(written) == 4


def test_an_entry_cut_short_or_out_of_reach_is_computed_again_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM loads an entry inside the engine core, where its error kills the core: an entry
    left empty or cut by a host crash killed it for every job of that media, on every worker
    sharing the store (dead-lettered as engine_crash); a utime refused likewise."""
    import os
    from types import SimpleNamespace

    from mmworker.engine.encoder_store import FILE_NAME, DiskEncoderStore

    store = SimpleNamespace(identity="id", _storage_path=str(tmp_path))
    whole = tmp_path / "whole" / FILE_NAME
    whole.parent.mkdir()
    _save(str(whole), torch.ones(64, 32))
    data = whole.read_bytes()
    for name, content in [("empty", b""), ("cut", data[:-100]), ("header-only", data[:20])]:
        entry = tmp_path / name / FILE_NAME
        entry.parent.mkdir()
        entry.write_bytes(content)
        assert DiskEncoderStore.has_cache_item(store, name) is False, name  # type: ignore[arg-type]
        assert not entry.exists(), name  # removed: the next use computes and stores it again
    assert DiskEncoderStore.has_cache_item(store, "whole") is True  # type: ignore[arg-type]
    assert DiskEncoderStore.has_cache_item(store, "never-stored") is False  # type: ignore[arg-type]

    def refused(path: str) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "utime", refused)
    assert DiskEncoderStore.has_cache_item(store, "whole") is False  # type: ignore[arg-type]
