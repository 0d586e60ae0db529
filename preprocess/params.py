"""Frozen parameter and output types of the preprocessing stage.

Parameters are plain frozen dataclasses (not pydantic) because they are built once per job on the
hot path and hashed into feature-cache keys; `cache_key_fields()` is that stable identity.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

#: Bumped whenever a change to this package alters the pixels it produces, so stale cache
#: entries are never served.
PREPROCESS_VERSION = 2

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

    def cache_key_fields(self) -> dict[str, object]:
        return {"kind": "image", "v": PREPROCESS_VERSION, **asdict(self)}


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

    def cache_key_fields(self) -> dict[str, object]:
        # min_decoded_fraction only decides whether a video is refused, and refusals are never
        # cached: the frames of any video it lets through are the same at every setting, so
        # it is left out rather than making every cached video a miss once.
        fields = asdict(self)
        del fields["min_decoded_fraction"]
        return {"kind": "video", "v": PREPROCESS_VERSION, **fields}


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
    #: The length the video should have had, when `partial`: what its container declares, or
    #: the span its frames were found to cover when the damage was in decoding.
    full_duration_s: float | None = None

    @property
    def resized_size(self) -> tuple[int, int]:
        return (int(self.frames.shape[2]), int(self.frames.shape[1]))

    def vllm_metadata(self) -> dict[str, object]:
        """Metadata in the shape vLLM's Qwen2.5-VL processor expects (FIELD-NOTES §1).

        Frames are already sampled, so `do_sample_frames=False` and indices are just 0..T-1;
        `fps` is the effective sampling rate, which sets the temporal position ids.
        """
        n = int(self.frames.shape[0])
        return {
            "fps": self.sample_fps,
            "duration": self.duration_s,
            "total_num_frames": n,
            "frames_indices": list(range(n)),
            "video_backend": "opencv",
            "do_sample_frames": False,
        }
