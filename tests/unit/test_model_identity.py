"""Model identity digests (the encoder store's per-model directory), and pruning across them."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from mmworker.cache import prune_lru_files
from mmworker.engine.identity import (
    DIGEST_CHARS,
    IDENTITY_FILE,
    ModelIdentity,
    ModelIdentityError,
    identify_model,
    write_identity_file,
)

BASE: dict[str, Any] = {
    "revision": None,
    "dtype": "bfloat16",
    "quantization": None,
    "load_format": "auto",
    "vllm_version": "0.32.0",
}
COMMIT_1, COMMIT_2 = "1" * 40, "2" * 40


def _model(path: Path, config: dict[str, Any] | None = None, weights: bytes = b"w" * 64) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config or {"hidden_size": 128}))
    (path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14}))
    (path / "tokenizer.json").write_text("{}")
    (path / "model.safetensors").write_bytes(weights)
    return path


def _digest(model: Path | str, **changes: Any) -> str:
    return identify_model(str(model), **{**BASE, **changes}).digest


def test_equal_inputs_give_equal_digests(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    first, second = (identify_model(str(model), **BASE) for _ in range(2))
    assert first == second
    assert first.digest == second.digest
    assert len(first.digest) == DIGEST_CHARS and int(first.digest, 16) >= 0


@pytest.mark.parametrize(
    "change",
    [
        {"revision": "v2"},
        {"dtype": "float16"},
        {"quantization": "awq"},
        {"load_format": "dummy"},
        {"vllm_version": "0.33.0"},
        {"overrides": {"hf_overrides": {"vision_config": {"depth": 2}}}},
        {"overrides": {"mm_processor_kwargs": {"max_pixels": 50176}}},
    ],
    ids=lambda change: next(iter(change)),
)
def test_each_engine_setting_changes_the_digest(tmp_path: Path, change: dict[str, Any]) -> None:
    model = _model(tmp_path / "m")
    assert _digest(model, **change) != _digest(model)


def test_config_content_changes_the_digest(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    before = _digest(model)
    (model / "config.json").write_text(json.dumps({"hidden_size": 256}))
    assert _digest(model) != before


def test_processor_config_changes_the_digest(tmp_path: Path) -> None:
    """Normalisation and patch size live there and change the encoder's output too."""
    model = _model(tmp_path / "m")
    before = _digest(model)
    (model / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16}))
    assert _digest(model) != before


def test_rewritten_weights_change_the_digest_even_at_the_same_size(tmp_path: Path) -> None:
    """A fine-tune written over the directory: same config, same file names and sizes."""
    model = _model(tmp_path / "m")
    before = _digest(model)
    weights = model / "model.safetensors"
    st = weights.stat()
    weights.write_bytes(b"v" * 64)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert _digest(model) != before


