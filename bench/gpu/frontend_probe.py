"""Per-request CPU cost of vLLM's front end, without starting an engine (issue 11's diagnosis).

Why: on the H200 the worker's two processes finish 1,000 cold image jobs almost together (first
to last result in under a second, p50 latency close to the wall time). With every job handed to
`AsyncLLM.generate` at once, each request's `process_inputs` runs synchronously on the event
loop before its first await, so the loop's first round is every request's input processing and
the output handler waits behind it. If so, the wall time is about requests x per-request
front-end CPU, and this script measures that cost directly, on the same host and vLLM release:
`InputProcessor.process_inputs` plus the msgpack encoding `add_request_async` does, for the
worker's raw-pixel path and for vLLM's own processor path (what the peers run), with unique
uuids so vLLM's caches stay cold. A cProfile table shows where the raw-pixel path's time goes.

    python3 bench/gpu/frontend_probe.py --model /tmp/qwen2.5-vl-3b-dummy --out /tmp/probe.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def build(model: str, pixels: bool, sets: list[str]) -> tuple[Any, Any, Any]:
    """The worker's engine arguments → VllmConfig → renderer + InputProcessor, as AsyncLLM
    builds them, and the worker's Engine for its prompt."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.plugins import load_general_plugins
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.input_processor import InputProcessor

    from bench.peers.raw import load_worker_config
    from mmworker.engine import Engine

    load_general_plugins()
    args = ["run", "--model", model, "--set", 'engine.load_format="dummy"']
    for s in sets:
        args += ["--set", s]
    cfg = load_worker_config(args)
    engine = Engine(cfg.engine.model_copy(update={"pixels_on_engine": pixels}), model)
    kwargs = engine.engine_kwargs()
    vllm_config = AsyncEngineArgs(**kwargs).create_engine_config(UsageContext.LLM_CLASS)
    try:
        from vllm.renderers import renderer_from_config

        renderer = renderer_from_config(vllm_config)
        processor = InputProcessor(vllm_config, renderer)
    except ImportError:
        processor = InputProcessor(vllm_config)
    from transformers import AutoTokenizer

    engine._tokenizer = AutoTokenizer.from_pretrained(model)
    engine._raw_pixels = pixels
    return engine, processor, vllm_config


def media(kind: str, n: int, seed: int) -> list[Any]:
    from mmworker_preprocess.params import PreparedImage, PreparedVideo

    rng = np.random.default_rng(seed)
    out: list[Any] = []
    for _ in range(n):
        if kind == "image":
            px = rng.integers(0, 256, (448, 448, 3), dtype=np.uint8)
            out.append(PreparedImage(pixels=px, original_size=(448, 448)))
        else:
            frames = rng.integers(0, 256, (16, 448, 448, 3), dtype=np.uint8)
            out.append(
                PreparedVideo(
                    frames=frames,
                    original_size=(448, 448),
                    timestamps=tuple(i * 0.5 for i in range(16)),
                    duration_s=8.0,
                    source_fps=24.0,
                    total_num_frames=192,
                )
            )
    return out


def run(engine: Any, processor: Any, items: list[Any], profile: bool) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.v1.serial_utils import MsgpackEncoder

    from mmworker.engine import EngineItem, _mm_data, _mm_uuids

    enc = MsgpackEncoder()
    sampling = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    proc_s: list[float] = []
    enc_s: list[float] = []
    prof = cProfile.Profile() if profile else None
    for prepared in items:
        item = EngineItem(prepared=prepared, uuid=uuid.uuid4().hex)
        kinds = (item.kind,)
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        prompt = {
            "prompt": engine.prompt_text("Describe this.", kinds),
            "multi_modal_data": _mm_data([item], engine.raw_pixels),
            "multi_modal_uuids": _mm_uuids([item]),
        }
        req = processor.process_inputs(
            uuid.uuid4().hex, prompt, sampling, supported_tasks=("generate",)
        )
        t1 = time.perf_counter()
        enc.encode(req)
        t2 = time.perf_counter()
        if prof:
            prof.disable()
        proc_s.append(t1 - t0)
        enc_s.append(t2 - t1)
    out: dict[str, Any] = {
        "n": len(items),
        "process_ms_median": round(1e3 * statistics.median(proc_s[2:]), 3),
        "process_ms_mean": round(1e3 * statistics.mean(proc_s[2:]), 3),
        "encode_ms_median": round(1e3 * statistics.median(enc_s[2:]), 3),
    }
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        buf2 = io.StringIO()
        pstats.Stats(prof, stream=buf2).sort_stats("cumulative").print_stats(35)
        out["profile_tottime"] = buf.getvalue()[-6000:]
        out["profile_cumulative"] = buf2.getvalue()[-7000:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--videos", type=int, default=20)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--out", type=Path)
    opts = ap.parse_args()
    report: dict[str, Any] = {}
    for pixels in (True, False):
        engine, processor, _ = build(opts.model, pixels, opts.sets)
        path = "pixels" if pixels else "processor"
        for kind, n in (("image", opts.images), ("video", opts.videos)):
            items = media(kind, n, seed=1 if pixels else 2)
            res = run(engine, processor, items, profile=pixels)
            report[f"{path}-{kind}"] = res
            print(
                f"{path:9s} {kind}: process_inputs median {res['process_ms_median']} ms, "
                f"mean {res['process_ms_mean']} ms; msgpack {res['encode_ms_median']} ms",
                flush=True,
            )
            if pixels:
                print(res["profile_tottime"][-3500:])
    if opts.out:
        opts.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
