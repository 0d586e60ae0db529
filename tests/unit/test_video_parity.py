"""The frames prepare_video hands over are consumed as-is by Qwen2.5-VL's real processors.

Checked against transformers' Qwen2VLVideoProcessor (what vLLM calls inside) and against vLLM's
own multimodal processor for a tiny Qwen2.5-VL checkpoint: same grid, same visual-token count
(so the worker's budget check counts what the engine will allocate), unchanged pixels (no second
resize), and second_per_grid_ts = 2 / sample_fps (temporal positions in real time).

Both need torch/torchvision (and vLLM); the tests skip, saying why, only when those imports fail.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import media_videos as mv
from mmworker_preprocess.params import PreparedVideo, VideoParams
from mmworker_preprocess.tokens import video_tokens
from mmworker_preprocess.video import prepare_video

from mmworker.engine.video_metadata import vllm_video_metadata


def _import_failure(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except (ImportError, RuntimeError, OSError) as exc:
        return f"`import {module}` fails here ({type(exc).__name__}: {exc})"
    return None


@cache
def _hf_failure() -> str | None:
    return _import_failure("transformers.models.qwen2_vl.video_processing_qwen2_vl")


@cache
def _vllm_failure() -> str | None:
    return _hf_failure() or _import_failure("vllm.multimodal")


@dataclass(frozen=True)
class Case:
    make: Callable[[], bytes]
    params: VideoParams = field(default_factory=VideoParams)


SMALL = VideoParams(min_pixels=28 * 28 * 4, total_pixels=28 * 28 * 8 * 20)

CASES: dict[str, Case] = {
    "h264-64x48": Case(lambda: mv.encode_video("libx264", n_frames=40, fps=10)),
    "vp9-320x240": Case(
        lambda: mv.encode_video("libvpx-vp9", n_frames=20, fps=10, width=320, height=240)
    ),
    "hevc-200-frames": Case(lambda: mv.encode_video("libx265", n_frames=200, fps=25)),
    "rotated-portrait": Case(lambda: mv.rotated_video(90)),
    "vfr": Case(lambda: mv.encode_video("libx264", times=(0.0, 0.1, 0.2, 1.5, 3.0, 3.1, 5.0))),
    "one-frame-padded": Case(lambda: mv.encode_video("libx264", n_frames=1)),
    "interval-odd-padded": Case(
        lambda: mv.encode_video("libx264", n_frames=25, fps=10),
        VideoParams(strategy="interval", interval_s=1.0),
    ),
    "keyframes": Case(
        lambda: mv.encode_video("libx264", n_frames=60, fps=10, gop=10),
        VideoParams(strategy="keyframes"),
    ),
    "small-frame-budget": Case(
        lambda: mv.encode_video("libx264", n_frames=20, fps=10, width=320, height=240), SMALL
    ),
    # Fitted to a token budget: 12 planned frames of 221 tokens a pair (1,326) become 8 frames
    # of 140 (560), smaller and fewer, which the processors must still take as they are.
    "fitted-to-budget": Case(
        lambda: mv.encode_video("libx264", n_frames=60, fps=10, width=480, height=360),
        VideoParams(max_tokens=600),
    ),
}


@cache
def prepared(name: str) -> PreparedVideo:
    case = CASES[name]
    return prepare_video(case.make(), case.params)


def size_kwargs(params: VideoParams) -> dict[str, Any]:
    """The processor's per-frame bounds, set like ours: the engine must be configured so."""
    return {"size": {"shortest_edge": params.min_pixels, "longest_edge": params.max_pixels}}


def expected_grid(video: PreparedVideo) -> list[int]:
    t, h, w, _ = video.frames.shape
    return [t // 2, h // 14, w // 14]


# --- transformers ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_transformers_video_processor_keeps_our_frames(name: str) -> None:
    if reason := _hf_failure():
        pytest.skip(reason)
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    video = prepared(name)
    params = CASES[name].params
    meta = {k: v for k, v in vllm_video_metadata(video).items() if k != "do_sample_frames"}
    processor = Qwen2VLVideoProcessor(**size_kwargs(params))
    out = processor(
        videos=[video.frames],
        video_metadata=[VideoMetadata(**meta)],
        do_sample_frames=False,
        do_rescale=False,
        do_normalize=False,
        cap_pixels_per_frame=False,
        return_metadata=True,
        return_tensors="pt",
    )
    grid = out["video_grid_thw"][0].tolist()
    assert grid == expected_grid(video)
    t, h, w, _ = video.frames.shape
    assert int(out["video_grid_thw"][0].prod()) // 4 == video_tokens(t, h, w)
    pixels = out["pixel_values_videos"].numpy()
    assert pixels.size == video.frames.size
    # Same multiset of values: the processor re-patched our pixels without resampling them.
    assert np.array_equal(np.sort(pixels, axis=None), np.sort(video.frames, axis=None))
    sampled = out["video_metadata"][0]
    assert sampled.sampled_fps == pytest.approx(video.sample_fps)


# --- vLLM --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_processor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if reason := _vllm_failure():
        pytest.skip(reason)
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    from mmworker.devkit.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen") / "model")
    config = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), max_model_len=32768)
    yield MULTIMODAL_REGISTRY.create_processor(config)


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_qwen2_5_vl_processor_agrees(name: str, vllm_processor: Any) -> None:
    video = prepared(name)
    params = CASES[name].params
    pair = (video.frames, vllm_video_metadata(video))
    items = vllm_processor.info.parse_mm_data({"video": [pair]})
    out = vllm_processor(
        "<|vision_start|><|video_pad|><|vision_end|>",
        items,
        hf_processor_mm_kwargs=size_kwargs(params),
    )
    fields = out["mm_kwargs"]["video"][0]
    assert fields["video_grid_thw"].data.tolist() == expected_grid(video)
    t, h, w, _ = video.frames.shape
    placeholder = out["mm_placeholders"]["video"][0]
    assert placeholder.length == video_tokens(t, h, w)
    # vLLM stores the value in the model dtype (bfloat16 here: 8 mantissa bits).
    second_per_grid = float(fields["second_per_grid_ts"].data)
    assert second_per_grid == pytest.approx(2.0 / video.sample_fps, rel=2**-8)
    pixels = fields["pixel_values_videos"].data.numpy()
    assert pixels.size == video.frames.size
    assert np.array_equal(np.sort(pixels, axis=None), np.sort(video.frames, axis=None))
