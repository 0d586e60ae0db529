"""Qwen2.5-VL's `smart_resize` (transformers' Qwen2-VL processors, which vLLM runs, and
qwen-vl-utils), reproduced exactly.

Exactness matters: the engine re-derives the grid from the size we hand it, and a one-patch
difference changes the visual token count the worker budgeted for.
"""

from __future__ import annotations

import math

from mmworker_preprocess.errors import BadAspectRatio
from mmworker_preprocess.params import (
    IMAGE_FACTOR,
    MAX_PIXELS,
    MAX_RATIO,
    MIN_PIXELS,
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
)


def _round_by(n: float, factor: int) -> int:
    return round(n / factor) * factor


def _ceil_by(n: float, factor: int) -> int:
    return math.ceil(n / factor) * factor


def _floor_by(n: float, factor: int) -> int:
    return math.floor(n / factor) * factor


def smart_resize(
    height: int,
    width: int,
    factor: int = IMAGE_FACTOR,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
    max_ratio: float = MAX_RATIO,
) -> tuple[int, int]:
    """Return (height, width), each a multiple of `factor`, with the pixel count in bounds."""
    if height <= 0 or width <= 0:
        raise BadAspectRatio(f"image has no area ({width}x{height})")
    ratio = max(height, width) / min(height, width)
    if ratio > max_ratio:
        raise BadAspectRatio(f"aspect ratio {ratio:.1f} exceeds {max_ratio:g} ({width}x{height})")
    h_bar = max(factor, _round_by(height, factor))
    w_bar = max(factor, _round_by(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, _floor_by(height / beta, factor))
        w_bar = max(factor, _floor_by(width / beta, factor))
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = _ceil_by(height * beta, factor)
        w_bar = _ceil_by(width * beta, factor)
    return h_bar, w_bar


def settle(height: int, width: int, *, video: bool) -> tuple[int, int]:
    """The size the engine's processor keeps when handed an item already resized to this one.

    vLLM's Qwen2.5-VL processor re-runs smart_resize with the model's own bounds (4·28²..16384·28²
    per image, 128·28²..768·28² per video frame). A size outside them, from a job's cap below the
    model's floor or the floor branch rounding a thin item under the minimum, would be resized
    again in the engine, and the visual tokens counted here would not be the ones it used.
    Resizing straight to the settled size makes the engine's pass a no-op; inside the bounds
    this returns its input unchanged.
    """
    low, high = (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS) if video else (MIN_PIXELS, MAX_PIXELS)
    return smart_resize(height, width, min_pixels=low, max_pixels=high, max_ratio=math.inf)
