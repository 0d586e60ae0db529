"""vLLM encoder outputs on local disk: a repeat in a *new* worker process skips the vision encoder.

Why: the feature cache only saves decode and resize (2 ms an image on one core); the expensive
part of a repeat is the vision encoder on the GPU, which vLLM caches only in its own process. On
the H200 (bench/results/e2e-h200-s2-p2-ec.json) repeats went from 66 to 108 images/s with it.

vLLM's encoder-cache connector API (`ec_transfer_config`, role `ec_both`: compute and save what is
missing, load what is there) does the plumbing; its file connector is vLLM's "simple debug
implementation", which writes the final file in place. Here a write goes to a temporary name and
is renamed, so another worker process (or this engine's scheduler) never loads half a tensor, and
a hit refreshes the file's mtime, which the worker's pruning (`mmworker.cache.prune_lru_files`)
treats as recent use. Entries are keyed by vLLM's mm hash, which is our feature key (content +
preprocessing parameters), so a different size or frame rate is a different entry.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import safetensors.torch
from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

#: The file vLLM's connector reads for an mm hash: `<root>/<mm_hash>/encoder_cache.safetensors`.
FILE_NAME = "encoder_cache.safetensors"


class DiskEncoderStore(ECExampleConnector):
    def save_caches(self, encoder_cache: dict[str, Any], mm_hash: str, **kwargs: Any) -> None:
        if not self.is_producer:
            return
        final = self._generate_filename_debug(mm_hash)
        if os.path.exists(final):  # another process stored it meanwhile
            return
        tensors = {"ec_cache": encoder_cache[mm_hash].detach().cpu()}
        tmp = f"{final}.{os.getpid()}.{threading.get_ident()}.tmp"
        safetensors.torch.save_file(tensors, tmp)
        os.replace(tmp, final)

    def has_cache_item(self, identifier: str) -> bool:
        path = os.path.join(self._storage_path, identifier, FILE_NAME)
        try:
            os.utime(path)  # a use: pruning keeps recently used entries
        except FileNotFoundError:
            return False
        return True
