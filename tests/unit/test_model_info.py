"""vLLM's look at the model class, taken ahead of the engine's start (`mmworker.engine.model_info`):
the file it writes must be the one vLLM's own registry then reads instead of starting its own
process, and a failed look must leave vLLM to do its own."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mmworker.engine import model_info, pixels


def _model(directory: Path, archs: list[str]) -> str:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"architectures": archs}))
    return str(directory)


def test_the_architecture_is_the_one_the_engine_will_resolve(tmp_path: Path) -> None:
    qwen = _model(tmp_path / "q", ["Qwen2_5_VLForConditionalGeneration"])
    assert model_info.architectures(qwen, pixels_on_engine=True) == [pixels.ARCHITECTURE]
    assert model_info.architectures(qwen, pixels_on_engine=False) == [
        "Qwen2_5_VLForConditionalGeneration"
    ]
    other = _model(tmp_path / "o", ["LlavaForConditionalGeneration"])
    assert model_info.architectures(other, pixels_on_engine=True) == [
        "LlavaForConditionalGeneration"
    ]
    assert model_info.architectures(str(tmp_path / "missing"), True) == []


def test_nothing_starts_for_a_model_not_listed_or_a_file_already_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    assert model_info.inspect_ahead(_model(tmp_path / "o", ["LlavaNext"]), True) is None
    qwen = _model(tmp_path / "q", ["Qwen2_5_VLForConditionalGeneration"])
    there = model_info.cache_file(pixels.ARCHITECTURE)
    assert there is not None
    there.parent.mkdir(parents=True)
    there.write_text("{}")
    assert model_info.inspect_ahead(qwen, True) is None


@pytest.mark.parametrize("arch", [pixels.ARCHITECTURE, "Qwen2_5_VLForConditionalGeneration"])
def test_the_cache_file_is_named_as_vllm_names_it(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The name is vLLM's private convention: pinned here against the installed vLLM."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    from vllm.model_executor.models.registry import ModelRegistry

    pixels.register()
    registered = ModelRegistry.models[arch]
    assert model_info.cache_file(arch) == (
        Path(tmp_path) / "modelinfos" / registered._get_cache_filename()  # type: ignore[attr-defined]
    )


def test_vllm_reads_the_answer_taken_ahead_instead_of_starting_its_own_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    # A config.json is all the look reads: the tiny model itself may not be built yet here.
    model = _model(tmp_path / "q", ["Qwen2_5_VLForConditionalGeneration"])
    inspecting = model_info.inspect_ahead(model, pixels_on_engine=True)
    assert inspecting is not None, "new caches: the look is taken"
    inspecting.wait()
    assert inspecting.process.returncode == 0
    from vllm.model_executor.models import registry

    pixels.register()

    def no_process(fn: object) -> object:
        raise AssertionError("vLLM started its own inspection process")

    monkeypatch.setattr(registry, "_run_in_subprocess", no_process)
    found = registry.ModelRegistry.models[pixels.ARCHITECTURE].inspect_model_cls()
    assert found.supports_multimodal
    assert model_info.inspect_ahead(model, pixels_on_engine=True) is None, "now on disk"


def test_a_failed_look_is_a_warning_not_a_failed_start(caplog: pytest.LogCaptureFixture) -> None:
    err = tempfile.TemporaryFile()  # noqa: SIM115 (closed by wait)
    failing = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.exit('no such model class')"], stderr=err
    )
    inspection = model_info.Inspection(failing, ["X"], time.monotonic(), err)
    with caplog.at_level(logging.WARNING, logger="mmworker.engine.model_info"):
        inspection.wait()
    assert "model info for X failed (exit 1): vLLM looks itself. no such model class" in (
        caplog.text
    )
    assert err.closed
