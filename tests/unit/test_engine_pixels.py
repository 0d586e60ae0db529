"""The pixel path hands the vision encoder exactly what vLLM's processor path does.

vLLM's own multimodal processor for the tiny Qwen2.5-VL checkpoint is run twice on the same
prepared media: once as the worker used to call it (PIL image, frames + metadata) and once with
`pixels.RawPixels` through the registered pixel-path class. Compared bit for bit: the prompt's
token ids (placeholder expansion), the placeholder ranges, the patch grids and the encoder's
patches after `Patchify.layout` (and `normalize`, where vLLM 0.25 normalises in the front end);
the M-RoPE time step against its definition; `Patchify.normalize` against transformers'
own image and video processors (what vLLM 0.25 runs in its front end).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mmworker_preprocess.params import PreparedImage, PreparedVideo

from mmworker.engine import pixels
from mmworker.engine.video_metadata import vllm_video_metadata


@cache
def _vllm_failure() -> str | None:
    try:
        importlib.import_module("vllm.multimodal")
    except (ImportError, RuntimeError, OSError) as exc:
        return f"`import vllm.multimodal` fails here ({type(exc).__name__}: {exc})"
    return None


_RNG = np.random.default_rng(3)
IMAGE = PreparedImage(_RNG.integers(0, 256, (56, 84, 3), dtype=np.uint8), (84, 56))
WIDE = PreparedImage(_RNG.integers(0, 256, (28, 140, 3), dtype=np.uint8), (140, 28))
VIDEO = PreparedVideo(
    frames=_RNG.integers(0, 256, (4, 336, 448, 3), dtype=np.uint8),
    original_size=(448, 336),
    timestamps=(0.0, 0.6, 1.2, 1.8),
    duration_s=2.4,
    source_fps=25.0,
    total_num_frames=60,
    sample_fps=1.7,
)
IMAGE_PAD = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PAD = "<|vision_start|><|video_pad|><|vision_end|>"
CASES: dict[str, tuple[list[PreparedImage], list[PreparedVideo]]] = {
    "one image": ([IMAGE], []),
    "two images": ([IMAGE, WIDE], []),
    "video": ([], [VIDEO]),
    "image and video": ([WIDE], [VIDEO]),
}
KEYS = {
    "image": ("pixel_values", "image_grid_thw"),
    "video": ("pixel_values_videos", "video_grid_thw"),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if reason := _vllm_failure():
        pytest.skip(reason)
    from mmworker.devkit.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen") / "model")


@pytest.fixture(scope="module")
def processors(model_dir: Path) -> Iterator[tuple[Any, Any]]:
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    pixels.register()

    def make(**kwargs: Any) -> Any:
        config = ModelConfig(
            model=str(model_dir), tokenizer=str(model_dir), max_model_len=32768, **kwargs
        )
        return MULTIMODAL_REGISTRY.create_processor(config)

    overrides = pixels.overrides(str(model_dir), None)
    assert overrides == {"architectures": [pixels.ARCHITECTURE]}
    yield make(), make(hf_overrides=overrides)


def _run(processor: Any, prompt: str, data: dict[str, list[Any]]) -> Any:
    return processor(prompt, processor.info.parse_mm_data(data), hf_processor_mm_kwargs={})


@pytest.mark.parametrize("name", list(CASES))
def test_the_encoder_gets_the_processor_paths_exact_inputs(
    name: str, processors: tuple[Any, Any], model_dir: Path
) -> None:
    import torch

    from mmworker.engine.pixels_model import Patchify, RawPixelItems, image_statistics

    processor, pixel_processor = processors
    images, videos = CASES[name]
    prompt = IMAGE_PAD * len(images) + VIDEO_PAD * len(videos) + "Describe."
    usual: dict[str, list[Any]] = {}
    raw: dict[str, list[Any]] = {}
    if images:
        from PIL import Image

        usual["image"] = [Image.fromarray(i.pixels) for i in images]
        raw["image"] = [pixels.raw_pixels(i) for i in images]
    if videos:
        usual["video"] = [(v.frames, vllm_video_metadata(v)) for v in videos]
        raw["video"] = [pixels.raw_pixels(v) for v in videos]
    parsed = pixel_processor.info.parse_mm_data(raw)
    assert all(isinstance(items, RawPixelItems) for items in parsed.values())

    want = _run(processor, prompt, usual)
    got = _run(pixel_processor, prompt, raw)

    assert got["prompt_token_ids"] == want["prompt_token_ids"]
    assert got["mm_placeholders"] == want["mm_placeholders"]
    mean, std, rescale = image_statistics(str(model_dir), None)
    patchify = Patchify(mean, std, rescale, merge=2)
    for modality, (values, grid) in KEYS.items():
        for item_want, item_got in zip(
            want["mm_kwargs"].get(modality, []), got["mm_kwargs"].get(modality, []), strict=True
        ):
            assert torch.equal(item_got[grid].data, item_want[grid].data)
            rows = item_got[f"mmworker_{modality}_rows"].data
            patches = patchify.layout(rows, item_got[grid].data.view(1, 3))
            expected = item_want[values].data
            if expected.dtype == torch.uint8:  # vLLM 0.3x: normalised later, in the tower
                assert torch.equal(patches, expected)
            else:  # vLLM 0.25: normalised floats in the model dtype
                assert torch.equal(patchify.normalize(patches).to(expected.dtype), expected)
            if modality == "video":
                # Qwen2.5-VL's M-RoPE time step: 2 / the sampled frame rate, in the model dtype
                # as vLLM casts the processor's floats. vLLM 0.3x's processor path gives the
                # same (tests/unit/test_video_parity.py); vLLM 0.25 hands the processor no
                # metadata, so transformers assumes 24 fps there (0.0835 s for 1.7 fps
                # frames, seen on the H200 host): that path's positions were wrong.
                step = item_got["second_per_grid_ts"].data
                want_step = item_want["second_per_grid_ts"].data
                assert step.dtype == want_step.dtype
                assert torch.equal(step, torch.tensor(2 / VIDEO.sample_fps).to(step.dtype))


def test_normalize_is_transformers_arithmetic_bit_for_bit(model_dir: Path) -> None:
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoVideoProcessor

    from mmworker.engine.pixels_model import Patchify, image_statistics

    mean, std, rescale = image_statistics(str(model_dir), None)
    patchify = Patchify(mean, std, rescale, merge=2)
    image_proc = AutoImageProcessor.from_pretrained(str(model_dir))
    for image in (IMAGE, WIDE):
        want = image_proc(images=[Image.fromarray(image.pixels)], return_tensors="pt")
        raw = pixels.raw_pixels(image)
        got = patchify.normalize(patchify.layout(raw.rows, torch.tensor([raw.grid_thw])))
        assert want["pixel_values"].dtype == torch.float32
        assert torch.equal(got, want["pixel_values"])
    video_proc = AutoVideoProcessor.from_pretrained(str(model_dir))
    want = video_proc(videos=[VIDEO.frames], do_sample_frames=False, return_tensors="pt")[
        "pixel_values_videos"
    ]
    raw = pixels.raw_pixels(VIDEO)
    got = patchify.normalize(patchify.layout(raw.rows, torch.tensor([raw.grid_thw])))
    assert torch.equal(got, want)


def test_raw_pixels_are_a_view_of_the_prepared_frames() -> None:
    """No copy on the worker's hot path: the rows share the prepared array's memory."""
    raw = pixels.raw_pixels(VIDEO)
    assert raw.grid_thw == (2, 24, 32)
    assert raw.rows.shape == (2 * 24 * 32, 2 * 14 * 14 * 3)
    assert np.shares_memory(raw.rows.numpy(), VIDEO.frames)
    assert raw.second_per_grid == pytest.approx(2 / 1.7)
    image = pixels.raw_pixels(IMAGE)
    assert image.grid_thw == (1, 4, 6) and image.rows.shape == (24, 14 * 14 * 3)
    assert image.second_per_grid is None


_READ_ONLY = """
import warnings
import numpy as np
from mmworker.engine import pixels
from mmworker_preprocess.params import PreparedImage
frames = np.zeros((28, 28, 3), np.uint8)
frames.setflags(write=False)
if CONTROL:  # torch warns once per process: drop the module's filter before the first call
    warnings.resetwarnings()
    warnings.simplefilter("always")
