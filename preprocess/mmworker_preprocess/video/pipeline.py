"""`prepare_video`: the steps of the package in order, and the checks that sit between them.

The order is the point: everything that can refuse a video from its header and timeline (size,
damage, token budget) runs before the first frame is decoded.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from mmworker_preprocess.errors import NoFrames, TooManyVisualTokens, UndecodableVideo
from mmworker_preprocess.params import FRAME_FACTOR, PreparedVideo, VideoParams
from mmworker_preprocess.tokens import video_tokens
from mmworker_preprocess.video.container import check_source_size, open_container, video_stream
from mmworker_preprocess.video.decode import decode
from mmworker_preprocess.video.partial import judge
from mmworker_preprocess.video.sampling import fit, plan_frames
from mmworker_preprocess.video.schedule import decode_runs
from mmworker_preprocess.video.stats import DecodeStats
from mmworker_preprocess.video.timeline import scan


def prepare_video(
    data: bytes, params: VideoParams, stats: DecodeStats | None = None
) -> PreparedVideo:
    """Sample frames per `params.strategy`, turn them upright and resize them for the model.

    Sampling covers the frames the demuxer found; on a cut file that is the part before the
    cut, so the frames are spread over what is there rather than bunched at its start.
    """
    stats = stats if stats is not None else DecodeStats()
    with open_container(data) as container:
        stream = video_stream(container)
        coded = (stream.codec_context.height, stream.codec_context.width)
        check_source_size(coded[1], coded[0], params)
        timeline = scan(container, stream, stats)
    if not timeline.shown and timeline.demux_error is not None:
        raise UndecodableVideo(f"corrupt container: {timeline.demux_error}")
    # Refused before decoding anything when the demuxer alone already finds too little.
    judge(timeline, timeline.duration_s, hole=False, params=params)
    plan = plan_frames(timeline, params)
    if not plan.targets:
        raise NoFrames("the video stream has no frames")
    unfitted = plan
    plan = fit(timeline, params, plan, coded)
    wanted = sorted(set(plan.targets))
    runs = decode_runs(timeline, wanted)
    captured, original_size, outcome = decode(
        data, timeline, params, plan.frame_pixels, stats, runs
    )
    frames: list[npt.NDArray[np.uint8]] = []
    timestamps: list[float] = []
    for target in plan.targets:
        if target in captured:
            frame, seconds = captured[target]
            frames.append(frame)
            timestamps.append(seconds)
    if not frames:
        if outcome.error is not None:
            raise UndecodableVideo(f"corrupt video data: {outcome.error}")
        raise NoFrames("no frame of the video stream could be decoded")
    decoded_s = timeline.duration_s
    if outcome.error is not None:
        # The span up to the latest frame that came out, plus that frame's own display time.
        tail = timeline.duration_s - timeline.seconds[-1]
        decoded_s = min(decoded_s, outcome.good_until_s + tail)
    # Frames lost before the latest one that decoded leave a hole the time span does not show.
    hole = any(
        timeline.seconds[t] < outcome.good_until_s for t in plan.targets if t not in captured
    )
    partial = judge(timeline, decoded_s, hole=hole, params=params, error=outcome.error)
    if len(frames) % FRAME_FACTOR:
        # Qwen merges frames in pairs; repeating the last one is what its processor does too.
        frames.append(frames[-1])
        timestamps.append(timestamps[-1])
    assert original_size is not None
    out = np.ascontiguousarray(np.stack(frames))
    budget = params.budget
    if budget is not None and video_tokens(*out.shape[:3]) > budget:
        # Only when the decoded frames are not the size the stream's header announced.
        raise TooManyVisualTokens(
            f"video frames came out {out.shape[2]}x{out.shape[1]}, not the "
            f"{coded[1]}x{coded[0]} the stream declares: {out.shape[0]} frames need "
            f"{video_tokens(*out.shape[:3])} visual tokens; the budget is {budget}"
        )
    return PreparedVideo(
        frames=out,
        original_size=original_size,
        timestamps=tuple(timestamps),
        duration_s=decoded_s,
        source_fps=timeline.source_fps,
        total_num_frames=len(timeline.shown),
        # Frames lost to damage leave the others where the plan put them: the sampling rate
        # (Qwen's temporal positions) is still the plan's.
        sample_fps=plan.sample_fps,
        partial=partial,
        full_duration_s=timeline.expected_s if partial else None,
        fitted=plan != unfitted,
    )
