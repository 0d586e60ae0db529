"""Our image sizes (and, where the pipelines agree, our pixels) against transformers' processor.

The reference is transformers' slow `Qwen2VLImageProcessorPil`, run in a subprocess with torch,
torchvision and torchaudio switched off: the PIL processor needs none of them, the CPU torch stack
on this machine does not always import, and switching them off inside the test process would leak
into other tests. The engine re-derives the grid from the size we hand it, so a size mismatch
would mean a different visual token count than the worker budgeted for.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from mmworker_preprocess.errors import BadAspectRatio
from mmworker_preprocess.image import prepare_image
from mmworker_preprocess.params import MAX_PIXELS, MIN_PIXELS, ImageParams
from mmworker_preprocess.resize import smart_resize

from tests import media_images as imgs

HF_MIN, HF_MAX = 56 * 56, 28 * 28 * 1280  # transformers' own defaults, a second parameter set
PATCH, MERGE = 14, 2

_REFERENCE = r"""
import json, sys
import numpy as np
import transformers.utils as tu
import transformers.utils.import_utils as iu

for name in ("is_torch_available", "is_torchvision_available", "is_torchaudio_available"):
    setattr(iu, name, lambda: False)
    setattr(tu, name, lambda: False)

from PIL import Image, ImageOps
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil, smart_resize,
)

job = json.load(sys.stdin)
out = {"images": [], "sweep": [], "fixed": []}
for case in job["images"]:
    proc = Qwen2VLImageProcessorPil(
        size={"shortest_edge": case["min_pixels"], "longest_edge": case["max_pixels"]}
    )
    with Image.open(case["path"]) as img:
        img.seek(0)
        upright = ImageOps.exif_transpose(img)  # the processor itself ignores EXIF
        feats = proc(images=[upright], return_tensors="np", do_rescale=False, do_normalize=False)
    t, gh, gw = (int(v) for v in feats["image_grid_thw"][0])
    patches = np.asarray(feats["pixel_values"]).reshape(
        gh // 2, gw // 2, 2, 2, 3, proc.temporal_patch_size, 14, 14
    )[..., 0, :, :]
    pixels = patches.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * 14, gw * 14)
    np.save(case["path"] + ".ref.npy", np.rint(pixels.transpose(1, 2, 0)).astype(np.uint8))
    out["images"].append([t, gh, gw])
for h, w, lo, hi in job["sweep"]:
    out["sweep"].append(list(smart_resize(h, w, factor=28, min_pixels=lo, max_pixels=hi)))
for h, w, lo, hi in job["fixed"]:
    try:
        out["fixed"].append(list(smart_resize(h, w, factor=28, min_pixels=lo, max_pixels=hi)))
    except ValueError:  # aspect ratio over 200
        out["fixed"].append(None)
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Case:
    name: str
    data: bytes
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    #: Whether our pixels must equal the reference's: false where we deliberately differ
    #: (white compositing, 16-bit scaling, drafted JPEG decoding).
    same_pixels: bool = True


