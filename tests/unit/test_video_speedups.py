"""The decode speed-ups change which work is done, never the output: compare against them off."""

from __future__ import annotations

import mmworker_preprocess.video as video
import numpy as np
import pytest
from mmworker_preprocess.params import VideoParams
from mmworker_preprocess.video import decode, schedule

from tests.media_videos import encode_video


@pytest.fixture(scope="module")
def bframe_clip() -> bytes:
    # Several GOPs with B-frames (x264 default b-pyramid): non-reference frames exist to skip.
    return encode_video("libx264", width=96, height=64, n_frames=120, fps=10, gop=24)


def _run(
    data: bytes, params: VideoParams
) -> tuple[np.ndarray, tuple[float, ...], video.DecodeStats]:
    stats = video.DecodeStats()
    out = video.prepare_video(data, params, stats)
    return out.frames, out.timestamps, stats


@pytest.mark.parametrize("strategy", ["fps", "interval"])
def test_speedups_give_identical_frames(
    bframe_clip: bytes, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = VideoParams(strategy=strategy, interval_s=1.5, max_frames=16)  # type: ignore[arg-type]
    # Force the split path (second decoder) even on tiny clips and one-core CI boxes.
    monkeypatch.setattr(schedule, "PARALLEL_MIN_PACKETS", 1)
    monkeypatch.setattr(schedule, "usable_cores", lambda: 2)
    tails: list[int] = []
    real_tail = decode._decode_tail

    def spy(data: bytes, main: object, runs: list[object], stats: video.DecodeStats) -> object:
        tails.append(len(runs))
        return real_tail(data, main, runs, stats)  # type: ignore[arg-type]

    monkeypatch.setattr(decode, "_decode_tail", spy)
    fast_frames, fast_times, _fast = _run(bframe_clip, params)
    assert tails and tails[0] >= 1  # the second decoder really ran

    monkeypatch.setattr(decode, "NONREF_SKIP_CODECS", frozenset())
    monkeypatch.setattr(schedule, "DECODE_THREADS", 1)
    slow_frames, slow_times, _slow = _run(bframe_clip, params)

    assert fast_times == slow_times
    assert fast_frames.shape == slow_frames.shape and fast_frames.shape[0] >= 4
    assert np.array_equal(fast_frames, slow_frames)


def test_chosen_frames_are_the_expected_ones(bframe_clip: bytes) -> None:
    # 12 s at 10 fps sampled at 2 fps → 24 frames, capped to 16, spread over the whole clip.
    out = video.prepare_video(bframe_clip, VideoParams(max_frames=16))
    assert out.frames.shape[0] == 16
    stamps = list(out.timestamps)
    assert stamps == sorted(stamps) and stamps[0] == 0.0 and stamps[-1] > 11.0
