"""prepare_video: sampling strategies, timing, rotation, seeking and typed failures.

Every clip is encoded in memory by tests/media_videos.py; each frame carries its index as a bar
code, so assertions name the exact source frames chosen.
"""

from __future__ import annotations

import math
import sys
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import media_videos as mv
from mmworker_preprocess.errors import (
    NoFrames,
    PreprocessError,
    TooLarge,
    UndecodableVideo,
    UnsupportedMedia,
)
from mmworker_preprocess.params import (
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
    VIDEO_TOTAL_PIXELS,
    PreparedVideo,
    VideoParams,
)
from mmworker_preprocess.resize import smart_resize
from mmworker_preprocess.video import DecodeStats, frame_max_pixels, prepare_video
from mmworker_schemas.codes import ErrorCode
from mmworker_schemas.job import VideoStrategy

AV1 = mv.av1_encoder()
CODECS = [
    "libx264",
    "libx265",
    "libvpx-vp9",
    pytest.param(AV1 or "av1", marks=pytest.mark.skipif(AV1 is None, reason="no AV1 encoder")),
    "mpeg4",
]


@cache
def clip(codec: str = "libx264", **kwargs: Any) -> bytes:
    """Encode once per distinct argument set; kwargs must be hashable."""
    return mv.encode_video(codec, **kwargs)


def indices(video: PreparedVideo) -> list[int]:
    return [mv.read_index(frame) for frame in video.frames]


def qwen_indices(
    total: int, video_fps: float, fps: float = 2.0, max_frames: int = 768
) -> list[int]:
    """qwen-vl-utils smart_nframes + torch.linspace(0, total - 1, n).round(), reimplemented."""
    min_frames = math.ceil(4 / 2) * 2
    max_f = math.floor(min(max_frames, total) / 2) * 2
    n = min(max(total / video_fps * fps, min_frames), max_f, total)
    n = math.floor(n / 2) * 2
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def assert_well_formed(video: PreparedVideo) -> None:
    t, h, w, c = video.frames.shape
    assert video.frames.dtype == np.uint8
    assert video.frames.flags.c_contiguous
    assert c == 3 and t % 2 == 0 and t >= 2
    assert h % 28 == 0 and w % 28 == 0
    assert len(video.timestamps) == t
    assert all(b >= a for a, b in zip(video.timestamps, video.timestamps[1:], strict=False))
    assert video.timestamps[0] >= 0.0
    assert video.sample_fps > 0


# --- strategies, across codecs ---------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
def test_fps_strategy_matches_qwen_frame_choice(codec: str) -> None:
    data = clip(codec, n_frames=40, fps=10, gop=10)
    video = prepare_video(data, VideoParams(strategy="fps"))
    assert_well_formed(video)
    expected = qwen_indices(40, 10.0)
    assert indices(video) == expected == [0, 6, 11, 17, 22, 28, 33, 39]
    assert video.timestamps == pytest.approx([i / 10 for i in expected])
    assert video.total_num_frames == 40
    assert video.source_fps == pytest.approx(10.0)
    assert video.duration_s == pytest.approx(4.0)
    assert video.sample_fps == pytest.approx(8 / 4.0)
    assert video.original_size == (64, 48)
    # 64x48 is below the per-frame minimum: upscaled by smart_resize to 392x280.
    assert video.resized_size == (392, 280)


@pytest.mark.parametrize("codec", CODECS)
def test_interval_strategy_takes_one_frame_per_interval(codec: str) -> None:
    data = clip(codec, n_frames=40, fps=10, gop=10)
    video = prepare_video(data, VideoParams(strategy="interval", interval_s=1.0))
    assert_well_formed(video)
    assert indices(video) == [0, 10, 20, 30]
    assert video.timestamps == pytest.approx([0.0, 1.0, 2.0, 3.0])
    assert video.sample_fps == pytest.approx(1.0)


@pytest.mark.parametrize("codec", CODECS)
def test_keyframes_strategy_returns_the_key_frames(codec: str) -> None:
    data = clip(codec, n_frames=40, fps=10, gop=10)
    stats = DecodeStats()
    video = prepare_video(data, VideoParams(strategy="keyframes"), stats)
    assert_well_formed(video)
    keys = mv.keyframe_indices(data)
    expected = keys + keys[-1:] if len(keys) % 2 else keys
    assert indices(video) == expected
    # Only the key frames themselves reach the decoder.
    assert stats.decoded == len(keys)