def _cases() -> list[Case]:
    small = {"min_pixels": HF_MIN, "max_pixels": HF_MAX}
    return [
        Case("jpeg-640x480", imgs.jpeg(640, 480)),
        Case("jpeg-1920x1080", imgs.jpeg(1920, 1080)),
        Case("jpeg-1920x1080-hf", imgs.jpeg(1920, 1080), **small, same_pixels=False),
        Case("jpeg-3600-square", imgs.jpeg(3600, 3600)),
        Case("png-333x222", imgs.png(333, 222)),
        Case("png-333x222-hf", imgs.png(333, 222), **small),
        Case("png-1000x37", imgs.png(1000, 37)),
        Case("png-37x1000", imgs.png(37, 1000)),
        Case("png-4000x20-ratio-200", imgs.png(4000, 20)),
        Case("webp-500x500", imgs.webp(500, 500)),
        Case("gif-300x200", imgs.gif(300, 200)),
        Case("tiff-123x456", imgs.tiff(123, 456)),
        Case("bmp-250x90", imgs.bmp(250, 90)),
        Case("exif6-320x200", imgs.exif_jpeg(320, 200, 6)),
        Case("exif8-500x300", imgs.exif_jpeg(500, 300, 8)),
        Case("exif5-97x211", imgs.exif_jpeg(97, 211, 5)),
        Case("cmyk-300x200", imgs.cmyk_jpeg(300, 200)),
        Case("rgba-200x100", imgs.rgba_png(200, 100), same_pixels=False),
        Case("palette-150x150", imgs.palette_png_transparent(150, 150), same_pixels=False),
        Case("png16-512x64", imgs.png16(512, 64), same_pixels=False),
        Case("gray-299x301", imgs.gray_png(299, 301)),
        Case("bilevel-100x700", imgs.bilevel_png(100, 700)),
        Case("animated-gif-120x90", imgs.animated_gif(120, 90)),
        Case("tiny-1x1", imgs.png(1, 1)),
        Case("tiny-10x10", imgs.png(10, 10)),
        Case("tiny-10x10-hf", imgs.png(10, 10), **small),
        Case("draft-3000x2000", imgs.jpeg(3000, 2000), max_pixels=256 * 28 * 28, same_pixels=False),
        Case("wide-2000x300-hf", imgs.png(2000, 300), **small),
    ]


def _sweep() -> list[tuple[int, int, int, int]]:
    """Sizes for the bare resize rule: rounding boundaries (k·28 ± 14) and the pixel limits."""
    sides = [15, 16, 27, 28, 41, 42, 43, 55, 56, 100, 333, 479, 480, 1023, 1024, 3583, 3584, 3600]
    sides += [5000, 8191, 10000]
    limits = [(MIN_PIXELS, MAX_PIXELS), (HF_MIN, HF_MAX), (256 * 28 * 28, 1024 * 28 * 28)]
    return [
        (h, w, lo, hi)
        for h in sides
        for w in sides
        for lo, hi in limits
        if max(h, w) / min(h, w) <= 200
    ]


#: Original sizes whose sides are 14 px or less, where transformers' rule differs from ours.
_THIN = [(1000, 10), (14, 100), (3, 40), (1, 1), (10, 10), (2000, 12)]


def _fixed_points() -> list[tuple[int, int, int, int]]:
    """Our outputs for every sweep size and the thin sizes, to be fed back to transformers."""
    sizes = [(h, w, lo, hi) for h, w, lo, hi in _sweep()]
    sizes += [(h, w, MIN_PIXELS, MAX_PIXELS) for h, w in _THIN]
    return [(*smart_resize(h, w, 28, lo, hi), lo, hi) for h, w, lo, hi in sizes]


