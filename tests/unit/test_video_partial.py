"""Every container FFmpeg decodes is a video, and cut or miscounted files are judged by time.

Each clip is written here by PyAV/FFmpeg (tests/media_videos.py) with frames that carry their
index as a bar code, so assertions name the exact source frames a video was captioned from.
"""

from __future__ import annotations

import dataclasses
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import media_videos as mv
from mmworker_preprocess.errors import UndecodableVideo
from mmworker_preprocess.params import ImageParams, PreparedVideo, VideoParams
from mmworker_preprocess.prepare import prepare_media
from mmworker_preprocess.video import prepare_video
from mmworker_schemas.codes import ErrorCode


@cache
def clip(codec: str, **kwargs: Any) -> bytes:
    return mv.encode_video(codec, **kwargs)


def indices(video: PreparedVideo) -> list[int]:
    return [mv.read_index(frame) for frame in video.frames]


def prepared(data: bytes, params: VideoParams | None = None) -> PreparedVideo:
    out = prepare_media(data, ImageParams(), params or VideoParams())
    assert isinstance(out, PreparedVideo)
    return out


def spread(n: int, total: int) -> list[int]:
    """Qwen's choice of n frames out of total: evenly spaced, first and last included."""
    return [round(i * (total - 1) / (n - 1)) for i in range(n)]


