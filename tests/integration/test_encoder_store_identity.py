"""The encoder store on a shared cache directory never serves one model's embeddings to another.

Two tiny models of one architecture and one config.json (seeds 0 and 1: only the weights differ)
take turns on one store root through mmworker's `Engine` with the store on; three engine starts
(about a minute each on a 2-core host) serve every check:

1. A on the empty root: K (the image's feature key) is encoded and stored.
2. B on the same root: K, then the same pixels under two keys nothing had stored (FRESH, FRESH2),
   which B must encode itself. Keyed by content alone, K loaded A's embeddings here.
3. A again: K (in A's own store) and FRESH (which only B had stored).

Seeded sampling at temperature > 0: greedy decoding of the random model repeats one token
whatever the image, while with sampling another model's embeddings change the text (checked
against the content-only keying, where the B-on-A check fails).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from mmworker_preprocess.params import ImageParams, PreparedImage
from mmworker_schemas import GenerationParams

from mmworker.cache import make_key
from mmworker.config import EngineConfig
from mmworker.devkit.tiny_model import build_tiny_model
from mmworker.engine import Engine, EngineItem
from mmworker.engine.encoder_store import FILE_NAME
from mmworker.engine.identity import IDENTITY_FILE
from mmworker.lifeline import ENV
from tests.integration.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.timeout(600),
]

PIXELS = np.random.default_rng(5).integers(0, 256, (84, 112, 3), dtype=np.uint8)
IMAGE = PreparedImage(pixels=PIXELS, original_size=(112, 84))
K = make_key(hashlib.sha256(PIXELS.tobytes()).hexdigest(), ImageParams())
FRESH, FRESH2 = (make_key(hashlib.sha256(s).hexdigest(), ImageParams()) for s in (b"1", b"2"))
#: Two seeded samplings per request: either alone already differed on another model's embeddings.
SAMPLINGS = tuple(
    GenerationParams(max_tokens=32, temperature=0.6, seed=seed, ignore_eos=True) for seed in (1, 2)
)
#: Entry mtimes are set this far back before a run, so a hit (which touches the file) shows.
AGED_S = 3600.0

Captions = tuple[str, ...]


@dataclass(frozen=True)
class Runs:
    root: Path
    model_a: Path
    model_b: Path
    a_first: Captions
    b: dict[str, Captions]
    a_again: dict[str, Captions]
    #: Entries the third run loaded (it refreshed their mtime).
    loaded_by_a_again: set[Path]
    files_after_b: set[Path]
    files_at_end: set[Path]


def _entries(root: Path) -> set[Path]:
    return set(root.rglob(FILE_NAME))


def _age(paths: set[Path]) -> dict[Path, float]:
    old = time.time() - AGED_S
    for path in paths:
        os.utime(path, (old, old))
    return {path: path.stat().st_mtime for path in paths}


def _captions(model: Path, store: Path, keys: list[str]) -> dict[str, Captions]:
    async def run() -> dict[str, Captions]:
        cfg = EngineConfig(
            model=str(model),
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            limit_mm_per_prompt={"image": 1},
        )
        engine = Engine(cfg, str(model), encoder_store=store)
        engine.start()
        try:
            out = {}
            for key in keys:
                texts = []
                for i, params in enumerate(SAMPLINGS):
                    item = EngineItem(prepared=IMAGE, uuid=key)
                    result = await engine.generate(f"{key[:8]}-{i}", "Caption.", [item], params)
                    assert result.output_tokens == params.max_tokens
                    texts.append(result.text)
                out[key] = tuple(texts)
            return out
        finally:
            engine.shutdown()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Runs:
    """The engines start as a worker's do: with the lifeline's variable set, their spawned cores
    load the worker's plugins in full (the store's start-up skips included, which saves the
    width measurement's dummy encodes at each of the three starts)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENV, str(os.getpid()))
        return _run_all(tmp_path_factory, tiny_model_dir)


def _run_all(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Runs:
    work = tmp_path_factory.mktemp("identity")
    model_b = build_tiny_model(work / "tiny-b", seed=1)
    assert (model_b / "config.json").read_bytes() == (tiny_model_dir / "config.json").read_bytes()
    root = work / "encoder"
    root.mkdir()

    a_first = _captions(tiny_model_dir, root, [K])[K]
    b = _captions(model_b, root, [K, FRESH, FRESH2])
    files_after_b = _entries(root)
    aged = _age(files_after_b)
    a_again = _captions(tiny_model_dir, root, [K, FRESH])
    return Runs(
        root=root,
        model_a=tiny_model_dir,
        model_b=model_b,
        a_first=a_first,
        b=b,
        a_again=a_again,
        loaded_by_a_again={path for path, mtime in aged.items() if path.stat().st_mtime > mtime},
        files_after_b=files_after_b,
        files_at_end=_entries(root),
    )


def _store_of(runs: Runs, model: Path) -> Path:
    """The identity directory whose identity.json names `model`."""
    found = [
        label.parent
        for label in runs.root.glob(f"*/{IDENTITY_FILE}")
        if json.loads(label.read_text())["model"] == str(model.resolve())
    ]
    assert len(found) == 1, f"one identity directory of {runs.root} should name {model}"
    return found[0]


def test_control_b_captions_the_same_pixels_the_same_way(runs: Runs) -> None:
    """Determinism control, true with or without identity keying: two keys that nothing had
    stored, so B encoded the pixels itself each time."""
    assert all(text.strip() for text in runs.b[FRESH])
    assert runs.b[FRESH2] == runs.b[FRESH]


def test_b_on_the_directory_a_populated_gets_exactly_its_own_caption(runs: Runs) -> None:
    """Keyed by content alone, B loaded A's embeddings for K and captioned differently."""
    assert runs.b[K] == runs.b[FRESH]


def test_the_store_of_a_still_serves_a(runs: Runs) -> None:
    """A's entry for K survived B's run and, loaded from disk, gives the caption A computed:
    also the control that a round trip through the store is exact."""
    assert runs.a_again[K] == runs.a_first
    assert runs.loaded_by_a_again == {_store_of(runs, runs.model_a) / K / FILE_NAME}


def test_a_does_not_load_what_only_b_stored(runs: Runs) -> None:
    """The same claim the other way round: keyed by content alone, A loaded B's FRESH here."""
    assert runs.a_again[FRESH] == runs.a_first


def test_each_model_has_its_own_identity_directory(runs: Runs) -> None:
    store_a, store_b = _store_of(runs, runs.model_a), _store_of(runs, runs.model_b)
    assert store_a != store_b and store_a.parent == store_b.parent == runs.root
    assert runs.files_after_b == {
        store_a / K / FILE_NAME,
        store_b / K / FILE_NAME,
        store_b / FRESH / FILE_NAME,
        store_b / FRESH2 / FILE_NAME,
    }
    assert runs.files_at_end == runs.files_after_b | {store_a / FRESH / FILE_NAME}
    label = json.loads((store_b / IDENTITY_FILE).read_text())
    assert label["digest"] == store_b.name
    assert label["dtype"] != "auto"  # what vLLM resolved on this host
    assert label["load_format"] == "auto" and label["vllm_version"]
    assert [w["name"] for w in label["weights"]] == ["model.safetensors"]