raw = pixels.raw_pixels(PreparedImage(frames, (28, 28)))
assert np.shares_memory(raw.rows.numpy(), frames)
"""


@pytest.mark.parametrize("control", [False, True])
def test_read_only_frames_are_wrapped_without_a_copy_or_a_warning(control: bool) -> None:
    """A cache hit's frames are read-only; the demo printed torch's non-writable warning for
    them. In a process of its own: pytest resets the filters a module installs at import. The
    control drops the module's filter and sees the warning, so the check can fail."""
    code = f"CONTROL = {control}\n{_READ_ONLY}"
    run = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True,
                         text=True, timeout=120, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert ("NumPy array is not writable" in run.stderr) == control, run.stderr


def test_only_qwen2_5_vl_checkpoints_get_the_pixel_class() -> None:
    class Config:
        def __init__(self, architectures: list[str] | None) -> None:
            self.architectures = architectures

    assert pixels.use_pixel_model(Config(["Qwen2_5_VLForConditionalGeneration"])).architectures == [
        pixels.ARCHITECTURE
    ]
    assert pixels.use_pixel_model(Config(["Qwen2VLForConditionalGeneration"])).architectures == [
        "Qwen2VLForConditionalGeneration"
    ]
    assert pixels.use_pixel_model(Config(None)).architectures is None


def test_a_config_transformers_does_not_know_keeps_the_processor_path(tmp_path: Path) -> None:
    """A model_type of its own (remote code): the supervisor read it for the KV size key and
    failed with a traceback, leaving its children waiting; now vLLM decides, as for any other
    architecture."""
    (tmp_path / "config.json").write_text('{"model_type": "own-arch", "architectures": ["Own"]}')
    assert pixels.overrides(str(tmp_path), None) is None
