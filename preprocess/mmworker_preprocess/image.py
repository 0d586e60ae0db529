"""Image bytes → the RGB pixels Qwen2.5-VL consumes, at the size its processor would pick.

Decoding is the CPU hot spot of the worker and the main attack surface for hostile inputs, so the
size is checked from the header before any pixel is decoded, only a short list of formats may be
opened, and JPEGs are decoded at reduced scale when the model will see far fewer pixels anyway.

Phones save HEIC (iPhone) and AVIF (recent Android) by default. AVIF is Pillow's own plugin
(libavif); HEIC/HEIF comes from pillow-heif (libheif), registered here with its thumbnail, depth
and auxiliary-image parsing off: none of them is shown to the model, and each is more untrusted
data parsed. Both parse only the header on open, so the pixel-count limit still applies before
any pixel is decoded. Orientation differs and is handled by each plugin: Pillow's AVIF reports
the container's rotation as an EXIF orientation (the pixels stay as stored, as in a JPEG), while
libheif applies it while decoding and pillow-heif resets the EXIF tag to 1, so either way the
one `_orientation` step below turns the picture upright exactly once.
"""

from __future__ import annotations

import io
import struct
import zlib
from typing import Final

import numpy as np
import numpy.typing as npt
import pillow_heif
from PIL import Image, UnidentifiedImageError

from mmworker_preprocess.errors import (
    BadAspectRatio,
    TooLarge,
    TooManyVisualTokens,
    UndecodableImage,
)
from mmworker_preprocess.params import ImageParams, PreparedImage
from mmworker_preprocess.tokens import fit_pixels, image_tokens, resized

#: Pillow may open only these; other plugins (EPS runs Ghostscript, for one) are never reached.
#: JPEG covers MPO too. AVIF is tried before HEIF: both accept the generic `mif1` brand, and a
#: plugin that cannot read a file hands it on to the next.
FORMATS: Final = ("JPEG", "PNG", "GIF", "WEBP", "TIFF", "BMP", "AVIF", "HEIF")

#: libheif decodes the tiles of a grid image (every iPhone photo) on this many threads; two, as
#: for video, because the worker's process pool already spreads jobs over the cores.
HEIF_DECODE_THREADS: Final = 2
pillow_heif.register_heif_opener(
    thumbnails=False, depth_images=False, aux_images=False, decode_threads=HEIF_DECODE_THREADS
)

#: What Pillow's plugins raise on malformed input; "image file is truncated" is an OSError.
_DECODE_ERRORS: Final = (
    OSError,
    SyntaxError,
    ValueError,
    EOFError,
    struct.error,
    zlib.error,
    IndexError,
    KeyError,
    TypeError,
    RuntimeError,  # libheif's decoder and plugin errors, via pillow-heif
)
_BOMB_ERRORS: Final = (Image.DecompressionBombError, Image.DecompressionBombWarning)

_EXIF_ORIENTATION: Final = 0x0112
#: EXIF orientation → the transpose that undoes it (the table ImageOps.exif_transpose uses).
_TRANSPOSE: Final = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SWAPS_AXES: Final = frozenset({5, 6, 7, 8})
_GRAY16_MODES: Final = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})
_ALPHA_MODES: Final = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_WHITE: Final = (255, 255, 255)
#: Decode a JPEG at reduced scale only when each side shrinks at least this much; libjpeg's
#: smallest step is 1/2, so a smaller shrink would decode at full size anyway.
DRAFT_MIN_SHRINK: Final = 2


def prepare_image(data: bytes, params: ImageParams) -> PreparedImage:
    """Decode the first frame, apply EXIF orientation, flatten to RGB and resize for the model.

    `original_size` is the full-resolution size after orientation, even when decoding was drafted.
    """
    img = _open(data)
    with img:
        stored_size = img.size  # before draft() shrinks it
        stored_target = _target_size(stored_size, params)
        try:
            _maybe_draft(img, stored_target)
            img.load()
            # Read after load: PNG and WebP may keep EXIF behind the pixels, so reading it first
            # would decode anyway and mix metadata errors with pixel errors.
            orientation = _orientation(img)
            upright = img.transpose(_TRANSPOSE[orientation]) if orientation in _TRANSPOSE else img
            target = _oriented(stored_target, orientation)
            resized = to_rgb(upright).resize(target, Image.Resampling.BICUBIC)
        except _BOMB_ERRORS as exc:
            raise TooLarge(f"image refused as a decompression bomb: {exc}") from None
        except _DECODE_ERRORS as exc:
            raise UndecodableImage(f"cannot decode {img.format} image: {exc}") from None
    pixels = np.ascontiguousarray(np.asarray(resized, dtype=np.uint8))
    return PreparedImage(pixels=pixels, original_size=_oriented(stored_size, orientation))


