"""The sampling plan: which frames, and at what size, before a single frame is decoded.

Planned from the timeline and the stream header alone, so a video is fitted to its token budget
(or refused) without paying for any decoding, and the decoder is asked only for these frames.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from mmworker_preprocess.errors import TooManyVisualTokens
from mmworker_preprocess.params import (
    FRAME_FACTOR,
    VideoParams,
    frame_max_pixels,
    video_pixel_floor,
)
from mmworker_preprocess.tokens import fit_pixels, resized, video_tokens
from mmworker_preprocess.video.timeline import Timeline, sample_rate


@dataclass(slots=True)
class Plan:
    targets: list[int]  # presentation indices, one per output frame before padding
    sample_fps: float
    #: Per-frame pixel cap (smart_resize's max_pixels) for the frames of this plan.
    frame_pixels: int = 0

    @property
    def n_out(self) -> int:
        """Frames handed to the model: the targets, padded to pair up."""
        return len(self.targets) + len(self.targets) % FRAME_FACTOR


def plan_frames(timeline: Timeline, params: VideoParams) -> Plan:
    """Choose which shown frames to keep, per strategy, and the per-frame pixel cap they get."""
    plan = _choose(timeline, params)
    plan.frame_pixels = frame_max_pixels(params, plan.n_out)
    return plan


def fit(timeline: Timeline, params: VideoParams, plan: Plan, coded: tuple[int, int]) -> Plan:
    """The plan, fitted to `params.budget` visual tokens: smaller frames first, then fewer.

    Planned before any frame is decoded, from the size the stream's header declares; turning a
    frame upright swaps its sides, which changes no count. Frames shrink down to the video
    floor (`video_pixel_floor`); when even then the plan's frames need too many tokens, the
    strategy plans again with at most as many frames as fit at the floor, so they still spread
    over the whole video, and those frames get the largest size that fits. Refused only when
    two frames at the floor are too many.
    """
    budget = params.budget
    height, width = coded
    if budget is None or height <= 0 or width <= 0:
        return plan

    def need(n_out: int, cap: int) -> int:
        size = resized(
            height,
            width,
            min_pixels=params.min_pixels,
            max_pixels=cap,
            max_ratio=params.max_ratio,
            video=True,
        )
        return video_tokens(n_out, *size)

    if need(plan.n_out, plan.frame_pixels) <= budget:
        return plan
    floor = video_pixel_floor(params)
    per_pair = need(FRAME_FACTOR, floor)  # two frames at the floor
    pairs = budget // per_pair
    if pairs < 1:
        raise TooManyVisualTokens(
            f"video {width}x{height} does not fit its budget of {budget} visual tokens: even 2 "
            f"frames at the smallest frame size ({floor} pixels per frame) need {per_pair}"
        )
    if pairs * FRAME_FACTOR < plan.n_out:
        plan = plan_frames(timeline, replace(params, max_frames=pairs * FRAME_FACTOR))
    pair_budget = budget // (plan.n_out // FRAME_FACTOR)
    cap = fit_pixels(
        height,
        width,
        tokens=pair_budget,
        start=plan.frame_pixels,
        floor=floor,
        min_pixels=params.min_pixels,
        max_ratio=params.max_ratio,
        video=True,
    )
    assert cap is not None, "the floor fits: pairs was counted at it"
    # A new plan, never the one given: the caller tells a fitted video by comparing the two,
    # and files an unfitted one where jobs without a budget look.
    return replace(plan, frame_pixels=cap)


def _floor_even(n: float) -> int:
    return math.floor(n / FRAME_FACTOR) * FRAME_FACTOR


def _ceil_even(n: float) -> int:
    return math.ceil(n / FRAME_FACTOR) * FRAME_FACTOR


def _choose(timeline: Timeline, params: VideoParams) -> Plan:
    """Choose which shown frames to keep, per strategy; all choices are by presentation time."""
    total = len(timeline.shown)
    if total == 0:
        return Plan([], params.fps)
    duration = timeline.duration_s
    cap = max(FRAME_FACTOR, _floor_even(params.max_frames))
    last = timeline.seconds[-1]
    if params.strategy == "fps":
        # qwen-vl-utils smart_nframes: total / video_fps * fps == duration * fps.
        raw = duration * params.fps
        n = min(max(raw, _ceil_even(params.min_frames)), _floor_even(params.max_frames), total)
        n = _floor_even(n)
        if n < FRAME_FACTOR:
            n = min(total, FRAME_FACTOR)
        targets = _nearest(timeline.seconds, np.linspace(0.0, last, n))
        return Plan(targets, sample_rate(n, duration, params.fps))
    if params.strategy == "interval":
        count = math.floor(last / params.interval_s + 1e-9) + 1
        if count <= cap:
            times = np.arange(count) * params.interval_s
            return Plan(_nearest(timeline.seconds, times), 1.0 / params.interval_s)
        targets = _nearest(timeline.seconds, np.linspace(0.0, last, cap))
        return Plan(targets, sample_rate(cap, duration, 1.0 / params.interval_s))
    if params.strategy == "keyframes":
        # Key frames come from the demuxer's flags, and only those packets reach the decoder.
        # The decoder's skip_frame="NONKEY" is not relied on: FFmpeg's VP9 decoder ignores it
        # (measured: every frame came out), while packet flags mean the same for every codec.
        packets = timeline.packets
        keys = [i for i, d in enumerate(timeline.shown) if packets[d].key]
        if len(keys) > cap:
            picks = np.linspace(0, len(keys) - 1, cap).round().astype(int)
            keys = [keys[int(i)] for i in picks]
        return Plan(keys, sample_rate(len(keys), duration, params.fps))
    raise ValueError(f"unknown video strategy {params.strategy!r}")


def _nearest(seconds: Sequence[float], targets: npt.NDArray[np.floating[Any]]) -> list[int]:
    """Index of the frame whose time is nearest each target; a tie goes to the earlier frame."""
    out = []
    for t in targets.tolist():
        j = bisect.bisect_left(seconds, t)
        if j == len(seconds) or (j > 0 and t - seconds[j - 1] <= seconds[j] - t):
            j -= 1
        out.append(j)
    return out
