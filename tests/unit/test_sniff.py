from __future__ import annotations

import dataclasses
import io

import av
import numpy as np
import pytest

from preprocess.errors import UnsupportedMedia
from preprocess.sniff import MediaType, sniff
from schemas.codes import ErrorCode
from tests import media_images as imgs


def _video(container: str, codec: str, frames: int = 4) -> bytes:
    """A tiny real video from PyAV, so the sniffer is tested on what muxers really write."""
    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as muxer:
        stream = muxer.add_stream(codec, rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(frames):
            pixels = np.full((48, 64, 3), i * 40, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                muxer.mux(packet)
        for packet in stream.encode():
            muxer.mux(packet)
    return out.getvalue()


@pytest.mark.parametrize(
    ("build", "fmt"),
    [
        (imgs.jpeg, "jpeg"),
        (imgs.png, "png"),
        (imgs.gif, "gif"),
        (imgs.webp, "webp"),
        (imgs.tiff, "tiff"),
        (imgs.bmp, "bmp"),
        (imgs.animated_gif, "gif"),
        (imgs.animated_webp, "webp"),
        (imgs.cmyk_jpeg, "jpeg"),
        (imgs.png16, "png"),
    ],
)
def test_images_are_recognised(build, fmt):
    assert sniff(build(40, 30)) == MediaType("image", fmt)


def test_big_endian_tiff_is_recognised():
    assert sniff(b"MM\x00*\x00\x00\x00\x08" + b"\x00" * 32) == MediaType("image", "tiff")


@pytest.mark.parametrize(
    ("container", "codec", "fmt"),
    [
        ("mp4", "mpeg4", "mp4"),
        ("mp4", "libx264", "mp4"),
        ("mov", "mpeg4", "mov"),
        ("matroska", "mpeg4", "matroska"),
        ("webm", "libvpx", "webm"),
        ("avi", "mpeg4", "avi"),
        ("mpegts", "mpeg2video", "mpeg-ts"),
        ("flv", "flv", "flv"),
        ("mpeg", "mpeg2video", "mpeg-ps"),
        ("h264", "libx264", "h264"),
        ("hevc", "libx265", "hevc"),
    ],
)
def test_real_videos_are_recognised(container, codec, fmt):
    assert sniff(_video(container, codec)) == MediaType("video", fmt)


def test_ogg_with_theora_is_video():
    page = b"OggS\x00\x02" + b"\x00" * 20 + b"\x01\x2a" + b"\x80theora\x03\x02\x01"
    assert sniff(page) == MediaType("video", "ogg")


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"", "empty"),
        (imgs.text_file(), "text"),
        (b"<!DOCTYPE html><html><body>404 Not Found</body></html>", "HTML"),
        (b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"></svg>', "SVG"),
        (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n", "PDF"),
        (b'{"error": "not found"}', "JSON"),
        (b"BMW is a car maker, not a bitmap header.", "text"),
        (b"\x00\x00\x00\x18ftypM4A \x00\x00\x02\x00M4A mp42isom", "audio"),
        (b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic", "HEIC"),
        (b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00avifmif1", "AVIF"),
        (b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00", "WAV"),
        (b"OggS\x00\x02" + b"\x00" * 20 + b"\x01\x1e\x01vorbis\x00\x00", "Ogg"),
        (bytes(range(200, 256)) * 4, "not recognised"),
        ("naïve café text, still text".encode(), "text"),
    ],
)
def test_unsupported_media_is_refused_with_a_reason(data, needle):
    with pytest.raises(UnsupportedMedia) as info:
        sniff(data)
    assert needle.lower() in info.value.message.lower()
    assert info.value.code is ErrorCode.UNSUPPORTED_MEDIA
    assert not info.value.retryable


def test_a_text_file_named_jpg_is_not_an_image():
    # The name never reaches the sniffer: only bytes count.
    with pytest.raises(UnsupportedMedia, match="text"):
        sniff(imgs.text_file())


def test_transport_stream_needs_three_sync_bytes():
    one_packet = b"\x47" + b"\x00" * 187
    with pytest.raises(UnsupportedMedia):
        sniff(one_packet * 2)  # only two packets: too weak to call it MPEG-TS
    assert sniff(one_packet * 3) == MediaType("video", "mpeg-ts")


def test_annexb_needs_a_parameter_set_or_delimiter():
    with pytest.raises(UnsupportedMedia):
        sniff(b"\x00\x00\x00\x01\x65" + b"\x88" * 20)  # a bare IDR slice could be anything
    assert sniff(b"\x00\x00\x00\x01\x09\xf0").format == "h264"
    assert sniff(b"\x00\x00\x00\x01\x40\x01\x0c").format == "hevc"


def test_media_type_is_frozen():
    media = sniff(imgs.png(8, 8))
    with pytest.raises(dataclasses.FrozenInstanceError):
        media.kind = "video"  # type: ignore[misc]
