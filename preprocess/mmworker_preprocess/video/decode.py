"""The second pass: decode the scheduled runs and keep the chosen frames, resized and upright.

Everything that touches PyAV's decoder lives here, so the rest of the package plans work from
timestamps alone; the conversion thread and the second decoder are its concern, not the plan's.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import av
import av.error
import numpy as np
import numpy.typing as npt
from av.container import InputContainer
from av.video.frame import VideoFrame
from av.video.stream import VideoStream
from PIL import Image

from mmworker_preprocess.errors import UndecodableVideo
from mmworker_preprocess.params import VideoParams
from mmworker_preprocess.tokens import resized
from mmworker_preprocess.video.container import check_source_size, open_container, video_stream
from mmworker_preprocess.video.orientation import SWAPS, orientation
from mmworker_preprocess.video.schedule import Run, split
from mmworker_preprocess.video.stats import DecodeStats
from mmworker_preprocess.video.timeline import Timeline

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


@dataclass(slots=True)
class Outcome:
    """What the decode pass yielded beyond the frames: how far it got, and why it stopped."""

    #: Presentation time (s) of the latest frame any decoder produced; -1 before the first.
    good_until_s: float = -1.0
    #: The first decode error, when one cut a stretch short; its frames after it are lost.
    error: str | None = None


Captured = dict[int, tuple[npt.NDArray[np.uint8], float]]


def decode(
    data: bytes,
    timeline: Timeline,
    params: VideoParams,
    frame_pixels: int,
    stats: DecodeStats,
    runs: Sequence[Run],
) -> tuple[Captured, tuple[int, int] | None, Outcome]:
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
    with open_container(data) as container, ThreadPoolExecutor(1, "frame-convert") as converter:
        main = _Decoder(
            container=container,
            stream=video_stream(container),
            timeline=timeline,
            params=params,
            frame_pixels=frame_pixels,
            stats=stats,
            converter=converter,
            abort=abort,
        )
        head, tail = split(list(runs)) if main.seekable else (list(runs), [])
        if not tail:
            main.decode(head)
            return main.results(), main.original_size, main.outcome
        helper_stats = DecodeStats()
        with ThreadPoolExecutor(1, "video-decode") as pool:
            helper: Future[tuple[Captured, Outcome]] | None = None

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
                outcome = Outcome(
                    max(outcome.good_until_s, tail_outcome.good_until_s),
                    outcome.error or tail_outcome.error,
                )
        stats.decoded += helper_stats.decoded
        stats.seeks += helper_stats.seeks
        stats.runs += helper_stats.runs
        return captured, main.original_size, outcome


def _decode_tail(
    data: bytes, main: _Decoder, runs: Sequence[Run], stats: DecodeStats
) -> tuple[Captured, Outcome]:
    with open_container(data) as container:
        helper = main.fork(container, stats)
        helper.decode(runs)
        return helper.results(), helper.outcome


class _Decoder:
    """Second pass: decode the planned runs and keep the wanted frames, resized and upright."""

    def __init__(
        self,
        *,
        container: InputContainer,
        stream: VideoStream,
        timeline: Timeline,
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
        self.outcome = Outcome()
        self._target: tuple[int, int] | None = None  # (height, width), upright
        self._ops: list[Image.Transpose] = []  # to show it upright, from the first frame
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

    def decode(self, runs: Sequence[Run]) -> None:
        """Decode the runs, which must lie after any this decoder has done already.

        A decode error ends only the run it happens in (see `outcome`); the next run starts
        afresh at its own key frame, so one damaged stretch costs only its own frames.
        """
        try:
            self._decode(runs)
        except av.error.FFmpegError as exc:
            raise UndecodableVideo(f"corrupt video data: {exc}") from None

    def results(self) -> Captured:
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
            stream=video_stream(container),
            timeline=self.timeline,
            params=self.params,
            frame_pixels=self.frame_pixels,
            stats=stats,
            converter=self._converter,
            abort=self._abort,
        )
        other._target, other.original_size = self._target, self.original_size
        other._ops = self._ops
        return other

    def _decode(self, runs: Sequence[Run]) -> None:
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
        check_source_size(frame.width, frame.height, self.params)
        if self._target is None:
            self._ops = orientation(frame)  # the track's display matrix: once per video
        ops = self._ops
        swap = any(op in SWAPS for op in ops)
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

    def __init__(self, decoder: _Decoder, run: Run) -> None:
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
