"""Video bytes → sampled, upright, resized frames for Qwen2.5-VL (FIELD-NOTES §3).

Two passes over the container, both with PyAV:

1. Demux only (no decoding): every packet's timestamps and key flag. That is cheap, and it gives
   the exact presentation time of every frame, so sampling picks frames by timestamp (correct for
   variable-frame-rate phone video, where frame index ≠ time) and knows exactly which packets must
   be decoded to reach each chosen frame.
2. Decode only what is needed: from the key frame before each chosen frame up to that frame. Long
   stretches without a chosen frame are skipped — with a container seek when the stretch is long,
   by dropping packets unseen when it is short. Dense sampling thus decodes sequentially and
   sparse sampling decodes a GOP prefix per frame, never the whole video. Within a stretch, an
   H.264 frame that no other frame references and that is not itself chosen is not decoded at
   all (the decoder's skip_frame="NONREF", set per packet): about half of the frames of a
   B-frame stream, a third of the decode time, and not one output pixel changes.

Timestamps are seconds from the first shown frame (MPEG-TS streams start at 1.4 s; users want
"seconds into the video"). Frames are turned upright from the display matrix exactly as ffmpeg's
autorotate does, then resized with Pillow's BICUBIC: measured against torchvision's antialiased
bicubic (what qwen-vl-utils uses) Pillow differs by 0.005-0.15/255 on average (at most 1/255 on
the benchmark's 720p clip); swscale differs by 2/255 on average and up to 114/255 at colour
edges, Pillow with reducing_gap=1 by 0.7/255 (up to 33/255), so neither faster resize is used.

Cost, measured on 720p H.264 (bench/README.md): decoding dominates (~1-3 ms a frame, and every
reference frame of a GOP up to the chosen one must be decoded); the RGB conversion and resize of
a chosen frame (~10 ms) run on a helper thread beside the decoder, and once the first frame has
fixed the output size a second decoder takes the later half of the stretches. Both overlap only
when a core is free: they shorten the wall time of one video, not the CPU time.

Cut and damaged files are judged by time, not by counts. A frame count in a header is no
evidence: AVI counts the frames a variable-rate camera skipped, and an index may count a frame
more than it holds. What counts is the time span that decodes, against the duration the
container declares (or, without one, the span the demuxer found): frames come from what decodes,
the result says `partial` when it falls short, and only when less than
`VideoParams.min_decoded_fraction` of it decodes is the video refused (`UndecodableVideo`). A cut
mp4 whose index was at the end has nothing to decode and is refused; a cut MPEG-TS or Ogg
declares no duration beyond its data and cannot be told from a short one.

A video whose plan needs more visual tokens than `VideoParams.max_tokens` (what its job's
context leaves it) is fitted rather than refused, before any frame is decoded: the frames shrink
first, down to Qwen's video floor (`min_pixels`, with qwen-vl-utils' 5 % margin), and only then
does the strategy plan again with fewer frames (even counts, still spread over the whole video),
which get the largest size that fits. It is refused (`TooManyVisualTokens`) only when two frames
at the floor need more. The sampling rate reported (`sample_fps`) is the fitted plan's.

Other errors are typed: no video stream → `UnsupportedMedia` (an audio file is a real, decodable
media file, just not a kind this worker captions); data no frame decodes from →
`UndecodableVideo`; a stream that yields no frame → `NoFrames`; frames above
`max_source_pixels` → `TooLarge`.
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

import av
import av.error
import numpy as np
import numpy.typing as npt
from av.container import InputContainer
from av.sidedata.sidedata import SideData
from av.stream import Disposition
from av.video.frame import VideoFrame
from av.video.stream import VideoStream
from mmworker.preprocess.avopen import open_input
from mmworker.preprocess.errors import (
    NoFrames,
    TooLarge,
    TooManyVisualTokens,
    UndecodableVideo,
    UnsupportedMedia,
)
from mmworker.preprocess.params import (
    FRAME_FACTOR,
    PreparedVideo,
    VideoParams,
    frame_max_pixels,
    video_pixel_floor,
)
from mmworker.preprocess.tokens import fit_pixels, resized, video_tokens
from PIL import Image

#: A stretch of unneeded packets at least this long is jumped with a container seek; shorter
#: stretches are demuxed and dropped, because demuxing a packet costs microseconds while a seek
#: re-reads the index and re-syncs the demuxer.
SEEK_MIN_PACKETS = 64
#: Codecs whose decoder can drop non-reference frames without changing any other frame. In H.264
#: nal_ref_idc == 0 means no picture refers to the frame. HEVC is left out: its "sub-layer
#: non-reference" pictures may still be referenced from higher temporal layers, and FFmpeg's
#: NONREF drops them all the same.
NONREF_SKIP_CODECS = frozenset({"h264"})
#: Chosen frames handed to the conversion thread and not yet converted, at most. Each holds a
#: full-size decoded picture, so this bounds memory when every frame is chosen.
MAX_PENDING_FRAMES = 4
#: Decoders working on one video at once: a second one, in its own container, takes the later
#: half of the decode stretches. Frames of a GOP form a reference chain, so FFmpeg's frame
#: threads gain nothing once non-reference frames are skipped (measured); separate GOPs are
#: independent. Two, not one per core: the worker's process pool already spreads jobs over the
#: cores, so this only fills a core left idle when fewer jobs than cores are in flight.
DECODE_THREADS = 2
#: Packets the later half must hold before a second decoder is worth its container and seek.
PARALLEL_MIN_PACKETS = 256
#: A video is `partial` when what decodes falls short of its duration by more than this many
#: seconds and this share of it: less is container rounding (an AVI index counting one frame
#: more than it holds, a track whose declared end is a frame past its last frame).
PARTIAL_SLACK_S = 0.5
PARTIAL_SLACK_SHARE = 0.02

_Transpose = Image.Transpose


@dataclass(slots=True)
class DecodeStats:
    """How much work one call did; filled in when passed to `prepare_video`.

    Lets tests prove that sparse sampling does not decode the whole video, and lets the worker
    export decode cost as a metric without timing internals.
    """

    packets: int = 0  # video packets in the stream (first pass)
    decoded: int = 0  # packets sent to the decoder
    seeks: int = 0
    runs: int = 0  # contiguous decode stretches, each starting at a key frame


@dataclass(frozen=True, slots=True)
class _Packet:
    pts: int  # presentation time in stream time-base units (synthetic when untimed)
    dts: int | None
    key: bool
    discard: bool  # mp4 edit-list pre-roll: decoded as a reference, never shown
    duration: int


@dataclass(slots=True)
class _Timeline:
    """The stream's frames as the demuxer sees them, in decode and presentation order."""

    packets: list[_Packet]  # decode order
    shown: list[int]  # decode indices of shown frames, in presentation order
    seconds: list[float]  # presentation time of shown[i], relative to the first frame
    time_base: Fraction
    timed: bool  # False: no timestamps (raw elementary stream), times are synthetic
    duration_s: float
    source_fps: float
    key_decode_idx: list[int] = field(default_factory=list)
    #: What the container says the video lasts, when it says (None: no claim to check against).
    declared_s: float | None = None
    #: Why demuxing stopped before the end of the data, when it did.
    demux_error: str | None = None

    @property
    def expected_s(self) -> float:
        """The length the video should have: the declared one, unless the frames span more."""
        return max(self.declared_s or 0.0, self.duration_s)


