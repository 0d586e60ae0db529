"""Decoded frames are freed when the decode is done, not at the next full garbage collection.

Reading a PyAV frame's side data (the display matrix) puts the frame in a reference cycle
(`orientation._side_data_of`). With the cycle collector off, as between a preprocessing
process's rare full collections, a frame in a cycle outlives the decode and keeps its decoder's
buffers. The soak saw the preprocessing process's memory in use grow with them.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import media_videos as mv
import numpy as np
import pytest
from av.video.frame import VideoFrame
from mmworker_preprocess.params import VideoParams
from mmworker_preprocess.video import prepare_video
from mmworker_preprocess.video.segments import SegmentRule, prepare_segment


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


def _frames_left() -> list[VideoFrame]:
    """Decoded frames still allocated (the 2×2 copies that carry side data left out). `type`, not
    `isinstance`: isinstance reads `__class__` of every object alive, and one of torch's
    deprecated module attributes warns when read (a FutureWarning once torch.distributed is in)."""
    return [o for o in gc.get_objects() if type(o) is VideoFrame and o.width * o.height > 4]


CLIPS: dict[str, Callable[[], bytes]] = {
    "rotated": lambda: mv.rotated_video(90, upright_width=48, upright_height=80, n_frames=8),
    "plain": lambda: mv.encode_video(
        "libx264", width=64, height=48, frames=[mv.oriented_content(64, 48)] * 8
    ),
}


@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.usefixtures("collector_off")
def test_a_video_decode_leaves_no_frame_behind(clip: str) -> None:
    data = CLIPS[clip]()
    video = prepare_video(data, VideoParams())
    assert video.frames.shape[0] >= 2
    assert _frames_left() == []


@pytest.mark.usefixtures("collector_off")
def test_a_segment_decode_leaves_no_frame_behind() -> None:
    data = mv.rotated_video(90, upright_width=48, upright_height=80, n_frames=8)
    segment = prepare_segment(data, VideoParams(), SegmentRule("fixed", every_s=10.0), 0.0)
    assert segment.video.frames.shape[0] >= 1
    assert _frames_left() == []


def test_rotation_is_still_read_from_the_copy() -> None:
    """The copy carries the display matrix: a portrait clip stored turned comes out upright."""
    video = prepare_video(mv.rotated_video(90, upright_width=48, upright_height=80), VideoParams())
    _, h, w, _ = video.frames.shape
    assert h > w
    assert mv.is_red(np.asarray(video.frames[0])[h // 10, w // 10])
