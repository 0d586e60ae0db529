"""The metadata handed to vLLM with a prepared video's frames sets Qwen's temporal positions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import media_videos as mv
from mmworker_preprocess.params import VideoParams
from mmworker_preprocess.video import prepare_video

from mmworker.engine.video_metadata import vllm_video_metadata


def test_vllm_metadata_carries_the_sampling_rate() -> None:
    video = prepare_video(mv.encode_video("libx264", n_frames=40, fps=10), VideoParams())
    meta = vllm_video_metadata(video)
    n = video.frames.shape[0]
    assert meta["total_num_frames"] == n
    assert meta["frames_indices"] == list(range(n))
    assert meta["do_sample_frames"] is False
    assert meta["duration"] == pytest.approx(4.0)
    # transformers' VideoMetadata.sampled_fps = len(indices) / total * fps: must be sample_fps,
    # since Qwen2.5-VL derives second_per_grid_ts = 2 / sampled_fps from it.
    fps, chosen, total = meta["fps"], meta["frames_indices"], meta["total_num_frames"]
    assert isinstance(fps, float) and isinstance(chosen, list) and isinstance(total, int)
    assert len(chosen) / total * fps == pytest.approx(video.sample_fps)
    assert video.sample_fps == pytest.approx(n / 4.0)
