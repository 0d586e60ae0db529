"""The first pass: every frame's timestamps and key flag, from demuxing alone.

Sampling and decode scheduling both work from this timeline rather than from frame counts or a
nominal rate, which variable-rate phone video and damaged containers would make wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import av.error
import numpy as np
from av.container import InputContainer
from av.video.stream import VideoStream

from mmworker_preprocess.video.stats import DecodeStats


@dataclass(frozen=True, slots=True)
class Packet:
    pts: int  # presentation time in stream time-base units (synthetic when untimed)
    dts: int | None
    key: bool
    discard: bool  # mp4 edit-list pre-roll: decoded as a reference, never shown
    duration: int


@dataclass(slots=True)
class Timeline:
    """The stream's frames as the demuxer sees them, in decode and presentation order."""

    packets: list[Packet]  # decode order
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


def scan(container: InputContainer, stream: VideoStream, stats: DecodeStats) -> Timeline:
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
            Packet(p if p is not None else d or 0, d, k, x, max(dur or 0, 0))
            for p, d, k, x, dur in raw
        ]
    else:
        # A raw elementary stream (e.g. Annex-B .h264) carries no timestamps: number the frames
        # and space them at the nominal rate. Decoded frames are then matched by output order.
        per_frame = Fraction(1) / Fraction(rate) if rate else Fraction(1, 25)
        time_base = per_frame
        packets = [Packet(i, None, k, x, 1) for i, (_, _, k, x, _) in enumerate(raw)]
    shown = sorted(
        (i for i, p in enumerate(packets) if not p.discard), key=lambda i: packets[i].pts
    )
    if not shown:
        empty = Timeline(packets, [], [], time_base, timed, 0.0, float(rate or 0.0))
        empty.demux_error = demux_error
        return empty
    origin = packets[shown[0]].pts
    seconds = [float((packets[i].pts - origin) * time_base) for i in shown]
    duration_s = _duration(packets, shown, seconds, time_base, rate)
    source_fps = float(rate) if rate else sample_rate(len(shown), duration_s, 0.0)
    timeline = Timeline(packets, shown, seconds, time_base, timed, duration_s, source_fps)
    timeline.key_decode_idx = [i for i, p in enumerate(packets) if p.key]
    timeline.declared_s = declared_s if timed else None
    timeline.demux_error = demux_error
    return timeline


def sample_rate(n: int, duration: float, fallback: float) -> float:
    """Frames per second of the sample (Qwen: nframes / total * video_fps)."""
    return n / duration if duration > 0 else fallback


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
    packets: Sequence[Packet],
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
