"""Where one plain engine's GPU time goes on a batch of clips (or images): issue 33 asks for the
worker's MFU or "the profile that says what holds it below". The video pass is bound by the GPU
on both sides (44 % MFU for the two-engine peer, 47 % for the worker on an H100, session 28),
so a gain there has to come from the kernels, and this says which ones take the time.

One `LLM` with the worker's engine arguments (`bench/peers/raw.py`, the peers' processor path),
the inputs prepared beforehand, one warm-up request, then one `LLM.generate` of the batch under
vLLM's torch profiler (`profiler_config`: no stacks, no shapes, to keep the trace small). The
summary is read from the Chrome trace the engine core writes, so it does not depend on the
table format of one vLLM version: device time per kernel, grouped into families by name (GEMM,
attention, the vision encoder's convolution, normalisation, ...), the share of the profiled wall
the GPU was busy (kernels merged where they overlap), and the top kernels. On a CPU host there
are no kernels: the CPU operators stand in, which is what the CPU smoke run checks.

    python3 bench/kernel_profile.py --model /tmp/qwen3b --load-format dummy --videos 24
    .venv/bin/python bench/kernel_profile.py --model tiny --videos 2 --max-tokens 8   # CPU
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "schemas"), str(ROOT / "preprocess")]

from bench.common import OUT, add_set_option, environment, make_images, make_videos  # noqa: E402
from bench.e2e_config import resolve_model_path  # noqa: E402
from bench.peers import raw  # noqa: E402

#: Kernel families by name, first match wins; the rest is "other".
FAMILIES = [
    ("attention", r"flash|fmha|attn|attention|softmax"),
    ("quantize (fp8)", r"quant"),
    # Inductor names a fused kernel after the ops it took in: the ones that scale activations to
    # FP8 for vLLM's scaled_mm carry its name, but are Triton, not the GEMM (session 29's first
    # FP8 profile counted 349 ms of them as GEMM).
    ("quantize (fp8)", r"^triton_.*scaled_mm"),
    ("gemm", r"gemm|cutlass|cublas|sm90_xmma|nvjet|matmul|_mm_|scaled_mm"),
    ("conv (patch embed)", r"conv|implicit_gemm"),
    ("norm", r"norm"),
    ("activation", r"silu|gelu|act_and_mul|quick_gelu"),
    ("rotary", r"rotary|rope"),
    ("sampling", r"sampl|topk|argmax|logits|penalt"),
    ("copy/cat/index", r"copy|cat|index|gather|scatter|fill|memcpy|memset|elementwise"),
    ("triton (compiled)", r"^triton_"),
]


def family(name: str) -> str:
    low = name.lower()
    for label, pattern in FAMILIES:
        if re.search(pattern, low):
            return label
    return "other"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Device time with overlapping kernels (streams) counted once."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def summarise(trace: Path, top: int = 25) -> dict[str, Any]:
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in complete if e.get("cat") == "kernel"]
    what = "kernel" if kernels else "cpu_op"
    chosen = kernels or [e for e in complete if e.get("cat") == "cpu_op"]
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in complete]
    wall = (max(s for _, s in spans) - min(s for s, _ in spans)) if spans else 0.0
    by_name: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for e in chosen:
        by_name[e["name"]] += float(e["dur"])
        counts[e["name"]] += 1
    by_family: dict[str, float] = defaultdict(float)
    for name, dur in by_name.items():
        by_family[family(name)] += dur
    summed = sum(by_name.values()) or 1.0
    busy = busy_us([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in chosen])
    return {
        "trace": trace.name,
        "what": what,
        "events": len(chosen),
        "wall_ms": round(wall / 1000, 1),
        "busy_ms": round(busy / 1000, 1),
        "busy_fraction": round(busy / wall, 3) if wall else None,
        "families": {
            k: {"ms": round(v / 1000, 1), "share": round(v / summed, 3)}
            for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])
        },
        "top": [
            row(n, v, counts[n], summed)
            for n, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
        ],
    }


def row(name: str, us: float, calls: int, summed: float) -> dict[str, Any]:
    return {"name": name[:160], "ms": round(us / 1000, 2), "calls": calls,
            "share": round(us / summed, 3), "family": family(name)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--load-format", default=None)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--videos", type=int, default=24)
    p.add_argument("--images", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out-dir", type=Path, default=OUT / "kernel-profile")
    add_set_option(p, "worker setting the engine follows (as bench/e2e.py's peers do)")
    ns = p.parse_args(argv)

    model_path = resolve_model_path(ns.model)
    sets = [f"engine.max_model_len={ns.max_model_len}", *ns.sets]
    if ns.load_format:
        sets.append(f"engine.load_format={json.dumps(ns.load_format)}")
    worker_args = ["run", "--model", model_path]
    for item in sets:
        worker_args += ["--set", item]
    cfg = raw.load_worker_config(worker_args)
    images = make_images(ns.images, 448) if ns.images else []
    videos = make_videos(ns.videos, 8.0, 24, 448) if ns.videos else []
    prepared, facts = raw.prepare_all(cfg, images, videos)

    from transformers import AutoTokenizer
    from vllm import LLM

    trace_dir = (ns.out_dir / "traces").resolve()
    trace_dir.mkdir(parents=True, exist_ok=True)
    for old in trace_dir.iterdir():  # one run's traces only
        old.unlink()
    kwargs = raw.engine_kwargs(cfg, model_path)
    kwargs["profiler_config"] = {
        "profiler": "torch",
        "torch_profiler_dir": str(trace_dir),
        "torch_profiler_with_stack": False,
        "torch_profiler_record_shapes": False,
    }
    llm = LLM(**kwargs)
    tokenizer = AutoTokenizer.from_pretrained(model_path, revision=cfg.engine.model_revision)
    sampling = raw.sampling_params(ns.max_tokens, True)
    raw.warm_up(llm, tokenizer, sampling, prepared)
    report: dict[str, Any] = {"environment": environment(), "engine_kwargs": kwargs,
                              "preprocess": facts, "kinds": {}}  # fmt: skip
    seen: set[str] = set()  # traces of the kinds profiled before
    for kind in ("video", "image"):
        if not prepared[kind]:
            continue
        prompts = raw.prompts(tokenizer, prepared, kind, "#profiled")
        llm.start_profile()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        wall = time.perf_counter() - t0
        llm.stop_profile()
        report["kinds"][kind] = {"jobs": len(outs), "wall_s": round(wall, 2),
                                 "jobs_per_s": round(len(outs) / wall, 2)}  # fmt: skip
        # The core writes its trace as the profiler stops: wait for this kind's.
        deadline = time.monotonic() + 300
        new: list[Path] = []
        while not new and time.monotonic() < deadline:
            new = sorted(t for t in trace_dir.glob("*.json*") if t.name not in seen)
            time.sleep(1)
        seen.update(t.name for t in new)
        report["kinds"][kind]["traces"] = [t.name for t in new]
        report["kinds"][kind]["profiles"] = [summarise(t) for t in new]
    raw.shutdown(llm)
    out = ns.out_dir / "kernel-profile.json"
    out.write_text(json.dumps(report, indent=1, default=str))
    for kind, doc in report["kinds"].items():
        print(f"\n{kind}: {doc['jobs']} jobs in {doc['wall_s']} s ({doc['jobs_per_s']}/s)")
        for prof in doc["profiles"]:
            busy = f"busy {prof['busy_ms']} of {prof['wall_ms']} ms ({prof['busy_fraction']})"
            print(f"  {prof['trace']}: {prof['events']} {prof['what']} events, {busy}")
            for fam, v in prof["families"].items():
                print(f"    {fam:<20} {v['ms']:>10.1f} ms  {100 * v['share']:5.1f} %")
            for row in prof["top"][:10]:
                print(f"      {row['ms']:>9.1f} ms {row['calls']:>6} × {row['name'][:90]}")
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
