"""Keep the KV cache's size out of vLLM's compile-cache key, so that a warm start is warm.

A worker that runs several engines on one GPU starts them one after another the first time,
each sized by `gpu_memory_utilization`, and from then on together, each given the KV cache it
found (`kv_cache_memory_bytes`, see `mmworker.processes`). vLLM keys its torch.compile cache on
a hash of the engine's settings that leaves out runtime knobs such as `gpu_memory_utilization`
and the block counts; vLLM 0.25 does not leave out `kv_cache_memory_bytes` (0.32 does). So the
first start together compiled the language model and the vision encoder again, as on an empty
cache: 21.9 s of a 49.7 s "warm" start on an H100 (session 29), where a plain engine was ready
in 29.6 s; with this key, 35.1 s against 29.5 s on another H100 (session 31), compiling nothing.
The size only decides how many blocks are allocated, never a graph's shapes.

The hash is taken in the engine core. `Engine` applies this before it starts one, which a forked
core inherits; a spawned core (and its executors) gets it from the vLLM plugin (`install`, in
`vllm.general_plugins`), which acts only in a worker's processes. Either way it changes nothing
where the running vLLM's hash does not depend on the size (it asks two configs that differ only
in it)."""

from __future__ import annotations

import logging
import os
from typing import Any

from mmworker.lifeline import ENV

log = logging.getLogger(__name__)

FIELD = "kv_cache_memory_bytes"
_MARK = "_mmworker_ignores_kv_size"


def install() -> None:
    """vLLM plugin hook: in a worker's own processes (the front end and what it starts)."""
    if not os.environ.get(ENV):
        return
    from vllm.config.cache import CacheConfig

    if ignore_kv_size(CacheConfig):
        log.debug("vLLM's compile-cache key leaves out %s from now on", FIELD)


def keyed_on_kv_size(config_class: Any) -> bool:
    """Whether two configs that differ only in the KV cache's size hash apart."""
    sized = config_class()
    object.__setattr__(sized, FIELD, 1 << 30)
    return bool(config_class().compute_hash() != sized.compute_hash())


def ignore_kv_size(config_class: Any) -> bool:
    """Make `config_class.compute_hash` hash a config as if no size were set; True if this
    changed it (False: already patched, or the hash never depended on the size)."""
    if getattr(config_class.compute_hash, _MARK, False) or not keyed_on_kv_size(config_class):
        return False
    original = config_class.compute_hash

    def compute_hash(self: Any) -> str:
        size = getattr(self, FIELD)
        if size is None:
            return str(original(self))
        # The config is a frozen-looking dataclass shared by the engine: the field is set back
        # at once, and the hash is taken once, while the engine starts, on one thread.
        object.__setattr__(self, FIELD, None)
        try:
            return str(original(self))
        finally:
            object.__setattr__(self, FIELD, size)

    setattr(compute_hash, _MARK, True)
    config_class.compute_hash = compute_hash
    return True