@dataclass(slots=True)
class _Outcome:
    """What the decode pass yielded beyond the frames: how far it got, and why it stopped."""

    #: Presentation time (s) of the latest frame any decoder produced; -1 before the first.
    good_until_s: float = -1.0
    #: The first decode error, when one cut a stretch short; its frames after it are lost.
    error: str | None = None


@dataclass(slots=True)
class _Plan:
    targets: list[int]  # presentation indices, one per output frame before padding
    sample_fps: float
    #: Per-frame pixel cap (smart_resize's max_pixels) for the frames of this plan.
    frame_pixels: int = 0

    @property
    def n_out(self) -> int:
        """Frames handed to the model: the targets, padded to pair up."""
        return len(self.targets) + len(self.targets) % FRAME_FACTOR


@dataclass(slots=True)
class _Run:
    start: int  # decode index of the key frame decoding starts at
    end: int  # decode index of the last packet needed
    wanted: list[int] = field(default_factory=list)  # presentation indices, ascending


def prepare_video(
    data: bytes, params: VideoParams, stats: DecodeStats | None = None
) -> PreparedVideo:
    """Sample frames per `params.strategy`, turn them upright and resize them for the model.

    Sampling covers the frames the demuxer found; on a cut file that is the part before the
    cut, so the frames are spread over what is there rather than bunched at its start.
    """
    stats = stats if stats is not None else DecodeStats()
    with _open(data) as container:
        stream = _video_stream(container)
        coded = (stream.codec_context.height, stream.codec_context.width)
        _check_source_size(coded[1], coded[0], params)
        timeline = _scan(container, stream, stats)
    if not timeline.shown and timeline.demux_error is not None:
        raise UndecodableVideo(f"corrupt container: {timeline.demux_error}")
    # Refused before decoding anything when the demuxer alone already finds too little.
    _judge(timeline, timeline.duration_s, hole=False, params=params)
    plan = _plan(timeline, params)
    if not plan.targets:
        raise NoFrames("the video stream has no frames")
    unfitted = plan
    plan = _fit(timeline, params, plan, coded)
    wanted = sorted(set(plan.targets))
    runs = _runs(timeline, wanted)
    captured, original_size, outcome = _decode(
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
    partial = _judge(timeline, decoded_s, hole=hole, params=params, error=outcome.error)
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
        fitted=plan is not unfitted,
    )


