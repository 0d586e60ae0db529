"""Decide what a blob really is from its bytes, ignoring names, headers and declared kinds.

Producers mislabel media (a PNG called .jpg, an HTML error page saved as a video), and handing an
unknown blob to a decoder wastes CPU and can exercise rarely used, fragile code paths. Sniffing
first picks the decoder and rejects everything else with a message a producer can act on.

Stills are recognised by signature, because only the formats Pillow may open here are images.
Videos are not: phones, cameras and archives use more containers than any list of magic numbers
keeps up with (ASF/WMV, MXF, NUT, RealMedia, DV...), so whatever is neither a known still nor
plainly not media (empty, text, a document, audio) is handed to FFmpeg's own probe, and it is a
video when FFmpeg finds a video stream it has a decoder for. The common containers' signatures
are kept only as a shortcut past that probe, never as a reason to refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmworker_preprocess.avopen import open_input
from mmworker_preprocess.errors import UnsupportedMedia

MediaKindName = Literal["image", "video"]

#: ISO base media (ftyp) brands that carry audio only; refusing them here gives a clearer
#: message than the video decoder's "no video stream".
_AUDIO_BRANDS = frozenset({b"M4A ", b"M4B ", b"M4P ", b"F4A ", b"F4B "})
#: HEIF stills (and their bursts) share the ftyp box with MP4. `mif1`/`msf1`/`miaf` are the
#: generic HEIF brands: the compatible brands then say whether the pictures are HEVC or AV1.
_HEIF_BRANDS = frozenset(
    {b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"hevm", b"hevs", b"mif1", b"msf1"}
)
_GENERIC_HEIF_BRANDS = frozenset({b"mif1", b"msf1", b"miaf"})
_AVIF_BRANDS = frozenset({b"avif", b"avis"})
#: FFmpeg demuxers that read one still picture: FFmpeg would call it a one-frame video, but it
#: is an image in a format Pillow is not allowed to open here. Single-image demuxers are all
#: named "<codec>_pipe" (libavformat/img2dec.c); these are the others.
_FFMPEG_STILL_DEMUXERS = frozenset({"image2", "image2pipe", "ico", "alias_pix", "brender_pix"})
#: Sizes of the BMP info header variants; "BM" alone is too weak (any text starting "BM...").
_BMP_DIB_SIZES = frozenset({12, 16, 40, 52, 56, 64, 108, 124})
_TS_PACKET = 188


@dataclass(frozen=True, slots=True)
class MediaType:
    kind: MediaKindName
    format: str


def sniff(data: bytes) -> MediaType:
    """Return the media type of `data`, or raise `UnsupportedMedia` saying what it looks like."""
    found = sniff_signature(data)
    if found is not None:
        return found
    found = _probe_video(data)
    if found is not None:
        return found
    raise UnsupportedMedia(f"media format not recognised (first bytes {data[:12].hex(' ')})")


def sniff_signature(data: bytes) -> MediaType | None:
    """`sniff` without FFmpeg's probe: None when only the probe can tell (a video, or nothing).

    Pure Python over the first bytes, so it is safe in a process that must not crash: the probe
    parses an untrusted container with FFmpeg, and a blob that crashes it must take down a
    decoding process (which is replaced, and the blob refused), not the worker itself."""
    if not data:
        raise UnsupportedMedia("media is empty (0 bytes)")
    found = _sniff_image(data) or _sniff_video(data)
    if found is not None:
        return found
    # Text is refused before FFmpeg sees it: FFmpeg would read some text as subtitles.
    refusal = _describe_non_media(data)
    if refusal is not None:
        raise UnsupportedMedia(refusal)
    return None


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
    elif data[4:8] == b"ftyp":
        fmt = _ftyp_still(data)
    return MediaType("image", fmt) if fmt else None


def _ftyp_still(data: bytes) -> str | None:
    """ "avif" or "heif" for an ISO base media file that holds stills, None for a movie."""
    major = data[8:12]
    if major not in _AVIF_BRANDS | _HEIF_BRANDS | _GENERIC_HEIF_BRANDS:
        return None
    if major in _AVIF_BRANDS:
        return "avif"
    if major in _GENERIC_HEIF_BRANDS and _AVIF_BRANDS & _compatible_brands(data):
        return "avif"
    return "heif"


def _compatible_brands(data: bytes) -> frozenset[bytes]:
    size = min(int.from_bytes(data[:4], "big"), len(data), 4096)
    return frozenset(data[i : i + 4] for i in range(16, size - 3, 4))


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
    if brand == b"qt  ":
        return MediaType("video", "mov")
    return MediaType("video", "3gp" if brand.startswith(b"3g") else "mp4")


def _probe_video(data: bytes) -> MediaType | None:
    """Ask FFmpeg: a video is whatever it can demux with a video stream it can decode.

    None when FFmpeg recognises no container at all. PyAV is imported here, not at module
    level, so that sniffing images never pays for loading FFmpeg.
    """
    import av
    import av.error
    from av.stream import Disposition

    try:
        container = open_input(data)
    except av.error.FFmpegError:
        return None
    with container:
        fmt = str(container.format.name).split(",")[0]
        if fmt.endswith("_pipe") or fmt in _FFMPEG_STILL_DEMUXERS:
            name = fmt.removesuffix("_pipe")
            raise UnsupportedMedia(
                f"media is a still image in a format that is not supported ({name})"
            )
        videos = [
            s
            for s in container.streams.video
            if not s.disposition & Disposition.attached_pic and s.codec_context is not None
        ]
        if videos:
            return MediaType("video", fmt)
        kinds = ", ".join(sorted({str(s.type) for s in container.streams})) or "none"
        if container.streams.video:
            raise UnsupportedMedia(
                f"media is {fmt} whose video has no decoder here (streams: {kinds})"
            )
        raise UnsupportedMedia(f"media is {fmt} without a video stream (streams: {kinds})")


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


def _describe_non_media(data: bytes) -> str | None:
    """Name what the bytes look like when that is plainly not media, because "unsupported"
    alone sends producers guessing; None when they may still be a container FFmpeg knows."""
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
    return None


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