def _run_reference(job: dict[str, object]) -> dict[str, list[list[int]]]:
    proc = subprocess.run(
        [sys.executable, "-c", _REFERENCE],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    if proc.returncode != 0:
        tail = proc.stderr[-2000:]
        if "No module named 'transformers'" in tail:
            pytest.skip("transformers is not installed")
        pytest.fail(f"reference processor failed:\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[list[Case], list[Path], dict[str, list[list[int]]]]:
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("parity")
    cases = _cases()
    paths = []
    for case in cases:
        path = folder / f"{case.name}.bin"
        path.write_bytes(case.data)
        paths.append(path)
    job = {
        "images": [
            {"path": str(p), "min_pixels": c.min_pixels, "max_pixels": c.max_pixels}
            for c, p in zip(cases, paths, strict=True)
        ],
        "sweep": _sweep(),
        "fixed": _fixed_points(),
    }
    return cases, paths, _run_reference(job)


def test_at_least_twenty_varied_images(reference):
    cases, _, result = reference
    assert len(cases) >= 20 and len(result["images"]) == len(cases)


def test_resized_size_matches_the_processor_grid(reference):
    cases, _, result = reference
    mismatches = []
    for case, (t, grid_h, grid_w) in zip(cases, result["images"], strict=True):
        params = ImageParams(min_pixels=case.min_pixels, max_pixels=case.max_pixels)
        h, w = prepare_image(case.data, params).pixels.shape[:2]
        assert t == 1
        assert h % (PATCH * MERGE) == 0 and w % (PATCH * MERGE) == 0
        if (h // PATCH, w // PATCH) != (grid_h, grid_w):
            mismatches.append(f"{case.name}: ours {h}x{w}, processor {grid_h * 14}x{grid_w * 14}")
    assert not mismatches, "\n".join(mismatches)


def test_pixels_match_the_processor_where_pipelines_agree(reference):
    cases, paths, _ = reference
    compared = 0
    for case, path in zip(cases, paths, strict=True):
        if not case.same_pixels:
            continue
        params = ImageParams(min_pixels=case.min_pixels, max_pixels=case.max_pixels)
        ours = prepare_image(case.data, params).pixels
        ref = np.load(f"{path}.ref.npy")
        assert ours.shape == ref.shape, case.name
        diff = np.abs(ours.astype(int) - ref.astype(int))
        assert diff.max() == 0, f"{case.name}: max pixel difference {diff.max()}"
        compared += 1
    assert compared >= 15


def test_drafted_jpeg_stays_close_to_the_processor(reference):
    cases, paths, _ = reference
    index = next(i for i, c in enumerate(cases) if c.name == "draft-3000x2000")
    case = cases[index]
    ours = prepare_image(case.data, ImageParams(max_pixels=case.max_pixels)).pixels
    ref = np.load(f"{paths[index]}.ref.npy")
    assert ours.shape == ref.shape
    assert np.abs(ours.astype(int) - ref.astype(int)).mean() < 2.0


def test_resize_rule_matches_transformers_on_a_size_sweep(reference):
    _, _, result = reference
    sweep = _sweep()
    assert len(sweep) == len(result["sweep"]) > 1000
    for (h, w, lo, hi), theirs in zip(sweep, result["sweep"], strict=True):
        assert list(smart_resize(h, w, 28, lo, hi)) == theirs, (h, w, lo, hi)


def test_our_sizes_are_fixed_points_of_the_engine_rule(reference):
    """The engine's processor re-derives the size from what we send; it must keep ours unchanged,
    or the engine would see a different token count than the worker budgeted for."""
    _, _, result = reference
    fixed = _fixed_points()
    assert len(fixed) == len(result["fixed"])
    refused = 0
    for (h, w, _, _), theirs in zip(fixed, result["fixed"], strict=True):
        if max(h, w) / min(h, w) > 200:
            assert theirs is None, "the processor refuses resized ratios over 200"
            refused += 1
        else:
            assert [h, w] == theirs
    assert refused > 0, "the sweep must include sizes whose rounding breaks the ratio limit"


@pytest.mark.parametrize(("width", "height"), [(41, 8191), (8191, 41), (7000, 40)])
def test_sizes_the_engine_would_refuse_are_refused_up_front(width, height):
    """Rounding the short side down can push the resized ratio past 200 although the source is
    within it; the engine's processor would then fail the request, so we refuse it as ours."""
    assert max(width, height) / min(width, height) <= 200
    with pytest.raises(BadAspectRatio, match="resizes to"):
        prepare_image(imgs.png(width, height), ImageParams())


def test_thin_sides_differ_from_transformers_only_on_the_original_size():
    """Documents a known divergence: a side of 14 px or less rounds to 0 in transformers (Python
    rounds 0.5 to even), which then takes the min-pixels branch; qwen-vl-utils (which we follow)
    clamps it to 28 first. transformers gives (560, 28) for 1000x10 and (28, 168) for 14x100.
    The fixed-point test above shows the engine keeps our size, so budgets stay exact."""
    assert smart_resize(1000, 10) == (1008, 28)
    assert smart_resize(14, 100) == (28, 112)