def _judge(
    timeline: _Timeline,
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


_Captured = dict[int, tuple[npt.NDArray[np.uint8], float]]


def _decode(
    data: bytes,
    timeline: _Timeline,
    params: VideoParams,
    frame_pixels: int,
    stats: DecodeStats,
    runs: Sequence[_Run],
) -> tuple[_Captured, tuple[int, int] | None, _Outcome]:
    """Second pass: decode `runs`, the later half on a second decoder when that pays.

    The second decoder starts only once the first has captured a frame (with fps sampling, the
    very first frame): that frame fixes the output size for every frame, as in a sequential
    decode, so a stream that changes resolution midway still yields one size. Each decoder
    reads its own container (a fresh one rather than a seek back to the start: some demuxers
    cannot seek to their first packet exactly, and reopening an in-memory file costs one
    header parse).
    """
    abort = threading.Event()
    # The converter is shut down (its work waited for) before the container closes.
    with _open(data) as container, ThreadPoolExecutor(1, "frame-convert") as converter:
        main = _Decoder(
            container=container,
            stream=_video_stream(container),
            timeline=timeline,
            params=params,
            frame_pixels=frame_pixels,
            stats=stats,
            converter=converter,
            abort=abort,
        )
        head, tail = _split(list(runs)) if main.seekable else (list(runs), [])
        if not tail:
            main.decode(head)
            return main.results(), main.original_size, main.outcome
        helper_stats = DecodeStats()
        with ThreadPoolExecutor(1, "video-decode") as pool:
            helper: Future[tuple[_Captured, _Outcome]] | None = None

            def start_helper() -> None:
                nonlocal helper
                helper = pool.submit(_decode_tail, data, main, tail, helper_stats)

            main.on_size_fixed = start_helper
            try:
                main.decode(head)
                if helper is None:  # no frame came out of the head: the tail follows here
                    main.decode(tail)
            except BaseException:
                abort.set()  # the helper stops at its next packet
                raise
            captured = main.results()
            outcome = main.outcome
            if helper is not None:
                tail_captured, tail_outcome = helper.result()
                captured |= tail_captured
                outcome = _Outcome(
                    max(outcome.good_until_s, tail_outcome.good_until_s),
                    outcome.error or tail_outcome.error,
                )
        stats.decoded += helper_stats.decoded
        stats.seeks += helper_stats.seeks
        stats.runs += helper_stats.runs
        return captured, main.original_size, outcome


def _split(runs: list[_Run]) -> tuple[list[_Run], list[_Run]]:
    """Cut the runs where about half the packets to decode lie on each side."""
    if len(runs) < 2 or DECODE_THREADS < 2 or _usable_cores() < 2:
        return runs, []
    prefix = list(itertools.accumulate(run.end - run.start + 1 for run in runs))
    k = min(range(1, len(runs)), key=lambda i: abs(2 * prefix[i - 1] - prefix[-1]))
    if prefix[-1] - prefix[k - 1] < PARALLEL_MIN_PACKETS:
        return runs, []
    return runs[:k], runs[k:]


def _usable_cores() -> int:
    """Cores this process may run on (a container's CPU set, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _decode_tail(
    data: bytes, main: _Decoder, runs: Sequence[_Run], stats: DecodeStats
) -> tuple[_Captured, _Outcome]:
    with _open(data) as container:
        helper = main.fork(container, stats)
        helper.decode(runs)
        return helper.results(), helper.outcome


def _open(data: bytes) -> InputContainer:
    try:
        return open_input(data)
    except av.error.FFmpegError as exc:
        raise UndecodableVideo(f"cannot open the container: {exc}") from None


def _video_stream(container: InputContainer) -> VideoStream:
    """The first real video stream; cover art in audio files is a video stream too: skipped."""
    streams = [s for s in container.streams.video if not s.disposition & Disposition.attached_pic]
    if not streams:
        kinds = ", ".join(sorted({str(s.type) for s in container.streams})) or "none"
        raise UnsupportedMedia(f"no video stream (streams: {kinds})")
    stream = streams[0]
    if stream.codec_context is None:
        raise UnsupportedMedia("no decoder for the video stream's codec")
    return stream


def _check_source_size(width: int, height: int, params: VideoParams) -> None:
    if width * height > params.max_source_pixels:
        raise TooLarge(
            f"video frames are {width}x{height}; the limit is {params.max_source_pixels} pixels"
        )


def _scan(container: InputContainer, stream: VideoStream, stats: DecodeStats) -> _Timeline:
    """First pass: demux every packet without decoding, up to where the data stops making sense.

    A demux error ends the scan rather than the job: the packets before it are the video there
    is, and whether that is enough is judged by time afterwards.
    """
    raw: list[tuple[int | None, int | None, bool, bool, int | None]] = []
    demux_error: str | None = None
    try:
        for packet in container.demux(stream):
            if packet.size == 0:  # the empty packet that signals end of stream
                continue
            raw.append(
                (packet.pts, packet.dts, packet.is_keyframe, packet.is_discard, packet.duration)
            )
    except av.error.FFmpegError as exc:
        demux_error = str(exc)
    stats.packets = len(raw)
    declared_s = _declared_duration(container, stream)
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    timed = stream.time_base is not None and all(
        (p if p is not None else d) is not None for p, d, *_ in raw
    )
    if timed:
        assert stream.time_base is not None
        time_base = stream.time_base
        packets = [
            _Packet(p if p is not None else d or 0, d, k, x, max(dur or 0, 0))
            for p, d, k, x, dur in raw
        ]
    else:
        # A raw elementary stream (e.g. Annex-B .h264) carries no timestamps: number the frames
        # and space them at the nominal rate. Decoded frames are then matched by output order.
        per_frame = Fraction(1) / Fraction(rate) if rate else Fraction(1, 25)
        time_base = per_frame
        packets = [_Packet(i, None, k, x, 1) for i, (_, _, k, x, _) in enumerate(raw)]
    shown = sorted(
        (i for i, p in enumerate(packets) if not p.discard), key=lambda i: packets[i].pts
    )
    if not shown:
        empty = _Timeline(packets, [], [], time_base, timed, 0.0, float(rate or 0.0))
        empty.demux_error = demux_error
        return empty
    origin = packets[shown[0]].pts
    seconds = [float((packets[i].pts - origin) * time_base) for i in shown]
    duration_s = _duration(packets, shown, seconds, time_base, rate)
    source_fps = float(rate) if rate else _rate(len(shown), duration_s, 0.0)
    timeline = _Timeline(packets, shown, seconds, time_base, timed, duration_s, source_fps)
    timeline.key_decode_idx = [i for i, p in enumerate(packets) if p.key]
    timeline.declared_s = declared_s if timed else None
    timeline.demux_error = demux_error
    return timeline


def _declared_duration(container: InputContainer, stream: VideoStream) -> float | None:
    """How long the container says the video lasts, or None when it makes no such claim.

    The stream's own duration first (mp4 `mdhd`, AVI `strh`, ASF, MXF). The container's
    duration only for a single-stream file: beside audio it may rightly exceed the video's.
    Where a format states no duration FFmpeg estimates one from the data that is there (MPEG-TS
    and Ogg from their last timestamps, an AVI without its index from the bytes), so a cut is
    seen only as far as that estimate sees it.
    """
    if stream.duration and stream.duration > 0 and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration and container.duration > 0 and len(container.streams) == 1:
        return container.duration / 1_000_000  # AV_TIME_BASE
    return None


def _duration(
    packets: Sequence[_Packet],
    shown: Sequence[int],
    seconds: Sequence[float],
    time_base: Fraction,
    rate: Fraction | None,
) -> float:
    """Span of the shown frames plus the last frame's own display time (Qwen: frames / fps)."""
    last = packets[shown[-1]]
    if last.duration > 0:
        tail = float(last.duration * time_base)
    elif len(seconds) > 1:
        gaps = np.diff(np.asarray(seconds))
        tail = float(np.median(gaps[gaps > 0])) if np.any(gaps > 0) else 0.0
    else:
        tail = float(1 / rate) if rate else 0.0
    return seconds[-1] + tail


def _floor_even(n: float) -> int:
    return math.floor(n / FRAME_FACTOR) * FRAME_FACTOR


def _ceil_even(n: float) -> int:
    return math.ceil(n / FRAME_FACTOR) * FRAME_FACTOR


def _plan(timeline: _Timeline, params: VideoParams) -> _Plan:
    """Choose which shown frames to keep, per strategy, and the per-frame pixel cap they get."""
    plan = _choose(timeline, params)
    plan.frame_pixels = frame_max_pixels(params, plan.n_out)
    return plan


def _fit(timeline: _Timeline, params: VideoParams, plan: _Plan, coded: tuple[int, int]) -> _Plan:
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
        plan = _plan(timeline, replace(params, max_frames=pairs * FRAME_FACTOR))
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
    plan.frame_pixels = cap
    return plan


def _choose(timeline: _Timeline, params: VideoParams) -> _Plan:
    """Choose which shown frames to keep, per strategy; all choices are by presentation time."""
    total = len(timeline.shown)
    if total == 0:
        return _Plan([], params.fps)
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
        return _Plan(targets, _rate(n, duration, params.fps))
    if params.strategy == "interval":
        count = math.floor(last / params.interval_s + 1e-9) + 1
        if count <= cap:
            times = np.arange(count) * params.interval_s
            return _Plan(_nearest(timeline.seconds, times), 1.0 / params.interval_s)
        targets = _nearest(timeline.seconds, np.linspace(0.0, last, cap))
        return _Plan(targets, _rate(cap, duration, 1.0 / params.interval_s))
    if params.strategy == "keyframes":
        # Key frames come from the demuxer's flags, and only those packets reach the decoder.
        # The decoder's skip_frame="NONKEY" is not relied on: FFmpeg's VP9 decoder ignores it
        # (measured: every frame came out), while packet flags mean the same for every codec.
        packets = timeline.packets
        keys = [i for i, d in enumerate(timeline.shown) if packets[d].key]
        if len(keys) > cap:
            picks = np.linspace(0, len(keys) - 1, cap).round().astype(int)
            keys = [keys[int(i)] for i in picks]
        return _Plan(keys, _rate(len(keys), duration, params.fps))
    raise ValueError(f"unknown video strategy {params.strategy!r}")


def _rate(n: int, duration: float, fallback: float) -> float:
    """Frames per second of the sample (Qwen: nframes / total * video_fps)."""
    return n / duration if duration > 0 else fallback


def _nearest(seconds: Sequence[float], targets: npt.NDArray[np.floating[Any]]) -> list[int]:
    """Index of the frame whose time is nearest each target; a tie goes to the earlier frame."""
    out = []
    for t in targets.tolist():
        j = bisect.bisect_left(seconds, t)
        if j == len(seconds) or (j > 0 and t - seconds[j - 1] <= seconds[j] - t):
            j -= 1
        out.append(j)
    return out


def _runs(timeline: _Timeline, wanted: Sequence[int]) -> list[_Run]:
    """Group the wanted frames into decode stretches, each starting at a key frame."""
    packets = timeline.packets
    keys = timeline.key_decode_idx
    runs: list[_Run] = []
    for w in wanted:
        d = timeline.shown[w]
        start = 0
        if timeline.timed and keys:
            k = bisect.bisect_right(keys, d) - 1
            # An open-GOP leading picture is shown before its key frame but references the
            # GOP before it, so decoding has to start one key frame earlier.
            while k > 0 and packets[keys[k]].pts > packets[d].pts:
                k -= 1
            start = keys[k] if k >= 0 else 0
        if runs and start <= runs[-1].end + 1:
            runs[-1].end = max(runs[-1].end, d)
            runs[-1].wanted.append(w)
        else:
            runs.append(_Run(start, d, [w]))
    for run in runs:
        run.wanted.sort()
    return runs


class _Decoder:
    """Second pass: decode the planned runs and keep the wanted frames, resized and upright."""

    def __init__(
        self,
        *,
        container: InputContainer,
        stream: VideoStream,
        timeline: _Timeline,
        params: VideoParams,
        frame_pixels: int,
        stats: DecodeStats,
        converter: ThreadPoolExecutor,
        abort: threading.Event,
    ) -> None:
        self.container = container
        self.stream = stream
        self.timeline = timeline
        self.params = params
        self.frame_pixels = frame_pixels
        self.stats = stats
        self.original_size: tuple[int, int] | None = None
        self.outcome = _Outcome()
        self._target: tuple[int, int] | None = None  # (height, width), upright
        self._by_key = {(p.pts, p.dts): i for i, p in enumerate(timeline.packets)}
        self._seekable = timeline.timed and len(self._by_key) == len(timeline.packets)
        self._converter = converter
        self._abort = abort
        self._packet_iter: Iterator[av.Packet[VideoStream]] | None = None
        self._position = 0
        #: Called once, when the first captured frame has fixed the output size.
        self.on_size_fixed: Callable[[], None] | None = None
        self._pending: deque[Future[npt.NDArray[np.uint8]]] = deque()
        self._captured: dict[int, tuple[Future[npt.NDArray[np.uint8]], float]] = {}
        # Untimed streams match frames by output order, which skipped frames would shift.
        codec = stream.codec_context
        self._skip_nonref = (
            timeline.timed and codec is not None and codec.name in NONREF_SKIP_CODECS
        )

    def decode(self, runs: Sequence[_Run]) -> None:
        """Decode the runs, which must lie after any this decoder has done already.

        A decode error ends only the run it happens in (see `outcome`); the next run starts
        afresh at its own key frame, so one damaged stretch costs only its own frames.
        """
        try:
            self._decode(runs)
        except av.error.FFmpegError as exc:
            raise UndecodableVideo(f"corrupt video data: {exc}") from None

    def results(self) -> _Captured:
        try:
            return {w: (future.result(), s) for w, (future, s) in self._captured.items()}
        except av.error.FFmpegError as exc:
            raise UndecodableVideo(f"corrupt video data: {exc}") from None

    @property
    def seekable(self) -> bool:
        """Whether another decoder could start at a later run: it has to seek there."""
        return self._seekable

    def fork(self, container: InputContainer, stats: DecodeStats) -> _Decoder:
        """A decoder on another container of the same data, producing the same frame size."""
        other = _Decoder(
            container=container,
            stream=_video_stream(container),
            timeline=self.timeline,
            params=self.params,
            frame_pixels=self.frame_pixels,
            stats=stats,
            converter=self._converter,
            abort=self._abort,
        )
        other._target, other.original_size = self._target, self.original_size
        return other

    def _decode(self, runs: Sequence[_Run]) -> None:
        codec = self.stream.codec_context
        packets = self._packets()
        position = self._position  # decode index of the next packet `packets` yields
        for run in runs:
            self.stats.runs += 1
            if self._seekable and run.start - position >= SEEK_MIN_PACKETS:
                packets, position = self._seek(run.start)
            matcher = _RunMatcher(self, run)
            chosen = {self.timeline.shown[w] for w in run.wanted}
            try:
                for packet in packets:
                    index = position
                    position += 1
                    if index < run.start:
                        continue
                    if self._abort.is_set():
                        return
                    self.stats.decoded += 1
                    if self._skip_nonref:
                        # The decoder reads it as each packet is sent (frame threads copy it on
                        # submission), so a chosen non-reference frame is still decoded.
                        codec.skip_frame = "DEFAULT" if index in chosen else "NONREF"
                    for frame in codec.decode(packet):
                        matcher.offer(frame)
                    if index >= run.end:
                        break
                # Drain so the run's last frames come out without feeding packets we do not
                # need, then reset the decoder for the next run's key frame.
                for frame in codec.decode(None):
                    matcher.offer(frame)
            except av.error.FFmpegError as exc:
                # Damaged or cut data (the last packet of a cut mp4 is short). The frames the
                # decoder already holds still come out; `finish` is skipped, since it would
                # stand the last good frame in for every frame after the damage.
                if self.outcome.error is None:
                    self.outcome.error = str(exc)
                self._drain(matcher)
                codec.flush_buffers()
                continue
            codec.flush_buffers()
            matcher.finish()
        self._position, self._packet_iter = position, packets

    def _drain(self, matcher: _RunMatcher) -> None:
        """Collect the frames a decoder that just failed on a packet still holds."""
        try:
            for frame in self.stream.codec_context.decode(None):
                matcher.offer(frame)
        except av.error.FFmpegError:
            # It cannot even drain: the frames it held are lost with the damaged one, which
            # `outcome.error` already reports.
            return

    def _packets(self) -> Iterator[av.Packet[VideoStream]]:
        """The packet iterator, picked up where the previous `decode` call left it."""
        if self._packet_iter is None:
            self._packet_iter = (p for p in self.container.demux(self.stream) if p.size)
        return self._packet_iter

    def _seek(self, start: int) -> tuple[Iterator[av.Packet[VideoStream]], int]:
        """Seek to the key frame at decode index `start`; return packets from there and its index.

        The demuxer may land on an earlier key frame (fine: the gap is demuxed and dropped) or,
        with a poor index, a later one; then it seeks back to the very first packet and stops
        seeking, which is slow but still exact.
        """
        key = self.timeline.packets[start]
        landed = self._seek_to(min(x for x in (key.pts, key.dts) if x is not None))
        if landed is not None and landed[1] <= start:
            return landed
        self._seekable = False
        first = self.timeline.packets[0]
        landed = self._seek_to(min(x for x in (first.pts, first.dts) if x is not None))
        if landed is None or landed[1] != 0:
            raise UndecodableVideo("the container cannot seek back to its first frame")
        return landed

    def _seek_to(self, stamp: int) -> tuple[Iterator[av.Packet[VideoStream]], int] | None:
        self.stats.seeks += 1
        self.container.seek(stamp, backward=True, any_frame=False, stream=self.stream)
        self._packet_iter = None  # a fresh demux from the new position
        packets = self._packets()
        first = next(packets, None)
        if first is None:
            return None
        pts = first.pts if first.pts is not None else first.dts
        index = None if pts is None else self._by_key.get((pts, first.dts))
        if index is None:
            return None
        return _prepend(first, packets), index

    def capture(self, shown_index: int, frame: VideoFrame, seconds: float) -> None:
        """Queue the frame's conversion on the helper thread; the decoder goes on meanwhile.

        PyAV's decode, swscale and Pillow's resize all release the GIL, so the two overlap.
        """
        if shown_index in self._captured:
            return
        size, ops = self._geometry(frame)
        if len(self._pending) >= MAX_PENDING_FRAMES:
            self._pending.popleft().result()  # also surfaces a conversion error early
        future = self._converter.submit(_to_pixels, frame, size, ops)
        self._pending.append(future)
        self._captured[shown_index] = (future, seconds)

    def _geometry(self, frame: VideoFrame) -> tuple[tuple[int, int], list[Image.Transpose]]:
        """Check the frame and fix the output size on the first one: (size to resize to, ops)."""
        _check_source_size(frame.width, frame.height, self.params)
        ops = _orientation(frame)
        swap = any(op in _SWAPS for op in ops)
        upright = (frame.height, frame.width) if not swap else (frame.width, frame.height)
        if self._target is None:
            self.original_size = (upright[1], upright[0])
            self._target = resized(
                upright[0],
                upright[1],
                min_pixels=self.params.min_pixels,
                max_pixels=self.frame_pixels,
                max_ratio=self.params.max_ratio,
                video=True,
            )
            if self.on_size_fixed is not None:
                self.on_size_fixed()
        height, width = self._target
        # Resize in the coded orientation, then transpose: same pixels, less work on the rotate.
        return ((height, width) if swap else (width, height)), ops


def _to_pixels(
    frame: VideoFrame, size: tuple[int, int], ops: Sequence[Image.Transpose]
) -> npt.NDArray[np.uint8]:
    """RGB, resized to `size` (width, height) with Pillow's BICUBIC, then turned upright."""
    image = Image.fromarray(np.asarray(frame.to_ndarray(format="rgb24"), dtype=np.uint8))
    if image.size != size:
        image = image.resize(size, Image.Resampling.BICUBIC)
    for op in ops:
        image = image.transpose(op)
    return np.asarray(image, dtype=np.uint8)


class _RunMatcher:
    """Assign decoded frames of one run to the wanted frames, by presentation timestamp.

    Frames leave the decoder in presentation order. A wanted frame takes the decoded frame with
    its exact timestamp; if the decoder never produces that timestamp (a dropped or re-timed
    frame), the nearest decoded neighbour stands in, so one bad frame does not fail the video.
    """

    def __init__(self, decoder: _Decoder, run: _Run) -> None:
        self.decoder = decoder
        self.timeline = decoder.timeline
        self.pending = list(run.wanted)
        packets = self.timeline.packets
        self.floor = packets[run.start].pts if self.timeline.timed else -1
        self.prev: tuple[VideoFrame, int] | None = None
        self.ordinal = 0

    def _pts(self, w: int) -> int:
        return self.timeline.packets[self.timeline.shown[w]].pts

    def _seconds_of(self, pts: int) -> float:
        origin = self.timeline.packets[self.timeline.shown[0]].pts
        return float((pts - origin) * self.timeline.time_base)

    def offer(self, frame: VideoFrame) -> None:
        if self.timeline.timed:
            pts = frame.pts
            if pts is None or pts < self.floor:
                return  # leading pictures of the start key frame, decoded without references
        else:
            pts = self.ordinal
            self.ordinal += 1
        outcome = self.decoder.outcome
        outcome.good_until_s = max(outcome.good_until_s, self._seconds_of(pts))
        while self.pending and self._pts(self.pending[0]) <= pts:
            w = self.pending.pop(0)
            want = self._pts(w)
            use, use_pts = frame, pts
            if want != pts and self.prev is not None and want - self.prev[1] <= pts - want:
                use, use_pts = self.prev
            self.decoder.capture(w, use, self._seconds_of(use_pts))
        self.prev = (frame, pts)

    def finish(self) -> None:
        if self.prev is None:
            return
        frame, pts = self.prev
        for w in self.pending:
            self.decoder.capture(w, frame, self._seconds_of(pts))
        self.pending.clear()


def _prepend(
    first: av.Packet[VideoStream], rest: Iterator[av.Packet[VideoStream]]
) -> Iterator[av.Packet[VideoStream]]:
    yield first
    yield from rest


_SWAPS = frozenset(
    {_Transpose.ROTATE_90, _Transpose.ROTATE_270, _Transpose.TRANSPOSE, _Transpose.TRANSVERSE}
)


def _orientation(frame: VideoFrame) -> list[Image.Transpose]:
    """Pillow transposes that show the frame upright, mirroring ffmpeg's own autorotate.

    The display matrix (mp4 `tkhd`, carried to each frame as side data) is interpreted exactly
    as fftools/ffmpeg_filter.c does, flips included. Angles that are not a multiple of 90° are
    snapped to the nearest one: phones only write multiples of 90°.
    """
    side = frame.side_data.get("DISPLAYMATRIX")
    if not isinstance(side, SideData):
        return []
    m = np.frombuffer(bytes(side), dtype=np.int32)
    if m.size < 9:
        return []
    a, b, c, d = (float(x) / 65536.0 for x in (m[0], m[1], m[3], m[4]))
    scale0, scale1 = math.hypot(a, c), math.hypot(b, d)
    if scale0 == 0.0 or scale1 == 0.0:
        return []
    # av_display_rotation_get(), then fftools get_rotation().
    theta = -round(-math.degrees(math.atan2(b / scale1, a / scale0)))
    theta -= 360 * math.floor(theta / 360 + 0.9 / 360)
    theta = (round(theta / 90) * 90) % 360
    if theta == 90:
        return [_Transpose.TRANSPOSE if m[3] > 0 else _Transpose.ROTATE_270]
    if theta == 180:
        ops = []
        if m[0] < 0:
            ops.append(_Transpose.FLIP_LEFT_RIGHT)
        if m[4] < 0:
            ops.append(_Transpose.FLIP_TOP_BOTTOM)
        return ops
    if theta == 270:
        return [_Transpose.TRANSVERSE if m[3] < 0 else _Transpose.ROTATE_90]
    return [_Transpose.FLIP_TOP_BOTTOM] if m[4] < 0 else []
