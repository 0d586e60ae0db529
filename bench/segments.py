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
MFU is not reported on CPU (the tiny random model's FLOPs say nothing about a GPU).

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
    from media_scenes import scene_video

    seconds = 60.0 * args.minutes
    paths = []
    for i in range(args.clips):
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

    extra: dict[str, object] = {"metrics_port": port}
    for item in sets:
        key, _, value = item.partition("=")
        extra[key] = json.loads(value)
    return worker_command(bootstrap, workdir, topics, f"bench-seg-{uuid.uuid4().hex[:6]}", extra)


def job_bytes(job_id: str, clip: Path, args: argparse.Namespace) -> bytes:
    from mmworker.schemas import Job, MediaRef

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


def run_worker(args: argparse.Namespace, clips: list[Path], workdir: Path) -> dict[str, Any]:
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
            post(broker.bootstrap, topics["input"], [("warmup", job_bytes("warmup", clips[0],
                                                                         args))])  # fmt: skip
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
        "busy_s": round(
            after.get("mmworker_engine_busy_seconds", 0.0)
            - before.get("mmworker_engine_busy_seconds", 0.0),
            2,
        ),
        "log": str(log_path),
    }


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


def run_peer(args: argparse.Namespace, clips: list[Path], workdir: Path) -> dict[str, Any]:
    from mmworker.schemas import DEFAULT_PROMPTS
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

    warm = _segments_of(clips[0], args)[0]
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
    shutdown(llm)
    return {
        "wall_s": round(wall, 2),
        "decode_s": round(decoded, 2),
        "segments": len(prompts),
        "segments_per_s": round(len(prompts) / wall, 3),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "prompt_tokens_per_segment": round(
            sum(len(o.prompt_token_ids or ()) for o in outs) / len(outs), 1
        ),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = OUT / f"segments-{uuid.uuid4().hex[:6]}"
    workdir.mkdir(parents=True)
    clips = make_clips(args, workdir)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                              "environment": environment()}  # fmt: skip
    if not args.skip_worker:
        report["worker"] = run_worker(args, clips, workdir)
        print("worker", json.dumps(report["worker"]), flush=True)
    if not args.skip_peer:
        report["plain_vllm"] = run_peer(args, clips, workdir)
        print("plain vLLM", json.dumps(report["plain_vllm"]), flush=True)
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
