"""Segment mode's decoding: scene changes found where they are, fixed lengths where asked, and
each segment sampled within itself, with bounded frames held."""

from __future__ import annotations

import pytest
from media_scenes import scene_video
from mmworker_preprocess.errors import TooManyVisualTokens
from mmworker_preprocess.params import VideoParams
from mmworker_preprocess.video.segments import PreparedSegment, SegmentRule, prepare_segment
from mmworker_preprocess.video.stats import DecodeStats

CUTS = [7.5, 19.0, 33.0, 41.25, 52.0]
PARAMS = VideoParams(max_frames=16, min_pixels=64 * 28 * 28)


@pytest.fixture(scope="module")
def clip() -> bytes:
    return scene_video(CUTS, 60.0)


def _all(data: bytes, params: VideoParams, rule: SegmentRule) -> list[PreparedSegment]:
    out, start = [], 0.0
    while True:
        seg = prepare_segment(data, params, rule, start)
        out.append(seg)
        if seg.last:
            return out
        assert seg.end_s > start
        start = seg.end_s


def test_scene_mode_finds_every_change_within_a_second(clip: bytes) -> None:
    segs = _all(clip, PARAMS, SegmentRule("scenes", min_s=2.0, max_s=30.0))
    bounds = [s.end_s for s in segs[:-1]]
    assert len(bounds) == len(CUTS)
    for found, cut in zip(bounds, CUTS, strict=True):
        assert abs(found - cut) <= 1.0
    assert all(s.scene_cut for s in segs[:-1])
    assert segs[-1].end_s == pytest.approx(60.0, abs=0.3)


def test_max_s_cuts_a_long_scene_and_min_s_suppresses_close_cuts(clip: bytes) -> None:
    segs = _all(clip, PARAMS, SegmentRule("scenes", min_s=10.0, max_s=12.0))
    lengths = [s.end_s - s.start_s for s in segs]
    assert all(length <= 12.0 + 1e-6 for length in lengths)
    assert all(length >= 10.0 - 1e-6 for length in lengths[:-1])
    # 7.5 s is under min_s: the first segment runs on to max_s.
    assert segs[0].end_s == pytest.approx(12.0)
    assert not segs[0].scene_cut


def test_fixed_mode_boundaries(clip: bytes) -> None:
    segs = _all(clip, PARAMS, SegmentRule("fixed", every_s=10.0))
    assert [(s.start_s, s.end_s) for s in segs] == [
        (pytest.approx(a), pytest.approx(b))
        for a, b in [(0, 10), (10, 20), (20, 30), (30, 40), (40, 50), (50, 60)]
    ]
    assert [s.last for s in segs] == [False] * 5 + [True]


def test_frames_come_from_their_segment_at_the_usual_rate(clip: bytes) -> None:
    params = VideoParams(fps=1.0, max_frames=64, min_pixels=64 * 28 * 28)
    for seg in _all(clip, params, SegmentRule("fixed", every_s=10.0)):
        stamps = seg.video.timestamps
        assert all(seg.start_s - 1e-6 <= t < seg.end_s for t in stamps)
        # 10 s at 1 fps: the usual fps rule gives 10 frames (even), spread over the segment.
        assert seg.video.frames.shape[0] == 10
        assert stamps[-1] - stamps[0] >= 8.0


def test_a_long_segment_holds_at_most_max_frames(clip: bytes) -> None:
    params = VideoParams(fps=4.0, max_frames=8, min_pixels=64 * 28 * 28)
    (seg,) = _all(clip, params, SegmentRule("fixed", every_s=600.0))
    assert seg.video.frames.shape[0] == 8
    stamps = seg.video.timestamps
    assert stamps[0] == 0.0
    assert stamps[-1] >= 50.0  # still spread over the whole minute after thinning


def test_budget_limits_frames_and_refuses_when_two_do_not_fit(clip: bytes) -> None:
    params = PARAMS.with_budget(200)
    seg = prepare_segment(clip, params, SegmentRule("fixed", every_s=10.0), 0.0)
    n, h, w = seg.video.frames.shape[:3]
    assert n // 2 * (h // 28) * (w // 28) <= 200
    with pytest.raises(TooManyVisualTokens):
        prepare_segment(clip, PARAMS.with_budget(10), SegmentRule("fixed", every_s=10.0), 0.0)


def test_fixed_mode_decodes_only_what_its_sampled_frames_need() -> None:
    clip = scene_video(CUTS, 60.0, gop=8)
    stats = DecodeStats()
    params = VideoParams(fps=0.1, max_frames=4, min_pixels=64 * 28 * 28)
    seg = prepare_segment(clip, params, SegmentRule("fixed", every_s=60.0), 0.0, stats)
    assert seg.video.frames.shape[0] == 4
    assert stats.packets == 240
    # Four GOP prefixes of at most 8 packets each, not the 240 frames of the segment.
    assert stats.decoded <= 4 * 8
