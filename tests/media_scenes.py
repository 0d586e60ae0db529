"""Videos whose scenes change at known times, for segment mode: solid colours, each with a small
square moving across it, so a scene has motion inside it but changes only at its cut.

Encoded frame by frame (never holding the clip's frames), so an hour of video costs its bytes.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import av
import numpy as np

#: Saturated colours far apart in grey level too (scene detection compares grey thumbnails).
PALETTE: tuple[tuple[int, int, int], ...] = (
    (220, 30, 30),
    (20, 20, 200),
    (240, 240, 240),
    (20, 160, 20),
    (10, 10, 10),
    (240, 200, 0),
    (130, 0, 160),
    (0, 200, 200),
)


def scene_video(
    cuts: Sequence[float],
    duration_s: float,
    *,
    fps: int = 4,
    size: int = 64,
    gop: int = 40,
) -> bytes:
    """H.264 in mp4: scene k (of colour PALETTE[k % len]) starts at `cuts[k - 1]` seconds; the
    first starts at 0. Consecutive scenes always differ in colour. A fixed GOP (no scene-cut key
    frames) so detection cannot lean on the encoder's key frames."""
    out_buf = io.BytesIO()
    n_frames = round(duration_s * fps)
    with av.open(out_buf, mode="w", format="mp4") as out:
        stream = out.add_stream(
            "libx264",
            rate=fps,
            options={
                "preset": "ultrafast",
                "crf": "18",
                "x264-params": f"keyint={gop}:min-keyint={gop}:scenecut=0",
            },
        )
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        bounds = list(cuts)
        for i in range(n_frames):
            t = i / fps
            scene = sum(1 for c in bounds if c <= t + 1e-9)
            img = np.empty((size, size, 3), np.uint8)
            img[:] = PALETTE[scene % len(PALETTE)]
            x = (i * 2) % (size - 8)
            img[size // 2 - 4 : size // 2 + 4, x : x + 8] = 128
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return out_buf.getvalue()
