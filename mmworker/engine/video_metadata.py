"""The metadata vLLM's Qwen2.5-VL processor takes with each video's frames.

It lives with the engine rather than with the prepared video because its shape is vLLM's: the
model's data parser insists on a `(frames, metadata)` pair for every video, turns every key but
`do_sample_frames` into transformers' `VideoMetadata`, and uses the same keys for its own dummy
videos (vllm/model_executor/models/qwen2_5_vl.py). A vLLM upgrade that changes them is absorbed
here, not in `preprocess`, which knows nothing of vLLM.
"""

from __future__ import annotations

from mmworker_preprocess.params import PreparedVideo


def vllm_video_metadata(video: PreparedVideo) -> dict[str, object]:
    """The metadata dict for `video`'s frames.

    The frames are already sampled, so `do_sample_frames=False` and the indices are just
    0..T-1; `fps` is the rate they were sampled at, which sets Qwen's temporal position ids.
    """
    n = int(video.frames.shape[0])
    return {
        "fps": video.sample_fps,
        "duration": video.duration_s,
        "total_num_frames": n,
        "frames_indices": list(range(n)),
        "video_backend": "opencv",
        "do_sample_frames": False,
    }
