"""The end-to-end benchmark's settings, and what they mean for every process it starts.

Apart from `e2e.py` so that the peers (the worker passes, the single and the N raw engines)
read one definition of the settings without importing the driver that starts them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import OUT, ROOT


@dataclass
class Options:
    model: str = "tiny"
    images: int = 1000
    videos: int = 100
    max_tokens: int = 64
    load_format: str = "auto"
    out: Path = OUT / "e2e.json"
    passes: tuple[str, ...] = ("cold", "warm")
    skip_naive: bool = False
    skip_raw: bool = False
    only_raw_engines: bool = False
    raw_repeats: int = 3
    naive_images: int = 100
    naive_videos: int = 10
    image_size: int = 448
    video_seconds: float = 8.0
    video_fps: int = 24
    video_size: int = 448
    ignore_eos: bool = True
    #: Worker processes (`processes` setting): each its own engine, one consumer group; None:
    #: the worker's own choice for this host (one without a GPU: 1).
    processes: int | None = None
    #: Plain `LLM` engines sharing the GPU in the "raw ×N engines" peer; None: `processes` when
    #: above 1 (the fair bar for N worker processes), else none; 0: none.
    raw_engines: int | None = None
    preprocess_workers: int = field(default_factory=lambda: max(1, (os.cpu_count() or 2) - 1))
    max_model_len: int = 8192
    sets: list[str] = field(default_factory=list)
    #: One more cold pass (own empty cache) under py-spy; kept out of the table because the
    #: sampler itself costs CPU (it matters on a 2-core host).
    profile: bool = False
    #: py-spy (non-blocking: the target is never paused) on the measured passes themselves.
    profile_measured: bool = False
    keep: bool = False
    #: Reuse this directory (feature cache included) instead of a new temporary one, so a warm
    #: pass can run in a later invocation than its cold pass (the GPU host's 10-minute calls).
    work_dir: Path | None = None
    #: Take raw, naive and earlier worker passes from this report instead of running them.
    peers_from: Path | None = None
    #: A `bench/peers/serve.py` report (vllm serve, N API servers) to hold the worker against too.
    serve_from: Path | None = None
    timeout_s: float = 1800.0


def child_env(opts: Options) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # No network on the bench hosts: a stray Hub lookup would wait for a timeout, not fail fast.
    if Path(opts.model).exists() or opts.model == "tiny":
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # as the GPU host's vLLM bundle runs
    return env


def resolve_model_path(model: str) -> str:
    from mmworker.app import model_cache_dir
    from mmworker.config import TINY_MODEL
    from mmworker.devkit.tiny_model import ensure_tiny_model

    if model == TINY_MODEL:
        return str(ensure_tiny_model(model_cache_dir()))
    return model
