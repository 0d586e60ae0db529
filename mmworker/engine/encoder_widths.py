"""No dummy encode at start-up for the encoder store, which never reads what it measures.

vLLM 0.32 measures the vision encoder's output width at every start of an engine whose
encoder-cache connector may produce (role `ec_both` is one): it encodes one largest-size dummy
item per modality (`measure_encoder_output_widths`, called by the engine core between the
model load and the KV cache). Only connectors that move raw buffers between engines read the
width (vLLM's Mooncake and CPU connectors size their transfers with it); the worker's
`DiskEncoderStore` saves and loads whole tensors and never asks. On a 2-core CPU host the two
dummy encodes of the tiny test model were 10.2 s of a 31.5 s worker start (`mmworker demo`);
on a GPU they are a largest-size video and image through the encoder, which a plain engine
never runs at start-up. vLLM 0.25 has no such measurement: there `skip_for_disk_store` finds
no function to wrap and leaves the core as it is.

Any other connector, or a configuration naming no connector, still gets vLLM's measurement.
The patch is applied where the engine core runs: by the vLLM plugin hook in a worker's spawned
core (`install`, in `vllm.general_plugins`), and by `Engine` (or a shared core's supervisor)
before it starts one, which a forked core inherits: vLLM loads plugins once per process, and a
forked child inherits the "loaded" mark.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from mmworker.lifeline import ENV

log = logging.getLogger(__name__)

#: The worker's connector (`mmworker.engine.encoder_store.DiskEncoderStore`), by the name and
#: module the engine's `ec_transfer_config` gives it.
CONNECTOR = "DiskEncoderStore"
CONNECTOR_MODULE = "mmworker.engine.encoder_store"
_CORE_MODULE = "vllm.v1.engine.core"
_FUNCTION = "measure_encoder_output_widths"
_MARK = "_mmworker_skips_disk_store"


def install() -> None:
    """vLLM plugin hook: in a worker's own processes, once vLLM's engine core module is loaded
    (the core process has it before it loads plugins; other processes measure nothing)."""
    if os.environ.get(ENV) and _CORE_MODULE in sys.modules:
        skip_for_disk_store()


def skip_for_disk_store() -> bool:
    """Make the engine core skip the width measurement where the connector is the worker's
    store; True if this changed it (False: already done, or this vLLM measures elsewhere)."""
    import importlib

    core = importlib.import_module(_CORE_MODULE)
    original = getattr(core, _FUNCTION, None)
    if original is None or getattr(original, _MARK, False):
        return False

    def measure(vllm_config: Any, collective_rpc: Any) -> None:
        ec_config = getattr(vllm_config, "ec_transfer_config", None)
        if (
            ec_config is not None
            and ec_config.ec_connector == CONNECTOR
            and ec_config.ec_connector_module_path == CONNECTOR_MODULE
        ):
            log.debug("encoder output widths not measured: %s reads none", CONNECTOR)
            return
        original(vllm_config, collective_rpc)

    setattr(measure, _MARK, True)
    setattr(core, _FUNCTION, measure)
    return True
