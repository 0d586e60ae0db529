"""How much of a cut or damaged video is enough: judged by time, once after each pass.

One rule for both passes, so a video the demuxer already finds too short is refused before any
decoding by the same test that later weighs what the decoder got through.
"""

from __future__ import annotations

from mmworker_preprocess.errors import UndecodableVideo
from mmworker_preprocess.params import PreparedVideo, VideoParams
from mmworker_preprocess.video.timeline import Timeline

#: A video is `partial` when what decodes falls short of its duration by more than this many
#: seconds and this share of it: less is container rounding (an AVI index counting one frame
#: more than it holds, a track whose declared end is a frame past its last frame).
PARTIAL_SLACK_S = 0.5
PARTIAL_SLACK_SHARE = 0.02


def judge(
    timeline: Timeline,
    decoded_s: float,
    *,
    hole: bool,
    params: VideoParams,
    error: str | None = None,
) -> bool:
    """Whether only part of the video decoded; refuse it when that part is too small a share.

    A shortfall within the slack is rounding, not damage (see PARTIAL_SLACK_S), whether the
    demuxer ran out of packets or the decoder out of good data.
    """
    expected = timeline.expected_s
    shortfall = expected - decoded_s
    partial = hole or shortfall > max(PARTIAL_SLACK_S, PARTIAL_SLACK_SHARE * expected)
    if not partial or expected <= 0:
        return partial
    share = max(decoded_s, 0.0) / expected
    if share < params.min_decoded_fraction:
        why = error or timeline.demux_error
        declared = (
            "declared" if timeline.declared_s and timeline.declared_s >= expected else "found"
        )
        raise UndecodableVideo(
            f"truncated video: {max(decoded_s, 0.0):.2f} s of the {expected:.2f} s {declared} "
            f"decode ({share:.0%}; at least {params.min_decoded_fraction:.0%} must)"
            + (f": {why}" if why else "")
        )
    return partial


def judge_cached(video: PreparedVideo, params: VideoParams) -> None:
    """Refuse a partial video from the feature cache as `judge` would under `params`: the
    setting is not in the cache key (see `VideoParams.cache_key_fields`), so an entry prepared
    under a lower `min_decoded_fraction` was served where the current one refuses it."""
    expected = video.full_duration_s
    if not video.partial or not expected or expected <= 0:
        return
    share = max(video.duration_s, 0.0) / expected
    if share < params.min_decoded_fraction:
        raise UndecodableVideo(
            f"truncated video: {max(video.duration_s, 0.0):.2f} s of the {expected:.2f} s "
            f"decode ({share:.0%}; at least {params.min_decoded_fraction:.0%} must)"
        )