def test_keyframes_capped_evenly_at_max_frames() -> None:
    data = clip("libx264", n_frames=100, fps=10, gop=5)  # 20 key frames
    video = prepare_video(data, VideoParams(strategy="keyframes", max_frames=6))
    keys = list(range(0, 100, 5))
    picks = np.linspace(0, len(keys) - 1, 6).round().astype(int)
    assert indices(video) == [keys[i] for i in picks]


def test_interval_capped_at_max_frames_spreads_over_the_video() -> None:
    data = clip("libx264", n_frames=100, fps=10, gop=10)  # 10 s
    video = prepare_video(data, VideoParams(strategy="interval", interval_s=0.5, max_frames=5))
    # max_frames is floored to an even count so padding can never exceed it.
    assert indices(video) == [0, 33, 66, 99]
    assert video.sample_fps == pytest.approx(4 / 10.0)


def test_interval_odd_count_is_padded_with_the_last_frame() -> None:
    data = clip("libx264", n_frames=25, fps=10)  # 2.4 s → frames at 0, 1, 2 s
    video = prepare_video(data, VideoParams(strategy="interval", interval_s=1.0))
    assert indices(video) == [0, 10, 20, 20]
    assert video.timestamps == pytest.approx([0.0, 1.0, 2.0, 2.0])
    assert np.array_equal(video.frames[-1], video.frames[-2])


# --- frame-count rules of the fps strategy -----------------------------------------------------


@pytest.mark.parametrize(
    ("n_frames", "fps", "params", "expected_count"),
    [
        (100, 10, VideoParams(), 20),  # 10 s at 2 fps
        (10, 10, VideoParams(), 4),  # 1 s → 2 frames, raised to min_frames
        (3, 10, VideoParams(), 2),  # fewer frames than min_frames: all of them, floored even
        (100, 10, VideoParams(max_frames=7), 6),  # max_frames floored to even
        (100, 10, VideoParams(fps=0.5), 4),  # 5 frames, floored to even
        (61, 30, VideoParams(fps=1.0), 4),  # 2.03 s at 1 fps → 2, raised to min 4
    ],
)
def test_fps_strategy_frame_count(
    n_frames: int, fps: int, params: VideoParams, expected_count: int
) -> None:
    data = clip("libx264", n_frames=n_frames, fps=fps)
    video = prepare_video(data, params)
    qwen = qwen_indices(n_frames, fps, params.fps, params.max_frames)
    assert video.frames.shape[0] == expected_count == len(qwen)
    assert indices(video) == qwen


def test_qwen_parity_for_common_frame_rates() -> None:
    for n_frames, fps in [(37, 24), (75, 25), (91, 30), (120, 60)]:
        video = prepare_video(clip("libx264", n_frames=n_frames, fps=fps), VideoParams())
        got = indices(video)
        want = qwen_indices(n_frames, fps)
        assert got == want, (n_frames, fps)
        assert video.sample_fps == pytest.approx(len(want) / (n_frames / fps))


def test_one_frame_video_is_padded_to_two() -> None:
    data = clip("libx264", n_frames=1, fps=10)
    strategies: tuple[VideoStrategy, ...] = ("fps", "interval", "keyframes")
    for strategy in strategies:
        video = prepare_video(data, VideoParams(strategy=strategy))
        assert_well_formed(video)
        assert indices(video) == [0, 0]
        assert video.timestamps == (0.0, 0.0)
        assert video.total_num_frames == 1


# --- timing ------------------------------------------------------------------------------------


VFR_TIMES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 2.0, 4.0, 6.0)


def test_variable_frame_rate_is_sampled_by_timestamp() -> None:
    # A burst of 10 frames in the first second, then one frame every 2 s. Sampling by index
    # (Qwen's linspace over frame numbers) would pick [0, 4, 8, 12], i.e. 0.0/0.4/0.8/6.0 s;
    # sampling by time must pick the frames nearest 0, 2, 4, 6 s.
    data = clip("libx264", times=VFR_TIMES, width=64, height=48)
    video = prepare_video(data, VideoParams(max_frames=4))
    assert indices(video) == [0, 10, 11, 12]
    assert video.timestamps == pytest.approx([0.0, 2.0, 4.0, 6.0])
    assert video.total_num_frames == len(VFR_TIMES)


