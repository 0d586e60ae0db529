"""AVIF and HEIC stills, as phones save them, go through the same image path as JPEG.

Every file is written here: AVIF by Pillow's own plugin, HEIC by pillow-heif. Each check is on
decoded pixels: the red marker is top-left on the upright picture, so a missed or doubled
rotation shows.
"""

from __future__ import annotations

import numpy as np
import pytest
from mmworker_preprocess import image as image_module
from mmworker_preprocess.errors import TooLarge, UndecodableImage
from mmworker_preprocess.image import prepare_image
from mmworker_preprocess.params import ImageParams, VideoParams
from mmworker_preprocess.prepare import prepare_media
from mmworker_schemas.codes import ErrorCode
from PIL import Image

from tests import media_images as imgs

DEFAULT = ImageParams()
STILLS = [imgs.avif, imgs.heic]


def _reference(width: int, height: int, size: tuple[int, int]) -> np.ndarray:
    """The upright picture, resized the way the worker resizes."""
    return np.asarray(imgs.rgb_image(width, height).resize(size, Image.Resampling.BICUBIC))


def _mean_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(int) - b.astype(int)).mean())


@pytest.mark.parametrize("build", STILLS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("orientation", range(1, 9))
def test_orientation_is_applied_once(build, orientation):
    # 96x64 upright, stored turned or mirrored with the orientation that turns it back.
    prepared = prepare_image(build(96, 64, orientation=orientation), DEFAULT)
    assert prepared.original_size == (96, 64)
    ref = _reference(96, 64, prepared.resized_size)
    assert _mean_error(prepared.pixels, ref) < 4.0, "lossy coding only, not a turned picture"
    # The same picture mirrored would differ by far more: the check can tell orientations apart.
    assert _mean_error(prepared.pixels, ref[:, ::-1]) > 20.0


@pytest.mark.parametrize("build", STILLS, ids=lambda f: f.__name__)
def test_alpha_is_composited_on_white(build):
    prepared = prepare_image(build(96, 64, alpha=True), DEFAULT)
    h = prepared.pixels.shape[0]
    # The transparent bottom half is stored black: a bare convert("RGB") would show black.
    assert (prepared.pixels[h - 3, 5:-5] >= 250).all()
    assert prepared.pixels[3, 3, 0] > 220 and prepared.pixels[3, 3, 1:].max() < 40


@pytest.mark.parametrize("build", STILLS, ids=lambda f: f.__name__)
def test_an_icc_profile_is_treated_as_for_jpeg(build):
    # JPEG's embedded profile is not applied (the model was trained on stored sRGB values), so
    # a tagged still gives the same pixels as an untagged one.
    tagged = prepare_image(build(96, 64, icc=True), DEFAULT)
    plain = prepare_image(build(96, 64), DEFAULT)
    np.testing.assert_array_equal(tagged.pixels, plain.pixels)


def _never_decode(monkeypatch):
    """Make decoding pixels fail loudly, for every format: only headers may be read."""
    opened = image_module._open

    def open_without_decoding(data):
        img = opened(data)

        def load():
            raise AssertionError(f"{img.format} pixels were decoded")

        img.load = load
        return img

    monkeypatch.setattr(image_module, "_open", open_without_decoding)


@pytest.mark.parametrize(
    "build",
    [imgs.jpeg, imgs.png, imgs.gif, imgs.webp, imgs.tiff, imgs.bmp, imgs.avif, imgs.heic],
    ids=lambda f: f.__name__,
)
def test_pixel_limit_is_checked_before_decoding_in_every_format(build, monkeypatch):
    data = build(120, 80)
    _never_decode(monkeypatch)
    with pytest.raises(TooLarge, match="9600 pixels") as info:
        prepare_image(data, ImageParams(max_source_pixels=120 * 80 - 1))
    assert info.value.code is ErrorCode.TOO_LARGE
    with pytest.raises(AssertionError, match="decoded"):  # the spy does stop a decode
        prepare_image(data, ImageParams(max_source_pixels=120 * 80))


@pytest.mark.parametrize("build", STILLS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("keep", [0.5, 0.9])
def test_cut_stills_are_undecodable(build, keep):
    data = build(96, 64)
    with pytest.raises(UndecodableImage) as info:
        prepare_image(data[: int(len(data) * keep)], DEFAULT)
    assert not info.value.retryable


@pytest.mark.parametrize("build", STILLS, ids=lambda f: f.__name__)
def test_stills_are_prepared_as_images_by_content(build):
    prepared = prepare_media(build(96, 64), DEFAULT, VideoParams())
    assert prepared.original_size == (96, 64)
    assert prepared.pixels.shape == (*prepared.resized_size[::-1], 3)
