"""Decide what a blob really is from its first bytes, ignoring names, headers and declared kinds.

Producers mislabel media (a PNG called .jpg, an HTML error page saved as a video), and handing an
unknown blob to a decoder wastes CPU and can exercise rarely used, fragile code paths. Sniffing
first picks the decoder and rejects everything else with a message a producer can act on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from preprocess.errors import UnsupportedMedia

MediaKindName = Literal["image", "video"]

#: ISO base media (ftyp) brands that carry audio only; refusing them here gives a clearer
#: message than the video decoder's "no video stream".
_AUDIO_BRANDS = frozenset({b"M4A ", b"M4B ", b"M4P ", b"F4A ", b"F4B "})
#: HEIF/AVIF stills share the ftyp box with MP4 but are images Pillow is not built to decode here.
_HEIF_BRANDS = frozenset({b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1"})
_AVIF_BRANDS = frozenset({b"avif", b"avis"})
#: Sizes of the BMP info header variants; "BM" alone is too weak (any text starting "BM...").
_BMP_DIB_SIZES = frozenset({12, 16, 40, 52, 56, 64, 108, 124})
_TS_PACKET = 188


@dataclass(frozen=True, slots=True)
class MediaType:
    kind: MediaKindName
    format: str


def sniff(data: bytes) -> MediaType:
    """Return the media type of `data`, or raise `UnsupportedMedia` saying what it looks like."""
    if not data:
        raise UnsupportedMedia("media is empty (0 bytes)")
    found = _sniff_image(data) or _sniff_video(data)
    if found is not None:
        return found
    raise UnsupportedMedia(_describe_unknown(data))


def _sniff_image(data: bytes) -> MediaType | None:
    fmt: str | None = None
    if data.startswith(b"\xff\xd8\xff"):
        fmt = "jpeg"
    elif data.startswith(b"\x89PNG\r\n\x1a\n"):
        fmt = "png"
    elif data.startswith((b"GIF87a", b"GIF89a")):
        fmt = "gif"
    elif data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        fmt = "webp"
    elif data.startswith((b"II*\x00", b"MM\x00*")):
        fmt = "tiff"
    elif data.startswith(b"BM") and int.from_bytes(data[14:18], "little") in _BMP_DIB_SIZES:
        fmt = "bmp"
    return MediaType("image", fmt) if fmt else None


def _sniff_video(data: bytes) -> MediaType | None:
    if data[4:8] == b"ftyp":
        return _sniff_ftyp(data)
    fmt: str | None = None
    if data.startswith(b"\x1a\x45\xdf\xa3"):
        # The EBML header names the doctype within its first few dozen bytes.
        fmt = "webm" if b"webm" in data[:64] else "matroska"
    elif data.startswith(b"RIFF") and data[8:12] == b"AVI ":
        fmt = "avi"
    elif data.startswith(b"RIFF") and data[8:12] == b"WAVE":
        raise UnsupportedMedia("media is WAV audio; only images and videos are supported")
    elif data.startswith(b"FLV\x01"):
        fmt = "flv"
    elif data.startswith(b"OggS"):
        fmt = _sniff_ogg(data)
    elif data.startswith(b"\x00\x00\x01\xba"):
        fmt = "mpeg-ps"
    elif data.startswith(b"\x00\x00\x01\xb3"):
        fmt = "mpeg-video"
    elif _is_transport_stream(data, offset=0, stride=_TS_PACKET):
        fmt = "mpeg-ts"
    elif _is_transport_stream(data, offset=4, stride=_TS_PACKET + 4):
        fmt = "m2ts"
    else:
        fmt = _sniff_annexb(data)
    return MediaType("video", fmt) if fmt else None


def _sniff_ftyp(data: bytes) -> MediaType:
    brand = data[8:12]
    if brand in _AUDIO_BRANDS:
        raise UnsupportedMedia(f"media is MPEG-4 audio (brand {_show(brand)}); it has no pictures")
    if brand in _HEIF_BRANDS:
        raise UnsupportedMedia(f"HEIF/HEIC images (brand {_show(brand)}) are not supported")
    if brand in _AVIF_BRANDS:
        raise UnsupportedMedia(f"AVIF images (brand {_show(brand)}) are not supported")
    return MediaType("video", "mov" if brand == b"qt  " else "mp4")


def _sniff_ogg(data: bytes) -> str:
    """Ogg is a container for audio as often as video; only a Theora stream makes it a video."""
    if b"\x80theora" in data[:4096]:
        return "ogg"
    raise UnsupportedMedia("media is an Ogg file without a Theora video stream (audio?)")


def _is_transport_stream(data: bytes, offset: int, stride: int) -> bool:
    """MPEG-TS has no magic number; a 0x47 sync byte at three successive packets is the test."""
    positions = [offset + i * stride for i in range(3)]
    return len(data) > positions[-1] and all(data[p] == 0x47 for p in positions)


def _sniff_annexb(data: bytes) -> str | None:
    """Raw H.264/HEVC streams start with a start code and, in practice, a parameter set or AUD."""
    if data.startswith(b"\x00\x00\x00\x01"):
        header = data[4:5]
    elif data.startswith(b"\x00\x00\x01"):
        header = data[3:4]
    else:
        return None
    if not header:
        return None
    byte = header[0]
    if byte & 0x80:  # forbidden_zero_bit set: not a NAL unit
        return None
    if byte & 0x1F in (7, 9):  # H.264 SPS, access unit delimiter
        return "h264"
    if (byte >> 1) & 0x3F in (32, 35):  # HEVC VPS, access unit delimiter
        return "hevc"
    return None


def _describe_unknown(data: bytes) -> str:
    """Name what the bytes look like, because "unsupported" alone sends producers guessing."""
    head = data[:512].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if head.startswith((b"<!doctype html", b"<html")):
        return "media is an HTML document (an error or login page?), not an image or video"
    if head.startswith(b"<svg") or (head.startswith(b"<?xml") and b"<svg" in head):
        return "media is an SVG drawing; vector images are not supported"
    if head.startswith(b"%pdf"):
        return "media is a PDF document, not an image or video"
    if head.startswith((b"{", b"[")) and _looks_like_text(data):
        return "media is JSON text, not an image or video"
    if _looks_like_text(data):
        return f"media is text ({_show(data[:24])}...), not an image or video"
    return f"media format not recognised (first bytes {data[:12].hex(' ')})"


def _looks_like_text(data: bytes) -> bool:
    try:
        sample = data[:1024].decode("utf-8")
    except UnicodeDecodeError as exc:
        # A multi-byte character cut at the sample's end is still text.
        if exc.start < 1020:
            return False
        sample = data[: exc.start].decode("utf-8")
    return all(ch.isprintable() or ch in "\t\r\n\f" for ch in sample)


def _show(raw: bytes) -> str:
    return repr(raw.decode("latin-1"))
