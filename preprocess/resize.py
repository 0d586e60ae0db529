"""Qwen2.5-VL's `smart_resize`, reproduced exactly (FIELD-NOTES §3).

Exactness matters: the engine re-derives the grid from the size we hand it, and a one-patch
difference changes the visual token count the worker budgeted for.
"""

from __future__ import annotations

import math

from preprocess.errors import BadAspectRatio
from preprocess.params import IMAGE_FACTOR, MAX_PIXELS, MAX_RATIO, MIN_PIXELS


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
