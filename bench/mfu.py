"""Model FLOP utilisation of the rows of a `bench/e2e.py` report: how far a row is from the card.

    python bench/mfu.py REPORT.json [--config MODEL_DIR/config.json] [--peak-tflops 989.4]

FLOPs per job are counted from the model config (dense forward FLOPs, 2 per multiply-add):
- language model: 2 × (non-embedding parameters) per prompt and output token, plus causal
  attention (4 × layers × hidden × context per token: QKᵀ and AV), plus the tied LM head
  (2 × hidden × vocab) once per output token and once for the last prompt token;
- vision encoder: 2 × (block parameters) per patch (4 patches per visual token: 2×2 merge), the
  patch embedding, the merger per visual token, and attention over a 112 px window (64 patches)
  in windowed blocks or one frame pair's patches in full-attention blocks.
Rows served partly from caches (raw hot, worker warm) get no figure: their FLOPs were not spent.
The H200's dense bf16 peak is 989.4 TFLOP/s (sparsity not counted). Decode is memory-bound, so
even a GPU-bound row stays far below 100 %; the figure is for comparing rows and for the
distance to the card, not a goal of its own.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

H200_BF16_DENSE_TFLOPS = 989.4


def lm_flops(text: dict[str, Any], prompt_tokens: float, output_tokens: float) -> float:
    h, inter, layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    head_dim = h // text["num_attention_heads"]
    kv = text["num_key_value_heads"] * head_dim
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter  # q, o; k, v; gate, up, down
    dense = 2 * layers * per_layer * (prompt_tokens + output_tokens)
    total = prompt_tokens + output_tokens
    attention = 4 * layers * h * (total * total / 2)  # causal: each token sees those before
    head = 2 * h * text["vocab_size"] * (output_tokens + 1)
    return float(dense + attention + head)


def vision_flops(
    vision: dict[str, Any], visual_tokens: float, tokens_per_frame_pair: float
) -> float:
    d, inter, depth = vision["hidden_size"], vision["intermediate_size"], vision["depth"]
    merge = vision["spatial_merge_size"] ** 2
    patches = visual_tokens * merge
    patch_in = vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    block = 4 * d * d + 3 * d * inter  # qkv + proj; gate, up, down
    full = len(vision.get("fullatt_block_indexes", ()))
    window = (vision["window_size"] // vision["patch_size"]) ** 2
    full_seq = tokens_per_frame_pair * merge
    attention = 4 * d * patches * (full * full_seq + (depth - full) * min(window, full_seq))
    merger_in = d * merge
    merger = 2 * (merger_in * merger_in + merger_in * vision["out_hidden_size"]) * visual_tokens
    return float(2 * depth * block * patches + 2 * patch_in * d * patches + attention + merger)


def visual_shape(options: dict[str, Any], kind: str) -> tuple[float, float]:
    """(visual tokens per job, visual tokens per frame pair) of the bench's generated media."""
    if kind == "image":
        side = options["image_size"] // 28
        return float(side * side), float(side * side)
    side = options["video_size"] // 28
    frames = options.get("video_frames", 16)
    return float(frames // 2 * side * side), float(side * side)


def annotate(
    report: dict[str, Any], config: dict[str, Any], peak_tflops: float
) -> list[dict[str, Any]]:
    text, vision = config.get("text_config", config), config["vision_config"]
    rows = []
    for row in report["rows"]:
        kind = row["kind"]
        visual, per_pair = visual_shape(report["options"], kind)
        if row.get("visual_tokens_mean"):
            visual = float(row["visual_tokens_mean"])
        prompt = float(row.get("prompt_tokens_mean") or 0) or visual + 74
        output = row["output_tokens"] / max(1, row["jobs"])
        per_job = lm_flops(text, prompt, output) + vision_flops(vision, visual, per_pair)
        # Hot and warm rows skip work through caches (vLLM's prefix and encoder caches, the
        # encoder store): their FLOPs were not all spent, so no utilisation is claimed for them.
        cached = any(word in row["peer"] for word in ("hot", "warm"))
        mfu = None if cached else per_job * row["jobs_per_s"] / (peak_tflops * 1e12)
        rows.append({**row, "flops_per_job": per_job, "mfu": mfu})
    return rows


def mfu_text(mfu: float | None) -> str:
    return "cached" if mfu is None else f"{100 * mfu:.1f}%"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("report", type=Path)
    p.add_argument("--config", type=Path, help="model config.json (default: the report's model)")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    args = p.parse_args()
    report = json.loads(args.report.read_text())
    config_path = args.config or Path(report["model_path"]) / "config.json"
    rows = annotate(report, json.loads(config_path.read_text()), args.peak_tflops)
    print(f"{'kind':6} {'peer':28} {'jobs/s':>8} {'TFLOP/job':>10} {'MFU':>7}")
    for r in rows:
        print(f"{r['kind']:6} {r['peer']:28} {r['jobs_per_s']:8.2f} "
              f"{r['flops_per_job'] / 1e12:10.2f} {mfu_text(r['mfu']):>7}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
