"""bench/kernel_profile.py's summary of a Chrome trace, the format torch's profiler writes for
vLLM's engine core: device time per kernel and family, and busy time with overlapping kernels
(two streams) counted once."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from bench.kernel_profile import busy_us, family, summarise


def _trace(path: Path, events: list[dict[str, object]]) -> Path:
    with gzip.open(path, "wt") as f:
        json.dump({"schemaVersion": 1, "traceEvents": events}, f)
    return path


def test_kernels_are_summed_by_name_and_family_and_overlaps_count_once(tmp_path: Path) -> None:
    gemm = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "kernel", "name": gemm, "ts": 100, "dur": 300},
        {"ph": "X", "cat": "kernel", "name": gemm, "ts": 500, "dur": 300},
        {"ph": "X", "cat": "kernel", "name": "flash_fwd_kernel", "ts": 700, "dur": 200},  # overlaps
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 950},  # not a complete event
    ]
    s = summarise(_trace(tmp_path / "rank0.pt.trace.json.gz", events))
    assert s["what"] == "kernel" and s["events"] == 3
    assert s["wall_ms"] == 1.0  # every complete event, CPU ones included
    assert s["busy_ms"] == 0.7  # 100-400 and 500-900: the attention kernel inside counts once
    assert s["families"]["gemm"] == {"ms": 0.6, "share": 0.75}
    assert s["families"]["attention"] == {"ms": 0.2, "share": 0.25}
    assert s["top"][0] == {"name": gemm, "ms": 0.6, "calls": 2, "share": 0.75, "family": "gemm"}


def test_a_cpu_trace_falls_back_to_operators(tmp_path: Path) -> None:
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mul", "ts": 0, "dur": 50}]
    s = summarise(_trace(tmp_path / "cpu.json.gz", events))
    assert s["what"] == "cpu_op" and s["top"][0]["name"] == "aten::mul"


def test_busy_time_and_families() -> None:
    assert busy_us([(0, 10), (5, 20), (30, 40)]) == 30
    assert busy_us([]) == 0
    assert family("triton_poi_fused_add_mul_0") == "triton (compiled)"
    fp8_input = "triton_red_fused__to_copy_abs_clamp_cutlass_scaled_mm_div_max_mul_reciprocal_3"
    assert family(fp8_input) == "quantize (fp8)"
    assert family("void cutlass::device_kernel<vllm::cutlass_3x_gemm_sm90_fp8<>") == "gemm"
    assert family("void at::native::vectorized_elementwise_kernel") == "copy/cat/index"
    assert family("_Z13rms_norm_kernel") == "norm"
    assert family("something_new") == "other"
