"""Tiny test videos encoded in memory with PyAV, so video tests need no fixture files.

Every frame carries its own index as a binary code of black/white vertical bars (8 bars, index
< 256), so a test can tell exactly which source frame the sampler picked, even after lossy coding
and resizing. Sizes stay small (≤ 320×240) and codecs run at their fastest presets.
"""

from __future__ import annotations

import io
import tempfile
from collections.abc import Sequence
from fractions import Fraction

import av
import numpy as np
import numpy.typing as npt

BARS = 8

#: Encoder name → (container format, extra codec options). The options pick the fastest,
#: near-lossless settings so bar codes survive and tests stay quick.
CODECS: dict[str, tuple[str, dict[str, str]]] = {
    "libx264": ("mp4", {"preset": "ultrafast", "crf": "12"}),
    "libx265": ("mp4", {"preset": "ultrafast", "crf": "12", "x265-params": "log-level=error"}),
    "libvpx-vp9": ("webm", {"deadline": "realtime", "cpu-used": "8", "crf": "10", "b": "0"}),
    "libsvtav1": ("mp4", {"preset": "12", "crf": "20"}),
    "libaom-av1": ("mp4", {"cpu-used": "8", "crf": "20", "usage": "realtime"}),
    "librav1e": ("mp4", {"speed": "10"}),
    "mpeg4": ("mp4", {"qscale": "2"}),
    # Older and archive formats, each in the container it is usually found in.
    "wmv2": ("asf", {"qscale": "2"}),
    "flv": ("flv", {"qscale": "2"}),
    "mpeg2video": ("mpeg", {"qscale": "2"}),
    "h263": ("3gp", {"qscale": "2"}),
    "libvpx": ("webm", {"deadline": "realtime", "cpu-used": "8", "crf": "4", "b": "2M"}),
}


def available(codec: str) -> bool:
    return codec in av.codecs_available


def av1_encoder() -> str | None:
    """The first AV1 encoder this PyAV build ships (wheels differ between releases)."""
    for name in ("libsvtav1", "libaom-av1", "librav1e"):
        if available(name):
            return name
    return None


def coded_frame(index: int, width: int, height: int) -> npt.NDArray[np.uint8]:
    """RGB frame whose bars spell `index` in binary, most significant bit on the left."""
    img = np.zeros((height, width, 3), np.uint8)
    edges = np.linspace(0, width, BARS + 1).round().astype(int)
    for bit in range(BARS):
        if (index >> (BARS - 1 - bit)) & 1:
            img[:, edges[bit] : edges[bit + 1]] = 255
    return img


def read_index(frame: npt.NDArray[np.uint8]) -> int:
    """Inverse of `coded_frame`, reading the centre of each bar on the middle row band."""
    h, w = frame.shape[:2]
    edges = np.linspace(0, w, BARS + 1)
    band = frame[h // 4 : 3 * h // 4].astype(np.float64).mean(axis=(0, 2))
    value = 0
    for bit in range(BARS):
        lo, hi = edges[bit], edges[bit + 1]
        margin = (hi - lo) / 4
        centre = band[int(lo + margin) : max(int(hi - margin), int(lo + margin) + 1)].mean()
        value = (value << 1) | int(centre > 127)
    return value


def encode_video(
    codec: str = "libx264",
    *,
    width: int = 64,
    height: int = 48,
    n_frames: int = 20,
    fps: int = 10,
    times: Sequence[float] | None = None,
    gop: int | None = None,
    rotation: float | None = None,
    hflip: bool = False,
    frames: Sequence[npt.NDArray[np.uint8]] | None = None,
    container: str | None = None,
    faststart: bool = False,
    x264_params: str = "",
) -> bytes:
    """Encode a small video; `times` gives explicit presentation times (a VFR video).

    `frames` overrides the bar-coded content. `rotation` writes a display matrix (degrees
    counter-clockwise, as PyAV's `set_display_rotation` and `VideoFrame.rotation` define it).
    """
    fmt, defaults = CODECS.get(codec, ("mp4", {}))
    fmt = container or fmt
    options = dict(defaults)
    if codec == "libx264":
        keyint = f"keyint={gop}:min-keyint={gop}:scenecut=0" if gop else ""
        options["x264-params"] = ":".join(x for x in (keyint, x264_params) if x)
        if not options["x264-params"]:
            del options["x264-params"]
    # faststart rewrites the file after muxing, which needs a real file rather than a BytesIO.
    tmp = tempfile.TemporaryDirectory() if faststart else None
    target: io.BytesIO | str = f"{tmp.name}/out.{fmt}" if tmp else io.BytesIO()
    mux_opts = {"movflags": "+faststart"} if faststart else {}
    with av.open(target, mode="w", format=fmt, options=mux_opts) as out:
        stream = out.add_stream(codec, rate=fps, options=options)
        stream.width = width
        stream.height = height
        stream.pix_fmt = "yuv420p"
        if gop is not None:
            stream.codec_context.gop_size = gop
        if times is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        if rotation is not None or hflip:
            stream.set_display_rotation(rotation or 0.0, hflip=hflip)
        count = len(frames) if frames is not None else (len(times) if times else n_frames)
        for i in range(count):
            pixels = frames[i] if frames is not None else coded_frame(i, width, height)
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
            if times is not None:
                frame.pts = round(times[i] * 1000)
                frame.time_base = Fraction(1, 1000)
            else:
                frame.pts = i
                frame.time_base = Fraction(1, fps)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    if isinstance(target, io.BytesIO):
        return target.getvalue()
    assert tmp is not None
    with tmp, open(target, "rb") as fh:
        return fh.read()


def keyframe_indices(data: bytes) -> list[int]:
    """Presentation-order indices of the frames the container flags as key frames."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        packets = [(p.pts, p.is_keyframe) for p in container.demux(stream) if p.size]
    ordered = sorted(packets, key=lambda p: p[0] if p[0] is not None else -1)
    return [i for i, (_, key) in enumerate(ordered) if key]


def encode_empty_video_track() -> bytes:
    """Matroska with a declared video track that holds no frames (audio beside it, so the
    muxer writes a header at all)."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="matroska") as out:
        video = out.add_stream("libx264", rate=10)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = out.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(
            np.zeros((1, 1024), np.float32), format="fltp", layout="mono"
        )
        frame.sample_rate = 16000
        frame.pts = 0
        for packet in [*audio.encode(frame), *audio.encode()]:
            out.mux(packet)
    return buf.getvalue()


def encode_audio_only(seconds: float = 1.0, *, fmt: str = "mp4", codec: str = "aac") -> bytes:
    """An AAC-in-MP4 (.m4a) file by default: a real media file with no video stream at all."""
    rate = 16000
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate)
        samples = int(seconds * rate)
        t = np.arange(samples) / rate
        tone = (0.2 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
        step = 1024
        for start in range(0, samples, step):
            chunk = tone[start : start + step].reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="mono")
            frame.sample_rate = rate
            frame.pts = start
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def oriented_content(width: int, height: int) -> npt.NDArray[np.uint8]:
    """Upright content with a red block top-left and a blue block bottom-right (orientation)."""
    img = np.full((height, width, 3), 128, np.uint8)
    bh, bw = height // 3, width // 3
    img[:bh, :bw] = (255, 0, 0)
    img[-bh:, -bw:] = (0, 0, 255)
    return img


