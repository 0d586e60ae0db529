"""Turning frames upright from their display matrix, as ffmpeg's autorotate does.

Phones record in the sensor's orientation and store how to show it in the container: without
applying it, a portrait video would reach the model lying on its side.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import cast

import numpy as np
from av.sidedata.sidedata import SideData
from av.video.frame import VideoFrame
from PIL import Image

_Transpose = Image.Transpose

#: Transposes that swap width and height: the size to resize to is the upright one, swapped.
SWAPS = frozenset(
    {_Transpose.ROTATE_90, _Transpose.ROTATE_270, _Transpose.TRANSPOSE, _Transpose.TRANSVERSE}
)


def orientation(frame: VideoFrame) -> list[Image.Transpose]:
    """Pillow transposes that show the frame upright, mirroring ffmpeg's own autorotate.

    The display matrix (mp4 `tkhd`, carried to each frame as side data) is interpreted exactly
    as fftools/ffmpeg_filter.c does, flips included. Angles that are not a multiple of 90° are
    snapped to the nearest one: phones only write multiples of 90°.

    Costs about a millisecond (see `_side_data_of`): callers read it once per video, the
    matrix being the track's.
    """
    side = _side_data_of(frame).get("DISPLAYMATRIX")
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


def _side_data_of(frame: VideoFrame) -> Mapping[str, object]:
    """The frame's side data, read from a 2×2 copy that carries it (swscale copies the props).

    PyAV caches the side-data container on the frame and the container points back at the
    frame: reading `frame.side_data` puts the frame in a reference cycle, so it is not freed
    when its last user drops it but at the next full garbage collection, and with it the
    decoder's frame buffers it keeps referenced. A preprocessing process allocates few Python
    objects per video, so full collections are rare: the soak (bench/soak.py) counted 105 such
    frames gained per 2,500 jobs and 33 MiB of malloc'd memory in use with them. The copy's
    cycle holds 2×2 pixels.
    """
    # PyAV's stub types `side_data` as one SideData; it is a mapping of them by type name.
    return cast("Mapping[str, object]", frame.reformat(width=2, height=2).side_data)
