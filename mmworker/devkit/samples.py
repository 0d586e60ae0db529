"""Sample media made on the spot, so the demo and benchmarks need no downloads."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np
from PIL import Image, ImageDraw


def sample_image(width: int = 640, height: int = 480, seed: int = 0, fmt: str = "JPEG") -> bytes:
    """A photo-like picture: gradient sky, a sun, some shapes and noise (so JPEG has work)."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height)[:, None]
    x = np.linspace(0, 1, width)[None, :]
    base = np.stack([90 + 120 * y + 0 * x, 140 + 80 * y + 20 * x, 230 - 60 * y + 0 * x], axis=-1)
    noise = rng.normal(0, 6, size=(height, width, 3))
    img = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    cx, cy, r = int(width * (0.2 + 0.6 * rng.random())), int(height * 0.3), max(4, height // 10)
    draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=(250, 220, 80))
    draw.rectangle((0, int(height * 0.7), width, height), fill=(60, 140, 60))
    for _ in range(5):
        x0, y0 = int(rng.random() * width), int(height * (0.5 + 0.3 * rng.random()))
        draw.rectangle(
            (x0, y0, x0 + width // 10, y0 + height // 8), fill=tuple(rng.integers(0, 255, 3))
        )
    out = io.BytesIO()
    img.save(out, format=fmt, quality=90)
    return out.getvalue()


def sample_video(
    seconds: float = 4.0,
    fps: int = 24,
    width: int = 320,
    height: int = 240,
    codec: str = "libx264",
    seed: int | None = None,
) -> bytes:
    """A moving ball over a gradient, encoded as MP4 (H.264 by default).

    A `seed` varies colours, ball size and path, so benchmarks get distinct content (identical
    clips would share one content hash and turn a cold pass into a warm one).
    """
    shift, green, blue = 0, 0, 128
    radius, by = height // 8, height // 2
    if seed is not None:
        rng = np.random.default_rng(seed)
        shift, green, blue = (int(v) for v in rng.integers(0, 256, 3))
        radius = int(height // 10 + rng.integers(0, height // 10))
        by = int(height * (0.3 + 0.4 * rng.random()))
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=fps)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        yy, xx = np.mgrid[0:height, 0:width]
        for i in range(int(seconds * fps)):
            t = i / fps
            frame = np.empty((height, width, 3), dtype=np.uint8)
            frame[..., 0] = (xx * 255 // width + i * 3 + shift) % 256
            frame[..., 1] = (yy * 255 // height + green) % 256
            frame[..., 2] = blue
            bx = int((0.1 + 0.8 * (t / seconds)) * width)
            frame[(xx - bx) ** 2 + (yy - by) ** 2 < radius**2] = (255, 255, 255)
            video_frame = av.VideoFrame.from_ndarray(frame, format="rgb24")
            video_frame.pts = i
            for packet in stream.encode(video_frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()
