"""Segment mode against what a user would write with plain vLLM.

Ten generated ten-minute clips (scene changes every minute, 112x112 at 8 fps, H.264), each
captioned in fixed 60-second segments: 100 segment requests of `--frames` frames each, exactly
`--max-tokens` output tokens each (`ignore_eos`), no summary.

* **worker**: a real `mmworker run` on the embedded broker; the ten jobs (`segments = {mode:
  fixed, every_s: 60}`, `file://` clips) are posted at once after a warm-up job; wall = last
  result read - jobs posted.
* **plain vLLM peer**: one `vllm.LLM` with the worker's engine arguments (vLLM's own processor
  path, as the other peers in bench/peers/raw.py), in this process after the worker has exited.
  For each clip: PyAV decodes every frame, splits at each minute, keeps the frames nearest the
  same sample times as the worker (n = 60 s x fps, capped at max_frames) at their source size
  (vLLM's processor resizes them), the same segment prompt through the model's chat template;
  then one `LLM.generate` of all 100 requests, all in flight at once. Wall = first decode start
  - last request finished. A warm-up request goes first, outside the timing.

Both report visual tokens per request (prompt tokens), so a different frame size would show.

**MFU**, both sides: the model FLOPs of the timed requests (counted from the model's config by
`bench/mfu.py`'s `lm_flops` and `vision_flops`, per request from its own prompt, visual and output
tokens) per second of wall, over a peak measured here and now: the best of a few 2048x2048 torch
matmuls in the engine's dtype on this machine's cores (`peak` in the JSON: bfloat16 and float32,
before and after the runs; the higher of the engine dtype's two is used; vLLM runs this float32
checkpoint in bfloat16 on CPU). On the tiny random model (hidden 128, 2 layers, a vision
tower of width 64) a segment request is about 1.4 GFLOP, in kernels far too small to fill the
cores, so the figure is small and mostly measures everything around the model (decoding,
scheduling, Python, the other agents on a shared machine): it compares the two sides of one run,
and says nothing about the MFU of a real model or of a GPU.

Run (CPU, tiny random model, a few minutes on the 2-core machine):
    .venv/bin/python bench/segments.py --out bench/results/segments-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench.common import OUT, ResultReader, environment, scrape

SEGMENT_S = 60.0
#: Side of the square matmuls the peak is measured with (large enough to run at the cores' best).
PEAK_N = 2048
#: Peaks measured, before and after the runs; the engine's dtype is known only after them.
PEAK_DTYPES = ("bfloat16", "float32")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clips", type=int, default=10)
    p.add_argument("--minutes", type=int, default=10, help="length of each clip")
    p.add_argument("--size", type=int, default=112)
    p.add_argument("--source-fps", type=int, default=8)
    p.add_argument("--fps", type=float, default=0.1, help="sampling rate within a segment")
    p.add_argument("--frames", type=int, default=6, help="video.max_frames of each segment")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=JSON",
        help="a worker setting (also read by the peer's engine), as mmworker run --set",
    )  # fmt: skip
    p.add_argument("--skip-worker", action="store_true")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--out", type=Path, default=OUT / "segments.json")
    return p.parse_args(argv)


def make_clips(args: argparse.Namespace, workdir: Path) -> list[Path]:
    """The clips, and one more for the warm-up: a clip the warm-up saw would be served from the
    worker's feature cache (and the peer's vLLM caches) in the timed run."""
    from media_scenes import scene_video

    seconds = 60.0 * args.minutes
    paths = []
    for i in range(args.clips + 1):  # the last one is the warm-up's
        # Shifted per clip so no two clips are the same bytes (no cache or dedup between them).
        cuts = [k * 60.0 + 1.0 + i * 0.25 for k in range(args.minutes)]
        path = workdir / f"clip-{i}.mp4"
        path.write_bytes(scene_video(cuts, seconds, fps=args.source_fps, size=args.size))
        paths.append(path)
    return paths


def worker_args(
    workdir: Path, port: int, bootstrap: str, topics: dict[str, str], sets: list[str]
) -> list[str]:
    from mmworker.devkit.demo import worker_command
    from mmworker.set_items import parse_sets

    extra: dict[str, object] = {"metrics_port": port, **parse_sets(sets)}
    return worker_command(bootstrap, workdir, topics, f"bench-seg-{uuid.uuid4().hex[:6]}", extra)


def job_bytes(job_id: str, clip: Path, args: argparse.Namespace) -> bytes:
    from mmworker_schemas import Job, MediaRef

    job = Job(
        job_id=job_id, media=[MediaRef(uri=clip.as_uri())],
        video={"fps": args.fps, "max_frames": args.frames},
        generation={"max_tokens": args.max_tokens, "ignore_eos": True},
        segments={"mode": "fixed", "every_s": SEGMENT_S},
    )  # type: ignore[arg-type]  # fmt: skip
    return job.model_dump_json(exclude_defaults=True).encode()


def post(bootstrap: str, topic: str, jobs: list[tuple[str, bytes]]) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=[bootstrap], acks="all")
    for key, value in jobs:
        producer.send(topic, key=key.encode(), value=value)
    producer.flush()
    producer.close()


def run_worker(
    args: argparse.Namespace, clips: list[Path], warm: Path, workdir: Path
) -> dict[str, Any]:
    from mmworker.config import KafkaConfig
    from mmworker.devkit.broker import EmbeddedBroker, free_port
    from mmworker.kafka_io import ensure_topics

    with EmbeddedBroker() as broker:
        tag = uuid.uuid4().hex[:6]
        topics = {k: f"bench-segments-{tag}.{k}" for k in ("input", "output", "dlq")}
        kafka = KafkaConfig(bootstrap_servers=broker.bootstrap)  # type: ignore[call-arg]
        ensure_topics(kafka, {t: 3 for t in topics.values()})
        port = free_port()
        log_path = workdir / "worker.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(worker_args(workdir, port, broker.bootstrap, topics, args.set),
                                    stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        reader = ResultReader(broker.bootstrap, [topics["output"], topics["dlq"]])
        alive = lambda: proc.poll() is None  # noqa: E731
        try:
            post(broker.bootstrap, topics["input"], [("warmup", job_bytes("warmup", warm, args))])
            reader.wait_for({"warmup"}, args.timeout, alive=alive)
            before = scrape(port)
            jobs = [(f"clip-{i}", job_bytes(f"clip-{i}", c, args)) for i, c in enumerate(clips)]
            t0 = time.time()
            post(broker.bootstrap, topics["input"], jobs)
            reader.wait_for({k for k, _ in jobs}, args.timeout, alive=alive)
            seen = [reader.seen[k] for k, _ in jobs]
            wall = max(s.received for s in seen) - t0
            after = scrape(port)
        finally:
            reader.close()
            proc.terminate()
            proc.wait(timeout=120)
    docs = [s.doc for s in seen]
    failed = [d for d in docs if "code" in d]
    segs = [s for d in docs if "segments" in d for s in d["segments"]]
    ok = [s for s in segs if s["error"] is None]
    config = model_config()
    flops = 0.0
    for d in docs:
        done = [s for s in d.get("segments", ()) if s["error"] is None]
        prompt = d["usage"]["prompt_tokens"] / max(1, len(done)) if done else 0.0
        flops += sum(request_flops(config, prompt, s["visual_tokens"], s["frames"],
                                   s["output_tokens"]) for s in done)  # fmt: skip
    return {
        "wall_s": round(wall, 2),
        "jobs": len(jobs),
        "segments": len(segs),
        "segments_ok": len(ok),
        "failed_jobs": len(failed),
        "segments_per_s": round(len(ok) / wall, 3),
        "output_tokens": sum(s["output_tokens"] for s in ok),
        "visual_tokens_per_segment": round(sum(s["visual_tokens"] for s in ok) / len(ok), 1),
        "prompt_tokens_per_segment": round(
            sum(d["usage"]["prompt_tokens"] for d in docs if "usage" in d) / len(ok), 1
        ),
        # Per job, summed over its segments: where a job's time goes.
        "job_fetch_s_mean": _mean(d["timings"]["fetch_s"] for d in docs if "timings" in d),
        "job_decode_s_mean": _mean(d["timings"]["preprocess_s"] for d in docs if "timings" in d),
        "job_engine_s_mean": _mean(d["timings"]["engine_s"] for d in docs if "timings" in d),
        "job_total_s_mean": _mean(d["timings"]["total_s"] for d in docs if "timings" in d),
        "busy_s": round(
            after.get("mmworker_engine_busy_seconds", 0.0)
            - before.get("mmworker_engine_busy_seconds", 0.0),
            2,
        ),
        "model_flops": flops,
        "model_tflops_per_s": flops / wall / 1e12,
        "log": str(log_path),
    }


def _mean(values: Any) -> float:
    got = list(values)
    return round(sum(got) / max(1, len(got)), 3)


def _segments_of(path: Path, args: argparse.Namespace) -> list[tuple[float, float, Any]]:
    """What a user writes: decode with PyAV, cut every minute, keep the frames nearest evenly
    spaced sample times (as qwen-vl-utils spaces them), at their source size."""
    import math

    import av
    import numpy as np

    frames: list[tuple[float, Any]] = []
    out: list[tuple[float, float, Any]] = []
    start = 0.0

    def flush(end: float) -> None:
        n = max(2, min(math.floor(max((end - start) * args.fps, 4) / 2) * 2, args.frames))
        n = min(n, len(frames))
        times = np.asarray([t for t, _ in frames])
        picks = [int(np.abs(times - t).argmin()) for t in np.linspace(times[0], times[-1], n)]
        out.append((start, end, np.stack([frames[i][1] for i in picks])))

    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            t = float(frame.time or 0.0)
            if t >= start + SEGMENT_S - 1e-3:
                flush(start + SEGMENT_S)
                start += SEGMENT_S
                frames = []
            frames.append((t, frame.to_ndarray(format="rgb24")))
    if frames:
        flush(frames[-1][0] + 1.0 / args.source_fps)
    return out


def run_peer(
    args: argparse.Namespace, clips: list[Path], warm_clip: Path, workdir: Path
) -> dict[str, Any]:
    from mmworker_schemas import DEFAULT_PROMPTS
    from vllm import LLM

    from bench.e2e_config import resolve_model_path
    from bench.peers.raw import engine_kwargs, load_worker_config, sampling_params, shutdown
    from mmworker.devkit.broker import free_port
    from mmworker.engine import chat_prompt

    topics = {"input": "i", "output": "o", "dlq": "d"}
    argv = worker_args(workdir, free_port(), "127.0.0.1:9", topics, args.set)[3:]
    cfg = load_worker_config(argv)
    llm = LLM(**engine_kwargs(cfg, resolve_model_path("tiny")))
    tokenizer = llm.get_tokenizer()
    sampling = sampling_params(args.max_tokens, ignore_eos=True)

    def request(start: float, end: float, frames: Any, tag: str) -> dict[str, Any]:
        text = (
            f"This clip is the part of a longer video from {start:.1f}s to {end:.1f}s. "
            + DEFAULT_PROMPTS["video"]
        )
        n = int(frames.shape[0])
        meta = {"fps": n / (end - start), "duration": end - start, "total_num_frames": n,
                "frames_indices": list(range(n)), "video_backend": "opencv",
                "do_sample_frames": False}  # fmt: skip
        return {
            "prompt": chat_prompt(tokenizer, text, ("video",)),
            "multi_modal_data": {"video": [(frames, meta)]},
            "multi_modal_uuids": {"video": [f"{tag}:{start}"]},
        }

    warm = _segments_of(warm_clip, args)[0]
    llm.generate([request(*warm, "warmup")], sampling, use_tqdm=False)
    t0 = time.perf_counter()
    prompts = [
        request(s, e, f, f"clip-{i}")
        for i, clip in enumerate(clips)
        for s, e, f in _segments_of(clip, args)
    ]
    decoded = time.perf_counter() - t0
    outs = llm.generate(prompts, sampling, use_tqdm=False)
    wall = time.perf_counter() - t0
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    shutdown(llm)
    config = model_config()
    pad = config["video_token_id"]
    flops = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        ids = list(out.prompt_token_ids or ())
        frames = len(prompt["multi_modal_data"]["video"][0][0])
        flops += request_flops(config, len(ids), ids.count(pad), frames,
                               len(out.outputs[0].token_ids))  # fmt: skip
    return {
        "wall_s": round(wall, 2),
        "decode_s": round(decoded, 2),
        "segments": len(prompts),
        "segments_per_s": round(len(prompts) / wall, 3),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "prompt_tokens_per_segment": round(
            sum(len(o.prompt_token_ids or ()) for o in outs) / len(outs), 1
        ),
        "visual_tokens_per_segment": round(
            sum(list(o.prompt_token_ids or ()).count(pad) for o in outs) / len(outs), 1
        ),
        "engine_dtype": dtype,
        "model_flops": flops,
        "model_tflops_per_s": flops / wall / 1e12,
    }


def model_config() -> dict[str, Any]:
    from bench.e2e_config import resolve_model_path

    config: dict[str, Any] = json.loads(
        (Path(resolve_model_path("tiny")) / "config.json").read_text()
    )
    return config


def request_flops(
    config: dict[str, Any], prompt: float, visual: float, frames: int, output: float
) -> float:
    """One segment request's model FLOPs, as bench/mfu.py counts a job's."""
    from bench.mfu import lm_flops, vision_flops

    text = config.get("text_config", config)
    per_pair = visual / max(1, frames // 2)
    return lm_flops(text, prompt, output) + vision_flops(config["vision_config"], visual, per_pair)


def engine_dtype(sets: list[str], report: dict[str, Any]) -> tuple[str, str]:
    """(the dtype the engine ran in, where that is known from): `engine.dtype` when set, else
    what the peer's engine reported (vLLM's "auto" on CPU turned this float32 checkpoint into
    bfloat16, in the worker's engine as in the peer's: same arguments), else that assumption."""
    from mmworker.set_items import parse_sets

    dtype = parse_sets(sets).get("engine.dtype")
    if dtype not in (None, "auto"):
        return str(dtype), "engine.dtype"
    if "plain_vllm" in report:
        return report["plain_vllm"]["engine_dtype"], "the peer's engine"
    return "bfloat16", "assumed (vLLM's CPU choice for this checkpoint; run the peer to see)"


def measure_peak(dtype: str, n: int = PEAK_N, repeats: int = 5) -> dict[str, Any]:
    """The best TFLOP/s of `repeats` timed n x n matmuls in `dtype`, on torch's default threads
    (all cores): the ceiling the MFU is measured against, on this machine as loaded now."""
    import torch

    a = torch.randn(n, n).to(getattr(torch, dtype))
    b = torch.randn(n, n).to(getattr(torch, dtype))
    torch.mm(a, b)  # first call: kernel selection, page faults
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return {
        "dtype": dtype, "n": n, "threads": torch.get_num_threads(),
        "tflops": round(2 * n**3 / best / 1e12, 4), "load_1m": round(os.getloadavg()[0], 2),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = OUT / f"segments-{uuid.uuid4().hex[:6]}"
    workdir.mkdir(parents=True)
    *clips, warm = make_clips(args, workdir)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                              "environment": environment()}  # fmt: skip
    peaks = [measure_peak(dtype) for dtype in PEAK_DTYPES]
    if not args.skip_worker:
        report["worker"] = run_worker(args, clips, warm, workdir)
        print("worker", json.dumps(report["worker"]), flush=True)
    if not args.skip_peer:
        report["plain_vllm"] = run_peer(args, clips, warm, workdir)
        print("plain vLLM", json.dumps(report["plain_vllm"]), flush=True)
    peaks += [measure_peak(dtype) for dtype in PEAK_DTYPES]
    dtype, known = engine_dtype(args.set, report)
    peak = max((p["tflops"] for p in peaks if p["dtype"] == dtype), default=None)
    if peak is None:
        peak = measure_peak(dtype)["tflops"]
    report["peak"] = {"tflops": peak, "dtype": dtype, "dtype_from": known, "measured": peaks}
    for side in ("worker", "plain_vllm"):
        if side in report:
            report[side]["mfu"] = report[side]["model_tflops_per_s"] / peak
            print(f"{side} MFU {100 * report[side]['mfu']:.4f}% of {peak:.3f} TFLOP/s ({dtype})",
                  flush=True)  # fmt: skip
    if "worker" in report and "plain_vllm" in report:
        ratio = report["worker"]["segments_per_s"] / report["plain_vllm"]["segments_per_s"]
        report["worker_vs_plain_vllm"] = round(ratio, 3)
        print(f"worker / plain vLLM segments per second: {ratio:.2f}", flush=True)
    report["load_1m_after"] = round(os.getloadavg()[0], 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
