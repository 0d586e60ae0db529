"""Segment mode: one stretch of a video at a time, never the whole video's frames at once.

A long video is not prepared whole: `prepare_segment(data, params, rule, start_s)` seeks to the
key frame before `start_s`, decodes forward, finds where the segment ends (a fixed length, or a
scene change) and returns that segment's frames, sampled and sized by the usual `VideoParams`
rules within it, with the time the next segment starts. The worker calls it once per segment,
each call in its process pool, and hands a segment to the engine as soon as it is back, so the
first captions are generated while the rest of the video is still being decoded.

Mode "scenes" has to look at every frame to find the cuts: apart from the GOP prefix decoded
again after each seek, every frame is decoded once. Mode "fixed" knows its bounds from the
timeline (`timeline.scan`, demuxing only), so it decodes only what its sampled frames need, with
`prepare_video`'s scheduler and decoder (a GOP prefix per sampled frame at most).

Scene changes are found from frame differences: every decoded frame is scaled down to 32x32
RGB (swscale, a few microseconds) and compared with the one before; a mean absolute difference
of at least `threshold` (0..1 of full scale, over pixels and channels) is a cut, unless the
segment is still shorter than `min_s`; at `max_s` it is cut regardless. Hard cuts between solid
colours scored 0.22-0.67 in the tests' clips, a square moving within a scene at most 0.015; the
default threshold, 0.15, sits between. No dependency beyond PyAV and NumPy.

Memory, per call (that is, per job: the worker decodes one segment of a job at a time): the
sampled frames of one segment, at most `2 × max_frames` of them at the segment's frame size
(they are thinned by half whenever that many are held), plus one decoded picture and a 32x32
thumbnail. It does not grow with the video's length. Mode "fixed" also keeps, per process, the
timelines of the videos it decoded last (`TIMELINE_CACHE_PACKETS`, about 280 bytes a frame), so
the demux pass runs once per video and process, not once per segment.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import av.error
import numpy as np
import numpy.typing as npt
from av.container import InputContainer
from av.video.frame import VideoFrame
from av.video.stream import VideoStream
from PIL import Image

from mmworker_preprocess.errors import NoFrames, TooManyVisualTokens, UndecodableVideo
from mmworker_preprocess.params import FRAME_FACTOR, PreparedVideo, VideoParams, frame_max_pixels
from mmworker_preprocess.tokens import resized, video_tokens
from mmworker_preprocess.video.container import check_source_size, open_container, video_stream
from mmworker_preprocess.video.decode import decode
from mmworker_preprocess.video.orientation import SWAPS, orientation
from mmworker_preprocess.video.schedule import decode_runs
from mmworker_preprocess.video.stats import DecodeStats
from mmworker_preprocess.video.timeline import Timeline, scan

#: Side of the RGB thumbnails scene detection compares (colour, not grey: red and blue scenes
#: can have nearly the same luma).
THUMB = 32
#: Time slack (s) when comparing frame times with segment bounds: container time bases round.
EPS = 1e-3
#: Frames (demuxed packets) of the timelines a pool process keeps for the videos it cuts in fixed
#: mode, across jobs. Each segment is one call, and demuxing the whole video again in every call
#: was 40 % of a 60 s segment's decode time on a ten-minute clip (`bench/segments.py`). About 280
#: bytes per frame: 150,000 frames (~40 MiB) hold an hour at 30 fps, or ten ten-minute clips at
#: 25 fps decoded side by side; a longer video is demuxed in every call, as before.
TIMELINE_CACHE_PACKETS = 150_000

#: Part of every segment's feature-cache key: raise it when a change here changes which frames a
#: segment gets or where it ends, so no cached segment of the old rules is served.
SEGMENT_VERSION = 1

_timelines: OrderedDict[str, Timeline] = OrderedDict()


@dataclass(frozen=True, slots=True)
class SegmentRule:
    """How segments end; plain values so it crosses the process pool."""

    mode: Literal["fixed", "scenes"]
    every_s: float = 0.0
    threshold: float = 0.15
    min_s: float = 2.0
    max_s: float = 60.0

    @property
    def longest_s(self) -> float:
        return self.every_s if self.mode == "fixed" else self.max_s

    def cache_key_fields(self) -> dict[str, object]:
        """What decides a segment's bounds: only `every_s` in fixed mode, the rest in scenes."""
        if self.mode == "fixed":
            fields: dict[str, object] = {"mode": "fixed", "every_s": self.every_s}
        else:
            fields = {"mode": "scenes", "threshold": self.threshold, "min_s": self.min_s,
                      "max_s": self.max_s}  # fmt: skip
        return {**fields, "v": SEGMENT_VERSION}


