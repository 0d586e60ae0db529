"""Prepared media handed to the engine as raw pixels, normalised and patchified on its device.

Why: on a GPU host vLLM's front end, not the GPU, bounds throughput. For every cold image and clip
it runs the HF Qwen2.5-VL processor (float conversion, rescale, normalise, patchify) on one
thread before the engine core sees the request: 105-118 ms per 16-frame 448x448 clip on an H200
host, while the same engine with those results cached ran 1.5x faster. The worker has already
done the part that needs judgement (decoding, sampling, the exact resize), so what is left is
arithmetic that a GPU does in microseconds: the frames go to the engine as uint8 bytes (a
zero-copy view of the prepared array, a quarter of the float32 tensor the processor would
send), and the model class below turns them into the processor's exact float patches inside
the engine core, just before the vision encoder.

The front end then only tokenises the prompt and expands its placeholders. The prompt, the
placeholder count, the M-RoPE positions and the encoder input are the processor's own, bit for
bit (tests/unit/test_engine_pixels.py compares both paths on the same prepared media).

This module is light (no vLLM import at import time): `register` runs in every vLLM process as a
plugin and only names the model class; `mm_data` runs on the worker's hot path.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from mmworker_preprocess.params import PreparedImage, PreparedVideo

log = logging.getLogger(__name__)

#: The architecture name the worker gives vLLM (`hf_overrides`) for the Qwen2.5-VL model class
#: that accepts raw pixels; registered beside vLLM's own, which other users of the same
#: installation keep getting.
ARCHITECTURE = "MmworkerQwen2_5_VLForConditionalGeneration"
#: The architectures this path knows how to stand in for.
REPLACES = frozenset({"Qwen2_5_VLForConditionalGeneration"})


def register() -> None:
    """vLLM plugin entry point (`vllm.general_plugins`): name the model class lazily, so that a
    process which never builds this architecture never imports it."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "mmworker.engine.pixels_model:PixelModel")


@dataclass(frozen=True, slots=True)
class RawPixels:
    """One image or clip as the engine's pixel path takes it: uint8 rows whose count is the
    patch grid's (`grid_thw` product), so vLLM's flat per-item slicing stays valid. An image is
    one frame (rows of 14x14x3 bytes, tiled to the temporal patch on the device); a clip is its
    frames (rows of 2x14x14x3)."""

    rows: Any  # torch.Tensor, uint8, (t*h*w, bytes per patch), a view of the prepared frames
    grid_thw: tuple[int, int, int]
    #: Seconds of video per temporal patch (Qwen2.5-VL's M-RoPE time step); None for images.
    second_per_grid: float | None = None


PATCH = 14
TEMPORAL_PATCH = 2

# `raw_pixels` wraps the prepared frames, which are read-only (a cache hit maps them), without a
# copy: avoiding that copy is the point. The rows are only read (serialised to the engine core),
# so torch's warning about tensors over non-writable arrays says nothing here; the filter is
# scoped to this module's calls.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning,
    module=r"mmworker\.engine\.pixels",
)  # fmt: skip


def raw_pixels(prepared: PreparedImage | PreparedVideo) -> RawPixels:
    """The prepared array as uint8 rows, without a copy when it is contiguous."""
    import torch

    if isinstance(prepared, PreparedImage):
        frames = prepared.pixels[None]
        t = 1
    else:
        frames = prepared.frames
        t = frames.shape[0] // TEMPORAL_PATCH
    height, width = frames.shape[1:3]
    h, w = height // PATCH, width // PATCH
    flat = torch.from_numpy(np.ascontiguousarray(frames)).view(t * h * w, -1)
    second = None
    if isinstance(prepared, PreparedVideo):
        second = TEMPORAL_PATCH / prepared.sample_fps
    return RawPixels(rows=flat, grid_thw=(t, h, w), second_per_grid=second)


def overrides(model_path: str, revision: str | None) -> dict[str, Any] | None:
    """vLLM `hf_overrides` that serve a Qwen2.5-VL checkpoint with the pixel-path class, or None
    for any other architecture (which keeps the processor path). A dict, not a callable: vLLM
    0.25 refuses a callable beside `quantization` ("hf_overrides must be a dict")."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, revision=revision)
    except (OSError, ValueError) as exc:
        # Not downloadable here (offline, no such id), or not a config transformers knows (a
        # model_type of its own, remote code): vLLM decides later, with its own error if any.
        log.warning("pixel path off: cannot read %s's config (%s)", model_path, exc)
        return None
    if use_pixel_model(config).architectures == [ARCHITECTURE]:
        return {"architectures": [ARCHITECTURE]}
    return None


def use_pixel_model(hf_config: Any) -> Any:
    """vLLM `hf_overrides` hook: a Qwen2.5-VL checkpoint is served by the pixel-path class; any
    other architecture is left as it is (and gets the processor path)."""
    architectures = list(getattr(hf_config, "architectures", None) or ())
    if architectures and all(a in REPLACES for a in architectures):
        hf_config.architectures = [ARCHITECTURE]
    return hf_config