def test_files_that_do_not_shape_the_model_leave_the_digest_alone(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    before = _digest(model)
    (model / "tokenizer.json").write_text('{"changed": true}')
    (model / "README.md").write_text("notes")
    assert _digest(model) == before


def test_same_config_at_another_path_is_another_model(tmp_path: Path) -> None:
    """Two builds of one architecture (the tiny model with seeds 0 and 1) share config.json."""
    a = _model(tmp_path / "a", weights=b"a" * 64)
    b = _model(tmp_path / "b", weights=b"b" * 64)
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    assert _digest(a) != _digest(b)


def test_a_relative_path_is_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    assert identify_model("m", **BASE).model == str(model.resolve())
    assert _digest("m") == _digest(model)


def _hub_snapshot(cache: Path, repo: str, commit: str, config: dict[str, Any]) -> None:
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(commit)


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_a_hub_model_is_pinned_by_its_snapshot_commit(hub_cache: Path) -> None:
    _hub_snapshot(hub_cache, "org/vl", COMMIT_1, {"hidden_size": 128})
    first = identify_model("org/vl", **BASE)
    assert first.commit == COMMIT_1 and first.model == "org/vl"
    # A new upload to main, even with an identical config.json, is another model.
    _hub_snapshot(hub_cache, "org/vl", COMMIT_2, {"hidden_size": 128})
    second = identify_model("org/vl", **BASE)
    assert second.commit == COMMIT_2
    assert second.digest != first.digest
    assert identify_model("org/vl", **{**BASE, "revision": COMMIT_1}).commit == COMMIT_1


def test_a_hub_model_missing_from_the_cache_has_no_identity(hub_cache: Path) -> None:
    with pytest.raises(ModelIdentityError, match="not in the Hub cache"):
        identify_model("org/absent", **BASE)


def test_identity_file_names_the_model_and_its_digest(tmp_path: Path) -> None:
    identity = identify_model(str(_model(tmp_path / "m")), **BASE)
    store = tmp_path / "encoder" / identity.digest
    path = write_identity_file(store, identity)
    label = json.loads(path.read_text())
    assert path == store / IDENTITY_FILE
    assert label["digest"] == identity.digest
    assert label["model"] == str((tmp_path / "m").resolve())
    assert label["dtype"] == "bfloat16" and label["vllm_version"] == "0.32.0"
    assert [w["name"] for w in label["weights"]] == ["model.safetensors"]
    assert sorted(p.name for p in store.iterdir()) == [IDENTITY_FILE]  # no temp file left


def test_pruning_spans_every_identity_directory_of_the_root(tmp_path: Path) -> None:
    """LRU over the whole encoder root: one budget, whichever model an entry belongs to."""
    root = tmp_path / "encoder"
    now = time.time()
    identities = [
        ModelIdentity(f"/models/{name}", None, None, (), (), "bfloat16", None, "auto", "0.32.0")
        for name in ("a", "b")
    ]
    store_a, store_b = (root / identity.digest for identity in identities)
    for identity, store in zip(identities, (store_a, store_b), strict=True):
        label = write_identity_file(store, identity)
        os.utime(label, (now - 100, now - 100))  # refreshed by the store's latest write
    ages = {
        store_a / "a-old": 5000,
        store_b / "b-old": 4000,
        root / ("f" * 64): 3000,  # an entry of the old layout, before identity keying
        store_a / "a-new": 50,
        store_b / "b-hot": 10,
    }
    for entry, age in ages.items():
        entry.mkdir(parents=True)
        f = entry / "encoder_cache.safetensors"
        f.write_bytes(b"x" * 1000)
        os.utime(f, (now - age, now - age))

    freed = prune_lru_files(root, max_bytes=2500, keep_recent_s=300)

    assert freed == 3000
    assert sorted(p.name for p in store_a.iterdir()) == ["a-new", IDENTITY_FILE]
    assert sorted(p.name for p in store_b.iterdir()) == ["b-hot", IDENTITY_FILE]
    assert sorted(p.name for p in root.iterdir()) == sorted([store_a.name, store_b.name])


def test_pruning_a_whole_identity_leaves_the_others(tmp_path: Path) -> None:
    """A model no longer served ages out entirely, its label included; the active one stays."""
    root = tmp_path / "encoder"
    now = time.time()
    gone, kept = root / ("0" * DIGEST_CHARS), root / ("1" * DIGEST_CHARS)
    for store, age in ((gone, 5000), (kept, 10)):
        (store / "k").mkdir(parents=True)
        for f in (store / IDENTITY_FILE, store / "k" / "encoder_cache.safetensors"):
            f.write_bytes(b"x" * 1000)
            os.utime(f, (now - age, now - age))

    assert prune_lru_files(root, max_bytes=2000, keep_recent_s=300) == 2000
    assert not [p for p in gone.rglob("*") if p.is_file()]
    # Pruning removes the emptied entry directory, not the identity directory above it: an
    # empty directory per model ever served, which the next write of that model reuses.
    assert list(gone.iterdir()) == []
    assert sorted(str(p.relative_to(kept)) for p in kept.rglob("*")) == [
        IDENTITY_FILE,
        "k",
        "k/encoder_cache.safetensors",
    ]