@dataclass(frozen=True, slots=True)
class PreparedSegment:
    start_s: float
    #: Where the next segment starts (the frame after the cut); the video's end when `last`.
    end_s: float
    video: PreparedVideo
    #: No frame follows: this is the video's last segment.
    last: bool
    #: The segment ended at a scene change (not at `max_s`, a fixed length or the video's end).
    scene_cut: bool = False


def prepare_segment(
    data: bytes,
    params: VideoParams,
    rule: SegmentRule,
    start_s: float,
    stats: DecodeStats | None = None,
    content_key: str | None = None,
) -> PreparedSegment:
    """The segment that starts at `start_s` (seconds from the first frame). `content_key`: the
    data's content hash, under which its timeline is kept for the video's next segments."""
    if rule.mode == "fixed":
        return _fixed_segment(data, params, rule.every_s, start_s, stats, content_key)
    with open_container(data) as container:
        stream = video_stream(container)
        codec = stream.codec_context
        check_source_size(codec.width, codec.height, params)
        codec.thread_type = "AUTO"
        cutter = _Cutter(rule, start_s)
        keeper = _Keeper(params, start_s)
        next_start: float | None = None
        for frame, seconds in _frames_from(container, stream, start_s):
            if seconds < start_s - EPS:
                continue  # the GOP prefix before the segment: decoded only as a reference
            thumb = _thumb(frame)
            if cutter.ends_before(seconds, thumb):
                next_start = seconds
                break
            keeper.offer(frame, seconds)
        video = keeper.finish(next_start)
    end_s = keeper.end_s if next_start is None else next_start
    return PreparedSegment(start_s, end_s, video, next_start is None, cutter.scene_cut)


def _fixed_segment(
    data: bytes,
    params: VideoParams,
    every_s: float,
    start_s: float,
    stats: DecodeStats | None,
    content_key: str | None,
) -> PreparedSegment:
    """A fixed-length segment needs no frame it does not sample: its bounds are known from the
    timeline (the demux pass, no decoding), so only the GOP prefixes of its sampled frames are
    decoded, by `prepare_video`'s own scheduler and decoder."""
    stats = stats if stats is not None else DecodeStats()
    with open_container(data) as container:
        stream = video_stream(container)
        codec = stream.codec_context
        check_source_size(codec.width, codec.height, params)
        height, width = codec.height, codec.width
        timeline = _timeline(container, stream, stats, content_key)
    seconds = timeline.seconds
    end_s = start_s + every_s
    first = bisect.bisect_left(seconds, start_s - EPS)
    stop = bisect.bisect_left(seconds, end_s - EPS)
    if first >= stop:
        raise NoFrames(f"no frame of the video at or after {start_s:.3f}s")
    last = stop >= len(seconds)
    if last:
        end_s = timeline.duration_s
    n = _frame_count(params, end_s - start_s, stop - first, seconds[first], seconds[stop - 1])
    pixels = frame_max_pixels(params, n + n % FRAME_FACTOR)
    size = resized(height, width, min_pixels=params.min_pixels, max_pixels=pixels,
                   max_ratio=params.max_ratio, video=True)  # fmt: skip
    n = _fit_count(params, n, size)
    window = np.asarray(seconds[first:stop])
    targets = [
        first + int(np.abs(window - t).argmin())
        for t in np.linspace(seconds[first], seconds[stop - 1], n).tolist()
    ]
    runs = decode_runs(timeline, sorted(set(targets)))
    captured, original_size, outcome = decode(data, timeline, params, pixels, stats, runs)
    frames = [captured[t][0] for t in targets if t in captured]
    stamps = [captured[t][1] for t in targets if t in captured]
    if not frames or original_size is None:
        raise UndecodableVideo(
            f"no frame of the segment at {start_s:.3f}s decodes: {outcome.error or 'no output'}"
        )
    if len(frames) % FRAME_FACTOR:
        frames.append(frames[-1])
        stamps.append(stamps[-1])
    duration = max(end_s - start_s, EPS)
    video = PreparedVideo(
        frames=np.ascontiguousarray(np.stack(frames)),
        original_size=original_size,
        timestamps=tuple(stamps),
        duration_s=duration,
        source_fps=timeline.source_fps,
        total_num_frames=stop - first,
        sample_fps=len(frames) / duration,
    )
    return PreparedSegment(start_s, end_s, video, last)


