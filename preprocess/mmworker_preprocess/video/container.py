"""Opening the data and choosing its video stream, shared by the scan and by every decoder.

Each decoder opens its own container of the same bytes, so the same checks (which stream, how
large its frames may be) must give the same answer wherever a container is opened.
"""

from __future__ import annotations

import av.error
from av.container import InputContainer
from av.stream import Disposition
from av.video.stream import VideoStream

from mmworker_preprocess.avopen import open_input
from mmworker_preprocess.errors import TooLarge, UndecodableVideo, UnsupportedMedia
from mmworker_preprocess.params import VideoParams


def open_container(data: bytes) -> InputContainer:
    try:
        return open_input(data)
    except av.error.FFmpegError as exc:
        raise UndecodableVideo(f"cannot open the container: {exc}") from None


def video_stream(container: InputContainer) -> VideoStream:
    """The first real video stream; cover art in audio files is a video stream too: skipped."""
    streams = [s for s in container.streams.video if not s.disposition & Disposition.attached_pic]
    if not streams:
        kinds = ", ".join(sorted({str(s.type) for s in container.streams})) or "none"
        raise UnsupportedMedia(f"no video stream (streams: {kinds})")
    stream = streams[0]
    if stream.codec_context is None:
        raise UnsupportedMedia("no decoder for the video stream's codec")
    return stream


def check_source_size(width: int, height: int, params: VideoParams) -> None:
    if width * height > params.max_source_pixels:
        raise TooLarge(
            f"video frames are {width}x{height}; the limit is {params.max_source_pixels} pixels"
        )
