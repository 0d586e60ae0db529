"""Which model produced a persisted artefact, reduced to a digest that names its directory.

Why: the encoder store is keyed by content + preprocessing parameters (vLLM's mm hash, our
feature key), which says nothing about the model. A new revision, a fine-tune, another dtype or
quantization, or a second model sharing the volume would otherwise be served the first model's
vision embeddings: wrong captions, silently, or a shape crash. Every model-dependent artefact
therefore lives under `<root>/<digest>/`, and a model whose identity differs in anything that can
change the encoder's output never reads another's entries.

The identity is cheap to establish (no weights are hashed): the model id or resolved path, the
revision, sha256 of the small JSON files that shape the model and its pixel normalisation, and
for the weights either the Hub snapshot's commit (which pins every file) or, for a local
directory, each weight file's name, size and mtime. A rewritten file changes its mtime; a copy
that does not keep mtimes only costs a cold store, never a wrong hit. dtype, quantization and
load_format are the engine's resolved values, and vLLM's version is included because the
tensor layout it hands the connector could change between releases.

This module does not import vLLM, so the digest can be computed and tested without an engine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mmworker.errors import WorkerError

#: Written next to each identity's entries, for people: the digest alone names nothing.
IDENTITY_FILE = "identity.json"
#: Hashed into every digest so a future change of what the identity holds cannot collide with
#: digests of this layout.
_DOMAIN = "mmworker-model-identity/1"
#: 128 bits: collision-free in practice, and shorter than vLLM's 64-hex mm hashes, so an
#: identity directory can never be mistaken for an entry of the old, unkeyed layout.
DIGEST_CHARS = 32
#: Files whose content changes the encoder's output without necessarily changing a weight file:
#: the architecture and the processors' normalisation, patch and merge sizes.
CONFIG_FILES = (
    "config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")


class ModelIdentityError(WorkerError):
    """The model cannot be identified, so nothing may be persisted or served on its behalf."""


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    #: Hub id as given, or the absolute path of a local model.
    model: str
    revision: str | None
    #: Hub snapshot commit (pins every file); None for a local model.
    commit: str | None
    #: (file name, sha256) of each of CONFIG_FILES present.
    configs: tuple[tuple[str, str], ...]
    #: (file name, size, mtime in ns) of each weight file of a local model.
    weights: tuple[tuple[str, int, int], ...]
    dtype: str
    quantization: str | None
    load_format: str
    vllm_version: str
    #: Canonical JSON of engine arguments that alter the model or its processor (hf_overrides,
    #: mm_processor_kwargs, ...); "{}" when none are set.
    overrides: str = "{}"

    def fields(self) -> dict[str, object]:
        return {
            "model": self.model,
            "revision": self.revision,
            "commit": self.commit,
            "configs": dict(self.configs),
            "weights": [{"name": n, "size": s, "mtime_ns": m} for n, s, m in self.weights],
            "dtype": self.dtype,
            "quantization": self.quantization,
            "load_format": self.load_format,
            "vllm_version": self.vllm_version,
            "overrides": json.loads(self.overrides),
        }

    @property
    def digest(self) -> str:
        canonical = _canonical({"domain": _DOMAIN, **self.fields()})
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:DIGEST_CHARS]


def identify_model(
    model: str,
    *,
    revision: str | None,
    dtype: str,
    quantization: str | None,
    load_format: str,
    vllm_version: str,
    overrides: Mapping[str, object] | None = None,
) -> ModelIdentity:
    """Read what identifies `model` from disk (a local path, or the Hub cache for an id).

    Raises ModelIdentityError when a Hub model's snapshot is not in the local cache and no
    commit was given: "main" moves, so the id alone could name different weights tomorrow.
    """
    local = Path(model)
    if local.exists():
        local = local.resolve()
        name, commit = str(local), None
        configs = _config_hashes(local if local.is_dir() else local.parent)
        weights = _weight_files(local)
    else:
        snapshot = _hub_snapshot(model, revision)
        name, commit = model, snapshot.name
        # Only config.json: the engine fetched it before any connector exists, while the other
        # files may arrive later; the commit already pins them.
        configs = (("config.json", _sha256_file(snapshot / "config.json")),)
        weights = ()
    return ModelIdentity(
        model=name,
        revision=revision,
        commit=commit,
        configs=configs,
        weights=weights,
        dtype=dtype,
        quantization=quantization,
        load_format=load_format,
        vllm_version=vllm_version,
        overrides=_canonical(dict(overrides or {})),
    )


def write_identity_file(directory: Path, identity: ModelIdentity) -> Path:
    """Atomically (re)write `directory/identity.json`; other processes may be reading it."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / IDENTITY_FILE
    body = json.dumps({"digest": identity.digest, **identity.fields()}, indent=2, sort_keys=True)
    tmp = directory / f".{IDENTITY_FILE}.{uuid.uuid4().hex}.tmp"
    try:
        tmp.write_text(body + "\n", encoding="utf-8")
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):  # renamed: nothing left to clean up
            tmp.unlink()
    return final


def _canonical(value: object) -> str:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=_stable_repr
    )


def _stable_repr(value: object) -> object:
    """JSON for engine arguments that are not plain data; never an address, which would give
    each process (scheduler, workers) a different digest for the same engine."""
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    to_dict = getattr(value, "model_dump", None) or getattr(value, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    text = repr(value)
    return type(value).__qualname__ if " at 0x" in text else text


def _config_hashes(directory: Path) -> tuple[tuple[str, str], ...]:
    found = []
    for name in CONFIG_FILES:
        path = directory / name
        if path.is_file():
            found.append((name, _sha256_file(path)))
    return tuple(found)


def _weight_files(model: Path) -> tuple[tuple[str, int, int], ...]:
    """Names, sizes and mtimes: changes with any re-download, conversion or fine-tune written
    over the directory, at the cost of a few stat calls instead of reading gigabytes."""
    candidates = [model] if model.is_file() else sorted(model.iterdir())
    found = []
    for path in candidates:
        name = path.name
        if name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json"):
            st = path.stat()
            found.append((name, st.st_size, st.st_mtime_ns))
    return tuple(found)


def _hub_snapshot(model: str, revision: str | None) -> Path:
    """The cached snapshot directory (`.../snapshots/<commit>`) that config.json resolves to."""
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(model, "config.json", revision=revision)
    except ValueError as exc:  # not a valid repo id, and not an existing path either
        raise ModelIdentityError(f"model {model!r} is neither a local path nor a Hub id") from exc
    if not isinstance(cached, str):
        raise ModelIdentityError(
            f"config.json of {model!r} (revision {revision or 'main'}) is not in the Hub cache"
        )
    snapshot = Path(cached).parent
    if snapshot.parent.name != "snapshots" or not _COMMIT_RE.fullmatch(snapshot.name):
        raise ModelIdentityError(f"{cached} is not inside a Hub snapshot directory")
    return snapshot


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
