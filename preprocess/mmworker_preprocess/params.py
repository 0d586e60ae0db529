"""Frozen parameter and output types of the preprocessing stage.

Parameters are plain frozen dataclasses (not pydantic) because they are built once per job on the
hot path and hashed into feature-cache keys; `cache_key_fields()` is that stable identity.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

#: Bumped whenever a change to this package alters the pixels it produces, so stale cache
#: entries are never served. 3: a video shrunk to its token budget was reported unfitted and
#: filed under the key of no budget, where later jobs without one found the small frames.
PREPROCESS_VERSION = 3

IMAGE_FACTOR = 28
MIN_PIXELS = 4 * 28 * 28
MAX_PIXELS = 16384 * 28 * 28
MAX_RATIO = 200.0

VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
VIDEO_TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9)
FRAME_FACTOR = 2
FPS = 2.0
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768
#: Pixels of one visual token: a 28×28 block (14-pixel patches merged 2×2).
TOKEN_PIXELS = IMAGE_FACTOR * IMAGE_FACTOR


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    allowed_roots: tuple[Path, ...] = ()
    max_bytes: int = 256 * 1024 * 1024
    timeout_s: float = 30.0
    allow_private_networks: bool = False
    max_redirects: int = 5
    #: Operator lists on top of the built-in special-purpose ranges; deny wins over allow.
    deny_networks: tuple[IPv4Network | IPv6Network, ...] = ()
    allow_networks: tuple[IPv4Network | IPv6Network, ...] = ()


@dataclass(frozen=True, slots=True)
class ImageParams:
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    max_ratio: float = MAX_RATIO
    #: Refuse to decode images with more source pixels than this (decompression bombs).
    max_source_pixels: int = 178_956_970
    #: Visual tokens the image may take in its job's context; an image that needs more is
    #: resized smaller (never below `min_pixels`) rather than refused. None: no limit.
    max_tokens: int | None = None

    def with_budget(self, tokens: int | None) -> ImageParams:
        return replace(self, max_tokens=tokens)

    @property
    def budget(self) -> int | None:
        """`max_tokens` when it can bind, else None (see `VideoParams.budget`)."""
        if self.max_tokens is None or self.max_tokens >= image_token_ceiling(self):
            return None
        return self.max_tokens

    def cache_key_fields(self) -> dict[str, object]:
        return {"kind": "image", "v": PREPROCESS_VERSION, **_key_fields(self, self.budget)}


@dataclass(frozen=True, slots=True)
class VideoParams:
    strategy: Literal["fps", "interval", "keyframes"] = "fps"
    fps: float = FPS
    interval_s: float = 5.0
    min_frames: int = FPS_MIN_FRAMES
    max_frames: int = FPS_MAX_FRAMES
    min_pixels: int = VIDEO_MIN_PIXELS
    max_pixels: int = VIDEO_MAX_PIXELS
    total_pixels: int = VIDEO_TOTAL_PIXELS
    max_ratio: float = MAX_RATIO
    max_source_pixels: int = 8192 * 8192
    #: Refuse a cut or damaged video when less than this share of its duration decodes; above
    #: it, the frames come from the part that decodes and the result is marked partial.
    min_decoded_fraction: float = 0.5
    #: Visual tokens the video may take in its job's context. A video whose plan needs more is
    #: fitted: smaller frames first (down to the `min_pixels` floor), then fewer frames, still
    #: spread over the whole video; refused only when two frames at the floor need more.
    #: None: no limit.
    max_tokens: int | None = None

    def with_budget(self, tokens: int | None) -> VideoParams:
        return replace(self, max_tokens=tokens)

    @property
    def budget(self) -> int | None:
        """`max_tokens` when it can bind, else None; the planner and the cache key use this.

        A budget at or above what these parameters can produce from any source never changes a
        frame, so it is left out of the feature-cache key: jobs whose prompts or `max_tokens`
        differ keep sharing cached features (and vLLM's caches, keyed alike) unless a video
        really had to be fitted. The planner ignoring it too keeps key and frames in step by
        construction, even if the bound were wrong.
        """
        if self.max_tokens is None or self.max_tokens >= video_token_ceiling(self):
            return None
        return self.max_tokens

    def cache_key_fields(self) -> dict[str, object]:
        # min_decoded_fraction only decides whether a video is refused, and refusals are never
        # cached: the frames of any video it lets through are the same at every setting, so
        # it is left out rather than making every cached video a miss once. A partial video
        # found in the cache is judged again under the current setting (`judge_cached`).
        fields = _key_fields(self, self.budget)
        del fields["min_decoded_fraction"]
        return {"kind": "video", "v": PREPROCESS_VERSION, **fields}


def _key_fields(params: ImageParams | VideoParams, budget: int | None) -> dict[str, object]:
    """The fields as before budgets existed, plus the budget only when it binds: the keys of
    everything prepared without fitting stay what they were."""
    fields = asdict(params)
    del fields["max_tokens"]
    if budget is not None:
        fields["max_tokens"] = budget
    return fields


def frame_max_pixels(params: VideoParams, n_frames: int) -> int:
    """Per-frame pixel cap: the total budget shared across frames (qwen-vl-utils fetch_video)."""
    share = params.total_pixels / max(n_frames, 1) * FRAME_FACTOR
    return max(int(min(params.max_pixels, share)), video_pixel_floor(params))


def video_pixel_floor(params: VideoParams) -> int:
    """The smallest per-frame cap ever used: Qwen's video floor with qwen-vl-utils' 5 % margin,
    which keeps the rounded size from landing under `min_pixels`."""
    return int(params.min_pixels * 1.05)


def video_token_ceiling(params: VideoParams) -> int:
    """Most visual tokens any video can take under `params` without a budget (an upper bound)."""
    return _video_ceiling(
        params.max_frames, params.min_pixels, params.max_pixels, params.total_pixels,
        params.max_ratio,
    )  # fmt: skip


def image_token_ceiling(params: ImageParams) -> int:
    """Most visual tokens any image can take under `params` without a budget (an upper bound)."""
    pixels = _resized_pixels_bound(
        params.max_pixels, params.min_pixels, params.max_ratio, MIN_PIXELS
    )
    return math.floor(pixels / TOKEN_PIXELS) if math.isfinite(pixels) else UNBOUNDED


#: The ceiling when nothing bounds the size (an infinite aspect-ratio limit): every budget binds.
UNBOUNDED = 2**62


@lru_cache(maxsize=256)
def _video_ceiling(
    max_frames: int, min_pixels: int, max_pixels: int, total_pixels: int, max_ratio: float
) -> int:
    # Every strategy's plan, padding included, holds at most this many frames.
    cap = max(FRAME_FACTOR, math.floor(max_frames / FRAME_FACTOR) * FRAME_FACTOR)
    shape = VideoParams(
        max_frames=max_frames, min_pixels=min_pixels, max_pixels=max_pixels,
        total_pixels=total_pixels, max_ratio=max_ratio,
    )  # fmt: skip
    worst = 0
    for n in range(FRAME_FACTOR, cap + 1, FRAME_FACTOR):
        pixels = _resized_pixels_bound(
            frame_max_pixels(shape, n), min_pixels, max_ratio, VIDEO_MIN_PIXELS
        )
        if not math.isfinite(pixels):
            return UNBOUNDED
        worst = max(worst, n // FRAME_FACTOR * math.floor(pixels / TOKEN_PIXELS))
    return worst


def _resized_pixels_bound(max_pixels: int, min_pixels: int, max_ratio: float, low: int) -> float:
    """Bound on the pixels of `settle(smart_resize(h, w, ...))` over every source size.

    smart_resize keeps a rounded size within `max_pixels`; its shrinking branch exceeds that
    only when the short side clamps at 28 (then 28 × the long side, ≤ 28·√(max·ratio)); its
    growing branch rounds both sides up, adding less than 28 × (sum of the sides) + 28² to
    `min_pixels`, the sides summing to at most √min·(√ratio + 1). settle shrinks what is above
    its upper bound to no more than it was given, and grows what is below its floor `low` the
    same way as smart_resize, from a size whose ratio is at most its pixels / 28².
    """
    if not math.isfinite(max_ratio):
        return math.inf
    first = max(
        float(max_pixels),
        IMAGE_FACTOR * math.sqrt(max_pixels * max_ratio),
        min_pixels
        + IMAGE_FACTOR * math.sqrt(min_pixels) * (math.sqrt(max_ratio) + 1)
        + TOKEN_PIXELS,
        float(TOKEN_PIXELS),
    )
    grown = low + IMAGE_FACTOR * math.sqrt(low) * (math.sqrt(first / TOKEN_PIXELS) + 1)
    return max(first, grown + TOKEN_PIXELS)


@dataclass(frozen=True, slots=True)
class PreparedImage:
    """One image resized to what the model consumes: uint8 H×W×3 RGB, H and W multiples of 28."""

    pixels: npt.NDArray[np.uint8]
    original_size: tuple[int, int]  # (width, height)

    @property
    def resized_size(self) -> tuple[int, int]:
        return (int(self.pixels.shape[1]), int(self.pixels.shape[0]))


@dataclass(frozen=True, slots=True)
class PreparedVideo:
    """Sampled, resized frames (uint8 T×H×W×3, T even) and the metadata vLLM needs with them."""

    frames: npt.NDArray[np.uint8]
    original_size: tuple[int, int]  # (width, height), after rotation
    timestamps: tuple[float, ...]  # presentation time (s) of each frame, padding included
    duration_s: float
    source_fps: float
    total_num_frames: int
    sample_fps: float = field(default=FPS)
    #: Only part of the video decoded (a cut download, damaged data): the frames, `timestamps`
    #: and `duration_s` cover that part, which starts at the beginning.
    partial: bool = False
    #: The token budget changed the plan (smaller or fewer frames). Unfitted frames are what any
    #: budget they fit would produce, so they are cached under the key without a budget.
    fitted: bool = False
    #: The length the video should have had, when `partial`: what its container declares, or
    #: the span its frames were found to cover when the damage was in decoding.
    full_duration_s: float | None = None

    @property
    def resized_size(self) -> tuple[int, int]:
        return (int(self.frames.shape[2]), int(self.frames.shape[1]))
