from __future__ import annotations

import io

import numpy as np
import pytest
from mmworker_preprocess.errors import BadAspectRatio, TooLarge, UndecodableImage
from mmworker_preprocess.image import prepare_image
from mmworker_preprocess.params import ImageParams
from mmworker_preprocess.resize import smart_resize
from mmworker_preprocess.tokens import image_tokens
from mmworker_schemas.codes import ErrorCode
from PIL import Image, ImageOps, JpegImagePlugin

from tests import media_images as imgs

DEFAULT = ImageParams()


def _check_shape(prepared, width, height, params=DEFAULT):
    """The invariants every prepared image must meet, whatever its source."""
    px = prepared.pixels
    assert px.dtype == np.uint8
    assert px.ndim == 3 and px.shape[2] == 3
    assert px.flags.c_contiguous
    assert prepared.original_size == (width, height)
    want_h, want_w = smart_resize(height, width, 28, params.min_pixels, params.max_pixels)
    assert px.shape[:2] == (want_h, want_w)
    assert prepared.resized_size == (want_w, want_h)


def _is_red(rgb) -> bool:
    return rgb[0] > 220 and rgb[1] < 40 and rgb[2] < 40


@pytest.mark.parametrize(
    "build",
    [imgs.jpeg, imgs.png, imgs.webp, imgs.gif, imgs.tiff, imgs.bmp],
    ids=lambda f: f.__name__,
)
@pytest.mark.parametrize(("width", "height"), [(300, 200), (200, 300), (1000, 37)])
def test_formats_decode_to_model_size(build, width, height):
    prepared = prepare_image(build(width, height), DEFAULT)
    _check_shape(prepared, width, height)
    assert _is_red(prepared.pixels[2, 2]), "top-left marker must survive decoding upright"
    assert not _is_red(prepared.pixels[-3, -3])


def test_lossless_png_resize_matches_pillow_bicubic_exactly():
    data = imgs.png(333, 222)
    prepared = prepare_image(data, DEFAULT)
    ref = Image.open(io.BytesIO(data)).convert("RGB").resize(prepared.resized_size, Image.BICUBIC)
    np.testing.assert_array_equal(prepared.pixels, np.asarray(ref))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied(orientation):
    data = imgs.exif_jpeg(320, 200, orientation)
    prepared = prepare_image(data, DEFAULT)
    _check_shape(prepared, 320, 200)
    assert _is_red(prepared.pixels[3, 3])
    assert not _is_red(prepared.pixels[-4, -4])
    reference = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    assert reference.size == (320, 200)
    ref = np.asarray(reference.resize(prepared.resized_size, Image.BICUBIC))
    np.testing.assert_array_equal(prepared.pixels, ref)


def test_out_of_range_orientation_is_ignored():
    exif = Image.Exif()
    exif[0x0112] = 9
    data = imgs.encode(imgs.rgb_image(300, 200), "JPEG", exif=exif.tobytes())
    prepared = prepare_image(data, DEFAULT)
    _check_shape(prepared, 300, 200)
    assert _is_red(prepared.pixels[3, 3])


@pytest.mark.filterwarnings("ignore:Corrupt EXIF data")
def test_malformed_exif_does_not_fail_the_image():
    data = imgs.encode(
        imgs.rgb_image(300, 200), "JPEG", exif=b"Exif\x00\x00MM\x00*\xff\xff\xff\xff"
    )
    prepared = prepare_image(data, DEFAULT)
    _check_shape(prepared, 300, 200)
    assert _is_red(prepared.pixels[3, 3])


def test_cmyk_jpeg_becomes_rgb():
    prepared = prepare_image(imgs.cmyk_jpeg(300, 200), DEFAULT)
    _check_shape(prepared, 300, 200)
    assert _is_red(prepared.pixels[3, 3])


@pytest.mark.parametrize(
    ("build", "opaque"),
    [
        (imgs.rgba_png, (0, 0, 255)),
        (imgs.la_png, (0, 0, 0)),
        (imgs.palette_png_transparent, (0, 255, 0)),
    ],
    ids=["rgba", "la", "palette"],
)
def test_transparency_is_composited_on_white(build, opaque):
    prepared = prepare_image(build(200, 100), DEFAULT)
    _check_shape(prepared, 200, 100)
    # The transparent half is stored black: a bare convert("RGB") would show black there.
    np.testing.assert_array_equal(prepared.pixels[10, 10], (255, 255, 255))
    np.testing.assert_array_equal(prepared.pixels[10, -10], opaque)


