"""Bytes → prepared media, dispatching on the sniffed kind.

This is the function the worker ships to its process pool: it takes and returns plain picklable
values so the decode and resize run outside the worker's GIL.
"""

from __future__ import annotations

from mmworker_preprocess.image import prepare_image
from mmworker_preprocess.params import ImageParams, PreparedImage, PreparedVideo, VideoParams
from mmworker_preprocess.sniff import sniff
from mmworker_preprocess.video import prepare_video


def prepare_media(
    data: bytes, image: ImageParams, video: VideoParams
) -> PreparedImage | PreparedVideo:
    """Decode by what the bytes are, not by what the producer declared or the name says."""
    if sniff(data).kind == "image":
        return prepare_image(data, image)
    return prepare_video(data, video)


def warm_up() -> int:
    """Run once per pool process at start so imports are paid before the first job."""
    import av  # noqa: F401
    import PIL.Image  # noqa: F401

    return 0