def _timeline(
    container: InputContainer, stream: VideoStream, stats: DecodeStats, key: str | None
) -> Timeline:
    """The video's timeline, demuxed once per process while it stays in the cache."""
    if key is not None and (cached := _timelines.get(key)) is not None:
        _timelines.move_to_end(key)
        stats.packets = len(cached.packets)
        return cached
    timeline = scan(container, stream, stats)
    if key is not None and len(timeline.packets) <= TIMELINE_CACHE_PACKETS:
        _timelines[key] = timeline
        while sum(len(t.packets) for t in _timelines.values()) > TIMELINE_CACHE_PACKETS:
            _timelines.popitem(last=False)
    return timeline


def _frame_count(params: VideoParams, duration: float, available: int, t0: float, t1: float) -> int:
    """Frames for a segment by the usual rules (fps: duration x fps within min/max_frames;
    interval: one per interval_s), even, at most the frames there are."""
    cap = max(FRAME_FACTOR, math.floor(params.max_frames / FRAME_FACTOR) * FRAME_FACTOR)
    want: float
    if params.strategy == "interval":
        want = math.floor((t1 - t0) / params.interval_s + 1e-9) + 1
    else:
        want = max(duration * params.fps, params.min_frames)
    n = min(math.floor(want / FRAME_FACTOR) * FRAME_FACTOR, cap)
    return max(min(n, available), min(available, FRAME_FACTOR))