@pytest.mark.parametrize(
    ("codec", "container", "size", "fps"),
    [
        ("wmv2", "asf", (64, 48), 10),  # .wmv
        ("flv", "flv", (64, 48), 10),  # Flash video (Sorenson H.263)
        ("mpeg2video", "mpeg", (64, 48), 10),  # MPEG-2 program stream (.mpg, DVD .vob)
        ("libvpx", "ogg", (64, 48), 10),  # .ogv (VP8: this FFmpeg build has no Theora encoder)
        ("h263", "3gp", (176, 144), 10),  # old feature phones
        ("mpeg2video", "mxf", (64, 48), 25),  # broadcast / camera archives
        ("mpeg4", "nut", (64, 48), 10),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_every_container_ffmpeg_decodes_is_captioned(codec, container, size, fps):
    n_frames = 4 * fps
    video = prepared(
        clip(codec, container=container, width=size[0], height=size[1], n_frames=n_frames, fps=fps)
    )
    # Qwen's 2-fps rule: 8 frames spread over the 4 s.
    assert indices(video) == spread(8, n_frames)
    assert not video.partial
    assert video.duration_s == pytest.approx(4.0)


def test_variable_rate_avi_with_skipped_frames_is_whole():
    # 444 frame slots, 68 coded (the rest empty chunks): the coded frames span all 14.8 s.
    video = prepared(mv.avi_with_skipped_frames(coded=68, declared=444, fps=30))
    assert not video.partial
    assert video.duration_s == pytest.approx(444 / 30)
    assert video.total_num_frames == 68
    # 2 fps over 14.8 s: 28 frames, evenly spread by time over the 68 coded ones.
    assert indices(video) == spread(28, 68)


def test_avi_declaring_one_frame_more_than_it_codes_is_whole():
    video = prepared(mv.avi_declaring_more_frames(n_frames=150, declared=151, fps=25))
    assert not video.partial
    assert video.full_duration_s is None
    assert indices(video)[-1] == 149


@cache
def faststart(n_frames: int = 60) -> bytes:
    """6 s of H.264 with its index first, as a download or a phone's upload: a cut keeps the
    index, so the container still declares the full 6 s."""
    return mv.encode_video("libx264", n_frames=n_frames, gop=10, faststart=True)


@cache
def matroska(n_frames: int = 60) -> bytes:
    return mv.encode_video("libx264", n_frames=n_frames, gop=10, container="matroska")


@pytest.mark.parametrize("make", [faststart, matroska], ids=["mp4-faststart", "matroska"])
def test_a_cut_video_is_captioned_from_what_decodes_and_marked_partial(make):
    data = mv.truncated(make(), 0.9)
    video = prepared(data)
    assert video.partial
    assert video.full_duration_s == pytest.approx(6.0)
    assert 3.0 <= video.duration_s < 6.0 - 0.5
    # Frames spread over the part that is there, all from before the cut, in order.
    frames = indices(video)
    assert frames == sorted(frames)
    assert max(frames) < video.duration_s * 10
    assert len(frames) >= 6
    assert max(video.timestamps) < video.duration_s


@pytest.mark.parametrize("make", [faststart, matroska], ids=["mp4-faststart", "matroska"])
def test_a_video_cut_below_the_share_is_refused_saying_how_much_decoded(make):
    with pytest.raises(UndecodableVideo, match=r"truncated video: .* of the 6\.00 s declared") as e:
        prepared(mv.truncated(make(), 0.45))
    assert e.value.code is ErrorCode.UNDECODABLE_VIDEO
    assert not e.value.retryable


def test_the_share_that_must_decode_is_a_setting():
    data = mv.truncated(faststart(), 0.9)
    decoded = prepare_video(data, VideoParams()).duration_s
    share = decoded / 6.0
    prepare_video(data, VideoParams(min_decoded_fraction=share - 0.05))
    with pytest.raises(UndecodableVideo, match="at least"):
        prepare_video(data, VideoParams(min_decoded_fraction=share + 0.05))


def test_losing_the_last_frame_is_rounding_not_damage():
    # The last bytes are the last frame's: it no longer decodes, the other 59 do. A frame's
    # worth is within PARTIAL_SLACK_S, as is an index counting one frame too many.
    video = prepared(faststart()[:-16])
    assert not video.partial
    assert video.duration_s == pytest.approx(5.9)
    # The plan's last frame is lost; the one before it is repeated to pair up, as Qwen pairs.
    assert indices(video) == [*spread(12, 60)[:-1], 54]


def test_the_setting_reaches_the_video_params_and_not_the_cache_key():
    from mmworker.config import PreprocessConfig

    cfg = PreprocessConfig(video_min_decoded_fraction=0.8)
    params = cfg.video_params(None, None, None, None, None)
    assert params.min_decoded_fraction == 0.8
    # It only decides refusals, never the frames of an accepted video, so cached features stay.
    default = dataclasses.replace(params, min_decoded_fraction=VideoParams().min_decoded_fraction)
    assert params.cache_key_fields() == default.cache_key_fields()


def test_partial_is_reported_in_the_result_facts():
    from mmworker.media import PreparedMedia
    from mmworker.records import media_facts

    video = prepared(mv.truncated(faststart(), 0.9))
    facts = media_facts(PreparedMedia(video, "ab" * 32, "key", False, 0.0, 0.0))
    assert facts.partial is True
    assert facts.duration_s == pytest.approx(6.0)
    assert facts.decoded_duration_s == pytest.approx(video.duration_s)
    whole = media_facts(PreparedMedia(prepared(faststart()), "cd" * 32, "key", False, 0.0, 0.0))
    assert whole.partial is False and whole.decoded_duration_s is None
    assert whole.duration_s == pytest.approx(6.0)


def test_a_cached_partial_video_is_judged_again_under_the_current_setting(tmp_path):
    """The setting is not in the cache key: an entry prepared under a lower one was served where
    the current setting refuses the video."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from mmworker_schemas import Job, MediaRef

    from mmworker.cache import DiskFeatureCache
    from mmworker.config import PreprocessConfig
    from mmworker.media import MediaStage

    data = mv.truncated(faststart(), 0.9)
    share = prepare_video(data, VideoParams()).duration_s / 6.0
    job = Job(job_id="cut", media=[MediaRef(data=data)])

    def prepare(fraction: float) -> Any:
        cfg = PreprocessConfig(video_min_decoded_fraction=fraction)
        cache = DiskFeatureCache(tmp_path, max_bytes=64 * 1024 * 1024)
        pool = ThreadPoolExecutor(2)
        stage = MediaStage(cfg, cache, cpu_pool=pool, io_pool=pool, writer=pool)
        try:
            return asyncio.run(stage.prepare(job))
        finally:
            pool.shutdown(wait=True)  # the entry is written

    (first,) = prepare(share - 0.05)
    assert not first.cache_hit and first.prepared.partial
    with pytest.raises(UndecodableVideo, match="at least"):
        prepare(share + 0.05)
    (again,) = prepare(share - 0.05)
    assert again.cache_hit  # the entry is kept for the settings it fits
