"""Test images built in memory with Pillow, so image tests need no fixture files.

Content is a smooth colour gradient plus a few hard edges, so resizing is non-trivial and a flip or
rotation is visible: the top-left corner is always pure red on the upright image, which lets tests
check that EXIF orientation was applied.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import numpy.typing as npt
from PIL import Image

RED = (255, 0, 0)


def pattern(width: int, height: int) -> npt.NDArray[np.uint8]:
    """H×W×3 gradient with a red block in the top-left corner (the "upright" marker)."""
    ys, xs = np.mgrid[0:height, 0:width]
    rgb = np.stack(
        [
            (xs * 255 // max(width - 1, 1)),
            (ys * 255 // max(height - 1, 1)),
            ((xs + ys) * 255 // max(width + height - 2, 1)),
        ],
        axis=-1,
    ).astype(np.uint8)
    rgb[: max(height // 4, 1), : max(width // 4, 1)] = RED
    return rgb


def rgb_image(width: int, height: int) -> Image.Image:
    return Image.fromarray(pattern(width, height))


def encode(img: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **options)
    return out.getvalue()


def jpeg(width: int, height: int, quality: int = 92) -> bytes:
    return encode(rgb_image(width, height), "JPEG", quality=quality)


def png(width: int, height: int) -> bytes:
    return encode(rgb_image(width, height), "PNG")


def webp(width: int, height: int) -> bytes:
    return encode(rgb_image(width, height), "WEBP", lossless=True)


def gif(width: int, height: int) -> bytes:
    return encode(rgb_image(width, height).convert("P", palette=Image.Palette.ADAPTIVE), "GIF")


def tiff(width: int, height: int) -> bytes:
    return encode(rgb_image(width, height), "TIFF")


def bmp(width: int, height: int) -> bytes:
    return encode(rgb_image(width, height), "BMP")


#: EXIF orientation → how the upright picture must be stored so a viewer shows it upright.
_STORE_FOR_ORIENTATION = {
    1: None,
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_90,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}


def exif_jpeg(width: int, height: int, orientation: int) -> bytes:
    """A JPEG whose *upright* picture is width×height with the red marker top-left."""
    upright = rgb_image(width, height)
    op = _STORE_FOR_ORIENTATION[orientation]
    stored = upright if op is None else upright.transpose(op)
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(stored, "JPEG", quality=95, exif=exif.tobytes())


def cmyk_jpeg(width: int, height: int) -> bytes:
    return encode(rgb_image(width, height).convert("CMYK"), "JPEG", quality=95)


def gray_jpeg(width: int, height: int) -> bytes:
    return encode(rgb_image(width, height).convert("L"), "JPEG", quality=95)


def gray_png(width: int, height: int) -> bytes:
    return encode(rgb_image(width, height).convert("L"), "PNG")


def bilevel_png(width: int, height: int) -> bytes:
    return encode(rgb_image(width, height).convert("1"), "PNG")


def rgba_png(width: int, height: int) -> bytes:
    """Left half fully transparent black, right half opaque blue."""
    rgba = np.zeros((height, width, 4), dtype=np.uint8)
    rgba[:, width // 2 :] = (0, 0, 255, 255)
    return encode(Image.fromarray(rgba), "PNG")


def la_png(width: int, height: int) -> bytes:
    """Gray+alpha: left half transparent, right half opaque black."""
    la = np.zeros((height, width, 2), dtype=np.uint8)
    la[:, width // 2 :, 1] = 255
    return encode(Image.fromarray(la), "PNG")


def palette_png_transparent(width: int, height: int) -> bytes:
    """Palette image: transparent black (index 0) on the left half, green on the right."""
    img = Image.new("P", (width, height), 0)
    img.putpalette([0, 0, 0, 0, 255, 0] + [0, 0, 0] * 254)
    img.paste(1, (width // 2, 0, width, height))
    return encode(img, "PNG", transparency=0)


def png16(width: int, height: int) -> bytes:
    """16-bit grayscale: a horizontal ramp 0..65535 (a naive 8-bit convert saturates it)."""
    ramp = np.linspace(0, 65535, width).round().astype(np.uint16)
    return encode(Image.fromarray(np.tile(ramp, (height, 1))), "PNG")


def animated_gif(width: int, height: int) -> bytes:
    """Two frames: solid red, then solid blue. Only the first must be used."""
    frames = [Image.new("RGB", (width, height), c) for c in (RED, (0, 0, 255))]
    return encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)


def animated_webp(width: int, height: int) -> bytes:
    frames = [Image.new("RGB", (width, height), c) for c in (RED, (0, 0, 255))]
    return encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True)


def truncated_jpeg(width: int = 256, height: int = 256) -> bytes:
    data = jpeg(width, height)
    return data[: len(data) // 2]


def corrupt_png() -> bytes:
    """A valid signature and IHDR, then garbage where the compressed pixels should be."""
    return _png_chunks(64, 64, idat=b"\x00not zlib data at all" * 4)


def png_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG header declaring a huge image with almost no data: cheap to build, costly to decode."""
    return _png_chunks(width, height, idat=zlib.compress(b"\x00" * 64))


def _png_chunks(width: int, height: int, idat: bytes) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def text_file() -> bytes:
    return b"This is not an image, just a text file someone named photo.jpg.\n"


def _still(
    fmt: str,
    width: int,
    height: int,
    orientation: int,
    alpha: bool,
    icc: bool,
    **options: object,
) -> bytes:
    """An image whose *upright* picture is width×height with the red marker top-left, stored
    turned as a camera stores it, with the EXIF orientation that turns it back."""
    upright = rgb_image(width, height)
    if alpha:
        # Bottom half fully transparent black: the white background must show there.
        rgba = np.dstack([pattern(width, height), np.full((height, width), 255, np.uint8)])
        rgba[height // 2 :] = 0
        upright = Image.fromarray(rgba)
    op = _STORE_FOR_ORIENTATION[orientation]
    stored = upright if op is None else upright.transpose(op)
    if orientation != 1:
        exif = Image.Exif()
        exif[0x0112] = orientation
        options["exif"] = exif.tobytes()
    if icc:
        from PIL import ImageCms

        profile = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB"))
        options["icc_profile"] = profile.tobytes()
    return encode(stored, fmt, **options)


def avif(
    width: int, height: int, *, orientation: int = 1, alpha: bool = False, icc: bool = False
) -> bytes:
    """AVIF through Pillow's own plugin (libavif); full-resolution chroma keeps the marker red.
    Pillow writes the orientation as the container's rotation and mirror (irot/imir)."""
    return _still("AVIF", width, height, orientation, alpha, icc, quality=95, subsampling="4:4:4")


def heic(
    width: int, height: int, *, orientation: int = 1, alpha: bool = False, icc: bool = False
) -> bytes:
    """HEIC (HEVC stills) through pillow-heif, as an iPhone writes them; the orientation goes
    into the container's irot/imir boxes, which libheif applies when decoding."""
    import pillow_heif

    pillow_heif.register_heif_opener()
    return _still("HEIF", width, height, orientation, alpha, icc, quality=95, chroma=444)