def _fit_count(params: VideoParams, n: int, size: tuple[int, int]) -> int:
    """Fewer frames when `params.budget` binds; refused when two frames do not fit."""
    budget = params.budget
    if budget is None:
        return n
    per_pair = video_tokens(FRAME_FACTOR, *size)
    if per_pair > budget:
        raise TooManyVisualTokens(
            f"two frames of {size[1]}x{size[0]} need {per_pair} visual tokens; the budget is "
            f"{budget}"
        )
    return min(n, budget // per_pair * FRAME_FACTOR)


def _frames_from(
    container: InputContainer, stream: VideoStream, start_s: float
) -> Iterator[tuple[VideoFrame, float]]:
    """Decoded frames with their time from the video's first frame, from the key frame at or
    before `start_s` on."""
    time_base = stream.time_base
    if time_base is None:
        raise UndecodableVideo("the video stream has no time base: segments need timestamps")
    origin = stream.start_time or 0
    if start_s > 0:
        container.seek(
            origin + int(start_s / time_base), backward=True, any_frame=False, stream=stream
        )
    codec = stream.codec_context
    try:
        for packet in container.demux(stream):
            for frame in codec.decode(packet if packet.size else None):
                if frame.pts is None:
                    continue
                yield frame, float((frame.pts - origin) * time_base)
    except av.error.FFmpegError as exc:
        raise UndecodableVideo(f"corrupt video data: {exc}") from None


def _thumb(frame: VideoFrame) -> npt.NDArray[np.float32]:
    small = frame.reformat(width=THUMB, height=THUMB, format="rgb24").to_ndarray()
    return np.asarray(small, dtype=np.float32) / 255.0


class _Cutter:
    """Decides where the segment that starts at `start_s` ends."""

    def __init__(self, rule: SegmentRule, start_s: float) -> None:
        self.rule = rule
        self.start_s = start_s
        self.prev: npt.NDArray[np.float32] | None = None
        self.scene_cut = False
        self.seen = False

    def ends_before(self, seconds: float, thumb: npt.NDArray[np.float32]) -> bool:
        """Whether the frame at `seconds` belongs to the next segment."""
        first, self.seen = not self.seen, True
        into = seconds - self.start_s
        if first:
            self.prev = thumb
            return False
        if self.rule.mode == "fixed":
            return into >= self.rule.every_s - EPS
        assert self.prev is not None
        change = float(np.abs(thumb - self.prev).mean())
        self.prev = thumb
        if into >= self.rule.max_s - EPS:
            return True
        if change >= self.rule.threshold and into >= self.rule.min_s - EPS:
            self.scene_cut = True
            return True
        return False


class _Keeper:
    """Candidate frames of one segment at the sampling rate, thinned when too many are held,
    then sampled per `VideoParams` once the segment's end is known."""

    def __init__(self, params: VideoParams, start_s: float) -> None:
        self.params = params
        self.start_s = start_s
        self.cap = max(FRAME_FACTOR, math.floor(params.max_frames / FRAME_FACTOR) * FRAME_FACTOR)
        self.step = 1.0 / params.fps if params.strategy == "fps" else params.interval_s
        self.next_at = start_s
        self.held: list[tuple[npt.NDArray[np.uint8], float]] = []
        self.frames_seen = 0
        self.last_s = start_s
        self.last_duration = 0.0
        self.size: tuple[int, int] | None = None  # (height, width) upright
        self.ops: list[Image.Transpose] = []  # to show it upright, from the first frame
        self.original_size: tuple[int, int] | None = None
        self.source_fps = 0.0

    @property
    def end_s(self) -> float:
        return self.last_s + self.last_duration

    def offer(self, frame: VideoFrame, seconds: float) -> None:
        if self.frames_seen:
            self.last_duration = max(seconds - self.last_s, 0.0)
        self.frames_seen += 1
        self.last_s = seconds
        if seconds + EPS < self.next_at:
            return
        self.held.append((self._pixels(frame), seconds))
        self.next_at = seconds + self.step
        if len(self.held) >= 2 * self.cap:
            self.held = self.held[::2]
            self.step *= 2

    def _pixels(self, frame: VideoFrame) -> npt.NDArray[np.uint8]:
        check_source_size(frame.width, frame.height, self.params)
        if self.size is None:
            self.ops = orientation(frame)  # the track's display matrix: once per segment
        ops = self.ops
        swap = any(op in SWAPS for op in ops)
        upright = (frame.width, frame.height) if swap else (frame.height, frame.width)
        if self.size is None:
            self.original_size = (upright[1], upright[0])
            # The per-frame share of the pixel budget at the most frames a segment may get.
            self.size = resized(
                upright[0], upright[1], min_pixels=self.params.min_pixels,
                max_pixels=frame_max_pixels(self.params, self.cap),
                max_ratio=self.params.max_ratio, video=True,
            )  # fmt: skip
        height, width = self.size
        image = Image.fromarray(np.asarray(frame.to_ndarray(format="rgb24"), dtype=np.uint8))
        target = (height, width) if swap else (width, height)
        if image.size != target:
            image = image.resize(target, Image.Resampling.BICUBIC)
        for op in ops:
            image = image.transpose(op)
        return np.asarray(image, dtype=np.uint8)

    def finish(self, next_start: float | None) -> PreparedVideo:
        if not self.held:
            raise NoFrames(f"no frame decodes at or after {self.start_s:.3f}s")
        end = next_start if next_start is not None else self.end_s
        duration = max(end - self.start_s, EPS)
        assert self.size is not None and self.original_size is not None
        n = _frame_count(self.params, duration, len(self.held), self.start_s, self.last_s)
        n = _fit_count(self.params, n, self.size)
        times = np.asarray([s for _, s in self.held])
        targets = np.linspace(self.held[0][1], self.held[-1][1], n)
        picks = [int(np.abs(times - t).argmin()) for t in targets.tolist()]
        frames = [self.held[i][0] for i in picks]
        stamps = [self.held[i][1] for i in picks]
        if len(frames) % FRAME_FACTOR:
            frames.append(frames[-1])
            stamps.append(stamps[-1])
        return PreparedVideo(
            frames=np.ascontiguousarray(np.stack(frames)),
            original_size=self.original_size,
            timestamps=tuple(stamps),
            duration_s=duration,
            source_fps=self.frames_seen / duration,
            total_num_frames=self.frames_seen,
            sample_fps=len(frames) / duration,
        )