def _target_size(size: tuple[int, int], params: ImageParams) -> tuple[int, int]:
    """The model-side (width, height) for a source of `size`, refusing what must not be decoded.

    smart_resize treats height and width alike, so this works on the stored (not yet rotated)
    size, before decoding; the result is swapped once the EXIF orientation is known.
    """
    width, height = size
    if width * height > params.max_source_pixels:
        raise TooLarge(
            f"image is {width}x{height} = {width * height} pixels; "
            f"the limit is {params.max_source_pixels}"
        )

    def fitted(max_pixels: int) -> tuple[int, int]:
        return resized(
            height,
            width,
            min_pixels=params.min_pixels,
            max_pixels=max_pixels,
            max_ratio=params.max_ratio,
            video=False,
        )

    target_h, target_w = fitted(params.max_pixels)
    budget = params.budget
    if budget is not None and image_tokens(target_h, target_w) > budget:
        # Fitted to its share of the job's context: smaller, down to `min_pixels`.
        cap = fit_pixels(
            height, width, tokens=budget, start=params.max_pixels, floor=params.min_pixels,
            min_pixels=params.min_pixels, max_ratio=params.max_ratio, video=False,
        )  # fmt: skip
        if cap is None:
            raise TooManyVisualTokens(
                f"image {width}x{height} does not fit its budget of {budget} visual tokens: at "
                f"the smallest size ({params.min_pixels} pixels) it needs "
                f"{image_tokens(*fitted(params.min_pixels))}"
            )
        target_h, target_w = fitted(cap)
    # Rounding a short side down to 28 can push a source just under the ratio limit over it
    # (8191x41 → 8204x28, ratio 293). The engine's processor re-checks the ratio on what we send
    # and would fail the whole request, so it is refused here as a property of the image.
    ratio = max(target_w, target_h) / min(target_w, target_h)
    if ratio > params.max_ratio:
        raise BadAspectRatio(
            f"image {width}x{height} resizes to {target_w}x{target_h}, aspect ratio {ratio:.1f}; "
            f"the limit is {params.max_ratio:g}"
        )
    return target_w, target_h


def _oriented(size: tuple[int, int], orientation: int) -> tuple[int, int]:
    return (size[1], size[0]) if orientation in _SWAPS_AXES else size


def _open(data: bytes) -> Image.Image:
    """Parse the header only; Pillow decodes pixels lazily, so sizes can be checked first."""
    try:
        return Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise UndecodableImage(
            f"bytes are not a readable image in any supported format ({', '.join(FORMATS)})"
        ) from None
    except _BOMB_ERRORS as exc:
        raise TooLarge(f"image refused as a decompression bomb: {exc}") from None
    except MemoryError as exc:
        # Only headers are parsed here, so this is libheif's security limits (image size, tile
        # count) refusing the file, not the process running out of memory.
        raise TooLarge(f"image refused by the decoder's size limits: {exc}") from None
    except _DECODE_ERRORS as exc:
        raise UndecodableImage(f"cannot read the image header: {exc}") from None


def _orientation(img: Image.Image) -> int:
    """EXIF orientation, 1 when absent; call after `load()` so only EXIF parsing can fail here.

    A malformed EXIF block counts as absent: the pixels are fine, and failing the job over
    metadata the model never sees would be worse than showing the image unrotated.
    """
    try:
        value = img.getexif().get(_EXIF_ORIENTATION, 1)
    except _DECODE_ERRORS:
        return 1
    return value if isinstance(value, int) and value in _TRANSPOSE else 1


def _maybe_draft(img: Image.Image, target: tuple[int, int]) -> None:
    """Let libjpeg decode at 1/2, 1/4 or 1/8 scale, still at least `target` in each side.

    Decoding a 24-megapixel photo that the model sees at 1 megapixel is most of the CPU cost; the
    drafted pixels differ slightly from a full decode, but the final size is the same.
    """
    if img.format not in ("JPEG", "MPO"):
        return
    stored_w, stored_h = img.size
    target_w, target_h = target
    if stored_w >= DRAFT_MIN_SHRINK * target_w and stored_h >= DRAFT_MIN_SHRINK * target_h:
        img.draft("RGB", (target_w, target_h))


def to_rgb(img: Image.Image) -> Image.Image:
    """Flatten any mode to 8-bit RGB the way the model was trained to see it.

    Transparent areas become white (as qwen-vl-utils' `to_rgb` does) rather than the black or
    arbitrary palette colour a bare `convert("RGB")` leaves; 16-bit data is scaled, not clipped.
    """
    if img.mode in _GRAY16_MODES or img.mode == "F":
        return Image.fromarray(_gray_to_uint8(np.asarray(img))).convert("RGB")
    if img.mode in _ALPHA_MODES or "transparency" in img.info:
        rgba = img.convert("RGBA")
        flat = Image.new("RGB", rgba.size, _WHITE)
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return img if img.mode == "RGB" else img.convert("RGB")


def _gray_to_uint8(values: npt.NDArray[np.generic]) -> npt.NDArray[np.uint8]:
    """Map 16-bit (or 32-bit int holding 16-bit) gray to 0..255; floats have no fixed range."""
    if np.issubdtype(values.dtype, np.floating):
        lo, hi = float(np.min(values)), float(np.max(values))
        scaled = (values.astype(np.float64) - lo) * (255.0 / (hi - lo) if hi > lo else 0.0)
        return np.rint(scaled).astype(np.uint8)
    wide = np.clip(values.astype(np.int64), 0, 65535)
    return ((wide * 255 + 32767) // 65535).astype(np.uint8)
