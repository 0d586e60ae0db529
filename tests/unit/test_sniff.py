from __future__ import annotations

import dataclasses
import io

import av
import numpy as np
import pytest
from mmworker_preprocess.errors import UnsupportedMedia
from mmworker_preprocess.sniff import MediaType, sniff
from mmworker_schemas.codes import ErrorCode

from tests import media_images as imgs


def _video(
    container: str,
    codec: str,
    frames: int = 4,
    *,
    size: tuple[int, int] = (64, 48),
    rate: int = 10,
) -> bytes:
    """A tiny real video from PyAV, so the sniffer is tested on what muxers really write."""
    width, height = size
    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as muxer:
        stream = muxer.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            pixels = np.full((height, width, 3), i * 40, dtype=np.uint8)
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
        (imgs.avif, "avif"),
        (imgs.heic, "heif"),
    ],
)
def test_images_are_recognised(build, fmt):
    assert sniff(build(40, 30)) == MediaType("image", fmt)


@pytest.mark.parametrize(
    ("head", "fmt"),
    [
        (b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic", "heif"),
        (b"\x00\x00\x00\x1cftypavif\x00\x00\x00\x00avifmif1miaf", "avif"),
        # The generic HEIF brand: the compatible brands say whether the pictures are AV1 ...
        (b"\x00\x00\x00\x18ftypmif1\x00\x00\x00\x00mif1avif", "avif"),
        # ... or HEVC, as in burst and Live Photo stills.
        (b"\x00\x00\x00\x18ftypmsf1\x00\x00\x00\x00msf1hevc", "heif"),
    ],
)
def test_heif_family_stills_are_images_by_brand(head, fmt):
    assert sniff(head) == MediaType("image", fmt)


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


@pytest.mark.parametrize(
    ("container", "codec", "fmt", "size", "rate"),
    [
        # None of these has a signature here: FFmpeg's probe finds the container and a
        # decodable video stream in it, and that alone makes them videos.
        ("asf", "wmv2", "asf", (64, 48), 10),
        ("ogg", "libvpx", "ogg", (64, 48), 10),
        ("mxf", "mpeg2video", "mxf", (64, 48), 25),
        ("nut", "mpeg4", "nut", (64, 48), 10),
        ("ivf", "libvpx", "ivf", (64, 48), 10),
        ("yuv4mpegpipe", "rawvideo", "yuv4mpegpipe", (64, 48), 10),
        # 3GP shares the ftyp box with mp4; its own brand names it.
        ("3gp", "h263", "3gp", (176, 144), 10),
    ],
)
def test_containers_without_a_signature_are_videos_by_ffmpegs_probe(
    container, codec, fmt, size, rate
):
    assert sniff(_video(container, codec, size=size, rate=rate)) == MediaType("video", fmt)


def test_ogg_audio_is_refused_by_what_ffmpeg_finds_in_it():
    from tests.media_videos import encode_audio_only

    with pytest.raises(UnsupportedMedia, match=r"ogg without a video stream \(streams: audio\)"):
        sniff(encode_audio_only(fmt="ogg", codec="flac"))


@pytest.mark.parametrize("fmt", ["PPM", "ICO", "PCX", "SGI", "QOI", "DDS"])
def test_stills_ffmpeg_reads_are_not_videos(fmt):
    # FFmpeg would call each a one-frame video; it is an image Pillow may not open here.
    data = imgs.encode(imgs.rgb_image(32, 32), fmt)
    with pytest.raises(UnsupportedMedia, match="still image"):
        sniff(data)


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
        (b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00", "WAV"),
        (bytes(range(200, 256)) * 4, "not recognised"),
        (np.random.default_rng(7).bytes(4096), "not recognised"),
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