def test_variable_frame_rate_interval_picks_nearest_frame() -> None:
    data = clip("libx264", times=VFR_TIMES, width=64, height=48)
    video = prepare_video(data, VideoParams(strategy="interval", interval_s=1.5))
    # Targets 0, 1.5, 3.0, 4.5, 6.0 → nearest frames 0.0, 2.0 (|0.5| beats |0.6|), 2.0/4.0 tie
    # goes to the earlier frame, 4.0, 6.0; odd count → padded.
    assert video.timestamps == pytest.approx([0.0, 2.0, 2.0, 4.0, 6.0, 6.0])
    assert indices(video) == [0, 10, 10, 11, 12, 12]


def test_timestamps_are_relative_to_the_first_frame() -> None:
    # MPEG-TS streams start at 1.4 s by default; callers want seconds into the video.
    data = clip("libx264", n_frames=40, fps=10, container="mpegts")
    video = prepare_video(data, VideoParams(strategy="interval", interval_s=1.0))
    assert video.timestamps == pytest.approx([0.0, 1.0, 2.0, 3.0])
    assert indices(video) == [0, 10, 20, 30]


def test_raw_elementary_stream_without_timestamps() -> None:
    # Annex-B H.264 has no container timestamps; frames are numbered at the nominal rate.
    data = clip("libx264", n_frames=40, fps=10, container="h264")
    video = prepare_video(data, VideoParams(strategy="fps", max_frames=4))
    assert_well_formed(video)
    assert indices(video) == [0, 13, 26, 39]