def test_rgb_with_colour_key_transparency_is_composited():
    img = Image.new("RGB", (100, 100), (0, 0, 0))
    img.paste((9, 9, 9), (50, 0, 100, 100))
    prepared = prepare_image(imgs.encode(img, "PNG", transparency=(0, 0, 0)), DEFAULT)
    np.testing.assert_array_equal(prepared.pixels[5, 5], (255, 255, 255))
    np.testing.assert_array_equal(prepared.pixels[5, -5], (9, 9, 9))


def test_sixteen_bit_gray_is_scaled_not_clipped():
    prepared = prepare_image(imgs.png16(512, 64), DEFAULT)
    _check_shape(prepared, 512, 64)
    row = prepared.pixels[prepared.pixels.shape[0] // 2, :, 0].astype(int)
    assert row[0] <= 2 and row[-1] >= 253
    assert 110 <= row[len(row) // 2] <= 145, "mid-ramp must be mid-gray, not saturated"
    assert np.all(np.diff(row) >= -1), "the ramp must stay monotonic"
    assert (row == 255).mean() < 0.05
    assert np.array_equal(prepared.pixels[..., 0], prepared.pixels[..., 2])


def test_32_bit_int_gray_holding_16_bit_data_is_scaled():
    ramp = np.tile(np.linspace(0, 65535, 256).astype(np.int32), (64, 1))
    data = imgs.encode(Image.fromarray(ramp), "TIFF")
    prepared = prepare_image(data, DEFAULT)
    row = prepared.pixels[10, :, 1].astype(int)
    assert row[0] <= 2 and row[-1] >= 253 and 110 <= row[len(row) // 2] <= 145


def test_float_gray_is_stretched_to_full_range():
    ramp = np.tile(np.linspace(-1.0, 3.0, 256).astype(np.float32), (64, 1))
    prepared = prepare_image(imgs.encode(Image.fromarray(ramp), "TIFF"), DEFAULT)
    row = prepared.pixels[10, :, 0].astype(int)
    assert row[0] <= 2 and row[-1] >= 253


@pytest.mark.parametrize("build", [imgs.gray_png, imgs.gray_jpeg, imgs.bilevel_png])
def test_grayscale_becomes_three_equal_channels(build):
    prepared = prepare_image(build(300, 200), DEFAULT)
    _check_shape(prepared, 300, 200)
    px = prepared.pixels.astype(int)
    assert np.array_equal(px[..., 0], px[..., 1]) and np.array_equal(px[..., 1], px[..., 2])
    assert px.min() < 30 and px.max() > 225


@pytest.mark.parametrize("build", [imgs.animated_gif, imgs.animated_webp])
def test_animated_images_use_the_first_frame(build):
    prepared = prepare_image(build(120, 90), DEFAULT)
    _check_shape(prepared, 120, 90)
    assert all(_is_red(p) for p in prepared.pixels.reshape(-1, 3)[::97])


@pytest.mark.parametrize(("width", "height"), [(1, 1), (10, 10), (3, 40), (28, 28)])
def test_tiny_images_are_upscaled_to_the_minimum(width, height):
    prepared = prepare_image(imgs.png(width, height), DEFAULT)
    _check_shape(prepared, width, height)
    h, w = prepared.pixels.shape[:2]
    assert h * w >= DEFAULT.min_pixels


def test_large_images_are_bounded_by_max_pixels():
    params = ImageParams(max_pixels=256 * 28 * 28)
    prepared = prepare_image(imgs.png(1500, 1000), params)
    _check_shape(prepared, 1500, 1000, params)
    assert image_tokens(*prepared.pixels.shape[:2]) <= 256


def test_extreme_aspect_ratio_up_to_the_limit_is_accepted():
    prepared = prepare_image(imgs.png(4000, 20), DEFAULT)  # ratio exactly 200
    _check_shape(prepared, 4000, 20)


def test_aspect_ratio_beyond_the_limit_is_refused():
    with pytest.raises(BadAspectRatio) as info:
        prepare_image(imgs.png(4020, 20), DEFAULT)
    assert info.value.code is ErrorCode.BAD_ASPECT_RATIO
    with pytest.raises(BadAspectRatio):
        prepare_image(imgs.png(300, 100), ImageParams(max_ratio=2.0))


@pytest.mark.parametrize(
    "data",
    [imgs.truncated_jpeg(), imgs.corrupt_png(), imgs.text_file(), b"", b"\xff\xd8\xff\xe0garbage"],
    ids=["truncated-jpeg", "corrupt-png", "text", "empty", "jpeg-magic-garbage"],
)
def test_broken_images_raise_undecodable(data):
    with pytest.raises(UndecodableImage) as info:
        prepare_image(data, DEFAULT)
    assert info.value.code is ErrorCode.UNDECODABLE_IMAGE
    assert "BytesIO" not in info.value.message


def test_formats_outside_the_allow_list_are_not_opened():
    data = imgs.encode(imgs.rgb_image(32, 32), "PPM")  # Pillow reads PPM, but we do not
    with pytest.raises(UndecodableImage, match="supported format"):
        prepare_image(data, DEFAULT)


def test_decompression_bomb_is_refused():
    with pytest.raises(TooLarge) as info:
        prepare_image(imgs.png_bomb(), DEFAULT)
    assert info.value.code is ErrorCode.TOO_LARGE


def test_pixel_guard_runs_before_decoding():
    # The pixel data is garbage: decoding would raise UndecodableImage, so TooLarge proves the
    # size was refused from the header alone.
    bomb = imgs.png_bomb(9000, 9000)
    with pytest.raises(TooLarge, match="81000000 pixels"):
        prepare_image(bomb, ImageParams(max_source_pixels=50_000_000))
    with pytest.raises(UndecodableImage):
        prepare_image(bomb, ImageParams(max_source_pixels=90_000_000))


@pytest.mark.filterwarnings("error::PIL.Image.DecompressionBombWarning")
def test_bomb_warning_raised_as_error_maps_to_too_large():
    with pytest.raises(TooLarge):
        prepare_image(imgs.png_bomb(10_000, 10_000), DEFAULT)


class _DraftSpy:
    def __init__(self, monkeypatch):
        self.calls: list[tuple[int, int]] = []
        original = JpegImagePlugin.JpegImageFile.draft

        def spy(img, mode, size):
            self.calls.append(size)
            return original(img, mode, size)

        monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)


def test_jpeg_draft_decodes_small_but_gives_the_exact_size(monkeypatch):
    spy = _DraftSpy(monkeypatch)
    params = ImageParams(max_pixels=300 * 28 * 28)
    data = imgs.jpeg(2400, 1800)
    prepared = prepare_image(data, params)
    _check_shape(prepared, 2400, 1800, params)
    assert spy.calls == [prepared.resized_size]
    full = Image.open(io.BytesIO(data)).convert("RGB").resize(prepared.resized_size, Image.BICUBIC)
    diff = np.abs(prepared.pixels.astype(int) - np.asarray(full).astype(int))
    assert diff.mean() < 2.0, "drafted pixels must stay close to a full decode"


def test_jpeg_draft_with_rotation_uses_the_stored_orientation(monkeypatch):
    spy = _DraftSpy(monkeypatch)
    params = ImageParams(max_pixels=200 * 28 * 28)
    prepared = prepare_image(imgs.exif_jpeg(1200, 2000, 6), params)
    _check_shape(prepared, 1200, 2000, params)
    w, h = prepared.resized_size
    assert spy.calls == [(h, w)], "the stored picture is landscape; draft must ask for that"
    assert _is_red(prepared.pixels[3, 3])


def test_no_draft_when_shrink_is_small(monkeypatch):
    spy = _DraftSpy(monkeypatch)
    prepared = prepare_image(imgs.jpeg(600, 400), DEFAULT)
    _check_shape(prepared, 600, 400)
    assert spy.calls == []


def test_every_error_is_typed_and_not_retryable():
    cases = [imgs.truncated_jpeg(), imgs.png_bomb(), imgs.png(4020, 20)]
    for data in cases:
        with pytest.raises((UndecodableImage, TooLarge, BadAspectRatio)) as info:
            prepare_image(data, DEFAULT)
        assert not info.value.retryable


@pytest.mark.parametrize(
    ("width", "height", "max_pixels"), [(3000, 1000, 2 * 784), (300, 260, 784)]
)
def test_a_cap_below_the_models_floor_settles_where_the_engine_keeps_it(
    width: int, height: int, max_pixels: int
) -> None:
    """vLLM re-runs smart_resize with the model's bounds; the size we pick must be its fixed point,
    or the tokens the worker counts are not the ones the engine uses."""
    from mmworker_preprocess.params import MIN_PIXELS

    data = io.BytesIO()
    Image.new("RGB", (width, height), (40, 90, 200)).save(data, format="PNG")
    pixels = prepare_image(
        data.getvalue(), ImageParams(min_pixels=784, max_pixels=max_pixels)
    ).pixels
    h, w = pixels.shape[:2]
    assert h * w >= MIN_PIXELS
    assert smart_resize(h, w) == (h, w)