def rotated_video(
    rotation: int, *, upright_width: int = 48, upright_height: int = 80, n_frames: int = 4
) -> bytes:
    """A phone-style clip: the upright picture is stored turned, with a display matrix saying
    how to turn it back (rotation degrees counter-clockwise applied at display time)."""
    upright = oriented_content(upright_width, upright_height)
    # Display rotates the coded picture counter-clockwise by `rotation`, so store it turned
    # clockwise by the same angle (np.rot90 with negative k turns clockwise).
    coded = np.ascontiguousarray(np.rot90(upright, k=-(rotation // 90)))
    h, w = coded.shape[:2]
    return encode_video(
        "libx264", width=w, height=h, frames=[coded] * n_frames, rotation=float(rotation)
    )


def truncated(data: bytes, keep: float = 0.5) -> bytes:
    return data[: int(len(data) * keep)]


def is_red(pixel: npt.NDArray[np.uint8]) -> bool:
    r, g, b = (int(v) for v in pixel)
    return r > 180 and g < 90 and b < 90


def is_blue(pixel: npt.NDArray[np.uint8]) -> bool:
    r, g, b = (int(v) for v in pixel)
    return b > 180 and r < 90 and g < 90


def avi_with_skipped_frames(coded: int = 68, declared: int = 444, fps: int = 30) -> bytes:
    """A hand-held camera's variable-rate AVI: `declared` frame slots, of which only `coded`
    hold a picture. AVI has no timestamps, so FFmpeg's muxer (like such cameras) fills each
    gap with empty chunks, which the header's frame count includes."""
    step = (declared - 1) / (coded - 1)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="avi") as out:
        stream = out.add_stream("mpeg4", rate=fps, options={"qscale": "2"})
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(coded):
            frame = av.VideoFrame.from_ndarray(coded_frame(i, 64, 48), format="rgb24")
            frame.pts, frame.time_base = round(i * step), Fraction(1, fps)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def avi_declaring_more_frames(n_frames: int = 150, declared: int = 151, fps: int = 25) -> bytes:
    """An MPEG-4 AVI whose headers (avih total frames, strh length) count more frames than it
    codes, as some encoders write it."""
    data = bytearray(encode_video("mpeg4", container="avi", n_frames=n_frames, fps=fps))
    # Offsets from the chunk's four-character code: avih dwTotalFrames, strh dwLength.
    for tag, offset in ((b"avih", 24), (b"strh", 40)):
        at = data.index(tag) + offset
        assert int.from_bytes(data[at : at + 4], "little") == n_frames
        data[at : at + 4] = declared.to_bytes(4, "little")
    return bytes(data)