# --- rotation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rotation", [90, -90, 180])
def test_rotation_metadata_is_honoured(rotation: int) -> None:
    data = mv.rotated_video(rotation, upright_width=48, upright_height=80)
    video = prepare_video(data, VideoParams())
    assert video.original_size == (48, 80)
    _, h, w, _ = video.frames.shape
    assert (h, w) == smart_resize(80, 48, min_pixels=VIDEO_MIN_PIXELS, max_pixels=VIDEO_MAX_PIXELS)
    assert h > w  # portrait, as shot
    frame = video.frames[0]
    assert mv.is_red(frame[h // 10, w // 10])  # red block top-left
    assert mv.is_blue(frame[h - h // 10, w - w // 10])  # blue block bottom-right


def test_mirrored_display_matrix_is_honoured() -> None:
    upright = mv.oriented_content(64, 48)
    data = mv.encode_video(
        "libx264",
        width=64,
        height=48,
        frames=[np.ascontiguousarray(upright[:, ::-1])] * 2,
        hflip=True,
    )
    video = prepare_video(data, VideoParams())
    _, h, w, _ = video.frames.shape
    assert mv.is_red(video.frames[0][h // 10, w // 10])
    assert mv.is_blue(video.frames[0][h - h // 10, w - w // 10])


def test_unrotated_video_keeps_its_orientation() -> None:
    data = mv.encode_video("libx264", width=64, height=48, frames=[mv.oriented_content(64, 48)] * 2)
    video = prepare_video(data, VideoParams())
    _, h, w, _ = video.frames.shape
    assert w > h
    assert mv.is_red(video.frames[0][h // 10, w // 10])


# --- resizing ----------------------------------------------------------------------------------


def test_frame_budget_follows_qwen_vl_utils() -> None:
    p = VideoParams()
    for n in (2, 4, 100, 300, 768):
        expected = max(
            min(VIDEO_MAX_PIXELS, VIDEO_TOTAL_PIXELS / n * 2), int(VIDEO_MIN_PIXELS * 1.05)
        )
        assert frame_max_pixels(p, n) == int(expected)


def test_total_pixel_budget_shrinks_frames() -> None:
    data = clip("libx264", n_frames=20, fps=10, width=640, height=480)
    roomy = prepare_video(data, VideoParams())
    tight_params = VideoParams(total_pixels=300_000)  # 4 frames: 150,000 pixels each
    tight = prepare_video(data, tight_params)
    n = tight.frames.shape[0]
    cap = frame_max_pixels(tight_params, n)
    h, w = smart_resize(480, 640, min_pixels=VIDEO_MIN_PIXELS, max_pixels=cap)
    assert tight.resized_size == (w, h)
    assert VIDEO_MIN_PIXELS <= w * h <= cap < roomy.resized_size[0] * roomy.resized_size[1]
    assert indices(tight) == indices(roomy)


# --- seeking -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("codec", "container"),
    [
        ("libx264", "mp4"),
        ("libx264", "matroska"),
        ("libx264", "mpegts"),
        ("libvpx-vp9", "webm"),
        ("libx265", "mp4"),
        ("mpeg4", "avi"),
    ],
)
def test_sparse_sampling_seeks_instead_of_decoding_everything(codec: str, container: str) -> None:
    data = clip(codec, n_frames=1200, fps=10, gop=10, container=container, width=32, height=32)
    stats = DecodeStats()
    video = prepare_video(data, VideoParams(strategy="interval", interval_s=23.0), stats)
    expected = [0, 230, 460, 690, 920, 1150]
    assert indices(video) == [i % 256 for i in expected]  # the bar code holds 8 bits
    assert video.timestamps == pytest.approx([i / 10 for i in expected])
    assert stats.packets == 1200
    assert stats.seeks >= 4
    assert stats.decoded <= len(expected) * 10  # at most one GOP per frame, never the whole video


def test_dense_sampling_decodes_sequentially() -> None:
    data = clip("libx264", n_frames=40, fps=10, gop=40)
    stats = DecodeStats()
    prepare_video(data, VideoParams(strategy="fps"), stats)
    assert stats.seeks == 0
    assert stats.runs == 1
    assert stats.decoded == 40


def test_open_gop_leading_pictures_decode_from_the_previous_key_frame() -> None:
    # x264 open GOP: the B-frames just before each key frame are decoded after it and reference
    # the previous GOP. Frame 99 is such a picture for the key frame at 100.
    data = clip(
        "libx264",
        n_frames=400,
        fps=10,
        gop=10,
        x264_params="bframes=3:open-gop=1",
        width=32,
        height=32,
    )
    video = prepare_video(data, VideoParams(strategy="interval", interval_s=9.9))
    assert indices(video) == [i % 256 for i in (0, 99, 198, 297, 396, 396)]


# --- typed failures ----------------------------------------------------------------------------


def expect(error: type[PreprocessError], data: bytes, params: VideoParams | None = None) -> None:
    with pytest.raises(error) as info:
        prepare_video(data, params or VideoParams())
    assert info.value.code == error.code
    assert info.value.message


def test_audio_only_file_is_unsupported_media() -> None:
    expect(UnsupportedMedia, mv.encode_audio_only())
    assert UnsupportedMedia.code == ErrorCode.UNSUPPORTED_MEDIA


def test_video_track_without_frames_is_no_frames() -> None:
    expect(NoFrames, mv.encode_empty_video_track())


@pytest.mark.parametrize("keep", [0.3, 0.7, 0.95])
def test_truncated_mp4_without_its_index_is_undecodable(keep: float) -> None:
    # The muxer writes the index (moov) last: cut, nothing says where any frame is.
    expect(UndecodableVideo, mv.truncated(clip("libx264", n_frames=60, gop=10), keep))


def test_truncated_webm_decoding_less_than_half_is_undecodable() -> None:
    # 1.7 s of the 4 s its header declares; partial videos above the share: test_video_partial.
    expect(UndecodableVideo, mv.truncated(clip("libvpx-vp9", n_frames=40), 0.6))


@pytest.mark.parametrize("data", [b"", b"\x00\x01 not a video " * 64], ids=["empty", "garbage"])
def test_garbage_is_undecodable(data: bytes) -> None:
    expect(UndecodableVideo, data)


def test_oversized_source_is_too_large() -> None:
    expect(TooLarge, clip("libx264", n_frames=4), VideoParams(max_source_pixels=64 * 48 - 1))
    prepare_video(clip("libx264", n_frames=4), VideoParams(max_source_pixels=64 * 48))


def test_video_named_jpg_is_decoded_by_content(tmp_path: Path) -> None:
    path = tmp_path / "holiday.jpg"
    path.write_bytes(clip("libx264", n_frames=20, fps=10))
    video = prepare_video(path.read_bytes(), VideoParams())
    assert indices(video) == qwen_indices(20, 10.0)


def test_preprocess_does_not_import_heavy_dependencies() -> None:
    import subprocess

    code = (
        "import sys, mmworker_preprocess.video, mmworker_preprocess.prepare;"
        "bad = [m for m in ('torch', 'vllm', 'kafka') if m in sys.modules];"
        "print(','.join(bad)); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
