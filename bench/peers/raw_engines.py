"""Raw peer with N plain vLLM engines on one GPU: the setup a user gets by starting more engines.

Why this peer: one `LLM.generate` is bounded by its front end (every prompt is rendered and run
through the HF processor on one thread while the GPU waits), not by the GPU. Starting N `LLM`
engines on the same GPU, each with 1/N of the memory and 1/N of the prompts, is the obvious
workaround, so a worker running N processes is held against it as well as against one engine.

How it stays comparable with `bench/e2e.py`'s single raw engine: the same worker settings give the
engine arguments (GPU memory split N ways, like the worker's `processes`), the same code decodes and
resizes the same files outside the timing, and the prompts, warm-up, sampling and cold caches
(content-hash uuids in a new process) are those of the single engine's first run. The N engines load
one after another, as the worker's processes do: vLLM sizes an engine's KV cache from the GPU memory
it sees change while it profiles, so engines loading at the same moment skew each other's share (on
the H200 one of two engines started together got 600-18,000 KV blocks against the other's
82,000-97,000, and at 1,787 and 3,586 blocks finished its half 7-11 % later, which bounds the row).
`--start-together` keeps that setup for comparison. This process prepares the inputs while the first
engine loads, and nothing is timed before every engine is loaded and warmed up. Then one kind at a
time (images, then videos) every engine is told to go at once and generates its share; the kind's
wall runs from the earliest start to the last engine's finish, and latency is request finish minus
that start (vLLM's progress hook, as for the single engine).

    python bench/peers/raw_engines.py --model /tmp/qwen3b --load-format dummy --engines 2 \\
        --images 1000 --videos 100 --max-tokens 64 --max-model-len 8192
    .venv/bin/python bench/peers/raw_engines.py --model tiny --engines 2 --images 40 --videos 4 \\
        --max-tokens 8 --max-model-len 4096

`bench/e2e.py --raw-engines N` runs this file with `--spec` (its own worker settings and media).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.child import run_for_json
from bench.common import OUT, PeerStats, add_set_option, environment, fmt, mean, print_table
from bench.e2e_config import Options, child_env
from bench.peers import raw

KINDS = ("image", "video")


@dataclass
class Spec:
    """Everything the peer needs, JSON-serialisable so `bench/e2e.py` can hand it over."""

    worker_args: list[str]
    model_path: str
    images: list[str]
    videos: list[str]
    engines: int
    max_tokens: int
    ignore_eos: bool
    timeout_s: float
    start_together: bool = False


def label(engines: int) -> str:
    """The peer's name in tables and JSON rows."""
    return f"raw ×{engines} engine{'s' if engines != 1 else ''}"


# ---------------------------------------------------------------------------------------------
# The engines (spawned children)


def engine_main(index: int, link: Connection, kwargs: dict[str, Any], spec: Spec) -> None:
    """Entry of engine `index`; every failure goes back to the parent as text, so its report says
    which engine failed and why instead of a bare exit code."""
    from mmworker.lifeline import die_with_parent

    die_with_parent()  # a parent killed outright takes its engines (and their GPU) along
    # SIGTERM (the parent's deadline) unwinds through Python, so vLLM's exit hooks stop the
    # engine-core process before the next benchmark step wants the GPU.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        _serve(index, link, kwargs, spec)
    except BaseException:  # noqa: BLE001 - reported to the parent, then this process ends
        with contextlib.suppress(OSError):
            link.send(("error", traceback.format_exc()[-4000:]))
        raise SystemExit(1) from None


def _serve(index: int, link: Connection, kwargs: dict[str, Any], spec: Spec) -> None:
    from mmworker import lifeline
    from mmworker.engine import _cpu_only

    if _cpu_only():
        # In-process engine core on CPU, as the worker's CPU engine runs it: N engines with an
        # engine-core process each would spin-wait on their queues on a 2-core host.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    lifeline.arm()  # vLLM's processes die with this one (when the lifeline plugin is installed)
    from transformers import AutoTokenizer
    from vllm import LLM

    t0 = time.monotonic()
    llm: Any = LLM(**kwargs)  # the prompts are plain dicts, not vLLM's typed prompts
    startup_s = time.monotonic() - t0
    link.send(("loaded", {"index": index}))  # its KV cache is sized: the next engine may load
    tokenizer = AutoTokenizer.from_pretrained(spec.model_path, revision=kwargs.get("revision"))
    share: dict[str, list[Any]] = link.recv()  # sent once every engine has loaded
    sampling = raw.sampling_params(spec.max_tokens, spec.ignore_eos)
    hook_ok = raw.warm_up(llm, tokenizer, sampling, share)
    # Content hashes as uuids, as the single engine's first run and the worker send them: this
    # engine has never seen them (the warm-up used other uuids), so its caches are cold.
    batches = {kind: raw.prompts(tokenizer, share, kind, "") for kind in KINDS}
    link.send(
        (
            "ready",
            {
                "index": index,
                "startup_s": round(startup_s, 2),
                "scheduler": raw.scheduler_facts(llm),
                "latencies": hook_ok,
                "jobs": {kind: len(batch) for kind, batch in batches.items()},
            },
        )
    )
    while (msg := link.recv())[0] == "go":
        batch = batches.pop(msg[1])
        clock = raw.FinishClock(time.monotonic)  # one clock for every engine: starts compare
        start = time.monotonic()
        hook = clock.factory if hook_ok else False
        outs = llm.generate(batch, sampling, use_tqdm=hook) if batch else []
        end = time.monotonic()
        link.send(
            (
                "done",
                {
                    "jobs": len(outs),
                    "start": start,
                    "end": end,
                    "finishes": clock.finish_times() if hook_ok else [],
                    "tokens": [len(o.outputs[0].token_ids) for o in outs],
                    "prompt_tokens": [len(o.prompt_token_ids or ()) for o in outs],
                },
            )
        )
    raw.shutdown(llm)
    link.send(("stopped", {}))


# ---------------------------------------------------------------------------------------------
# The coordinator


@dataclass
class _Engine:
    index: int
    proc: BaseProcess
    link: Connection


def _collect(
    engines: list[_Engine], expected: str, deadline: float, watch: Sequence[_Engine] = ()
) -> list[dict[str, Any]]:
    """The barrier: one `expected` message from every engine, or an error naming the engine.

    `watch`: engines that owe no message now but must stay alive, such as those already loaded
    while the next one loads (minutes each), so a crash among them stops the run at once rather
    than at the next barrier."""
    pending = {e.index: e for e in engines}
    got: dict[int, dict[str, Any]] = {}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"raw engines {sorted(pending)}: no {expected!r} before the timeout")
        waitables = [w for e in pending.values() for w in (e.link, e.proc.sentinel)]
        wait(waitables + [e.proc.sentinel for e in watch], min(left, 5.0))
        for e in watch:
            if not e.proc.is_alive():
                raise RuntimeError(
                    f"raw engine {e.index} exited ({e.proc.exitcode}) while waiting for "
                    f"{expected!r} from engine(s) {sorted(pending)}"
                )
        for e in list(pending.values()):
            if e.link.poll():
                try:
                    kind, payload = e.link.recv()
                except EOFError:
                    kind, payload = "error", f"exited ({e.proc.exitcode}) without a word"
                if kind == "error":
                    raise RuntimeError(f"raw engine {e.index} failed:\n{payload}")
                if kind != expected:
                    raise RuntimeError(f"raw engine {e.index}: {kind!r}, expected {expected!r}")
                got[e.index] = payload
                del pending[e.index]
            elif not e.proc.is_alive():
                raise RuntimeError(f"raw engine {e.index} exited ({e.proc.exitcode})")
    return [got[e.index] for e in engines]


def _send_quietly(link: Connection, payload: Any) -> None:
    """Runs in a thread: a large share blocks the pipe until the engine reads it (after its
    tokenizer loads), and the coordinator must keep watching every engine's health and the
    deadline meanwhile."""
    with contextlib.suppress(OSError):  # the engine died; `_collect` reports it
        link.send(payload)


def _reap(engines: list[_Engine], grace_s: float) -> None:
    """Wait `grace_s` for engines that are shutting down on their own, then SIGTERM (they stop
    their engine cores), then SIGKILL what is left after 30 s."""
    deadline = time.monotonic() + grace_s
    for e in engines:
        e.proc.join(max(0.0, deadline - time.monotonic()))
    for e in engines:
        if e.proc.is_alive():
            e.proc.terminate()
    deadline = time.monotonic() + 30.0
    for e in engines:
        e.proc.join(max(0.0, deadline - time.monotonic()))
        if e.proc.is_alive():
            e.proc.kill()
            e.proc.join()
        e.link.close()


def run_engines(spec: Spec) -> dict[str, Any]:
    """Start, feed and time the N engines; the peer rows in `PeerStats.to_json()` shape."""
    t0 = time.monotonic()
    deadline = t0 + spec.timeout_s
    n = max(1, spec.engines)
    cfg = raw.load_worker_config(spec.worker_args)
    kwargs = raw.engine_kwargs(cfg, spec.model_path, share=n)
    ctx = multiprocessing.get_context("spawn")  # no CUDA state or threads may be inherited
    engines: list[_Engine] = []
    out: dict[str, Any] = {"engines": n, "engine_kwargs": kwargs}
    stopped = False
    out["start"] = "together" if spec.start_together else "one after another"

    def start(i: int) -> _Engine:
        parent, child = ctx.Pipe()
        # Not daemonic: vLLM starts its engine core as a child of each engine.
        proc = ctx.Process(
            target=engine_main, args=(i, child, kwargs, spec), name=f"raw-engine-{i}"
        )
        proc.start()
        child.close()
        engines.append(_Engine(i, proc, parent))
        return engines[-1]

    try:
        for i in range(n if spec.start_together else 1):
            start(i)
        print(f"{n} raw engines, {out['start']}; preparing the inputs meanwhile", flush=True)
        prepared, out["preprocess"] = raw.prepare_all(
            cfg, [Path(p) for p in spec.images], [Path(p) for p in spec.videos]
        )
        _collect(engines, "loaded", deadline)
        for i in range(len(engines), n):  # one after another: each waits for the last one's load
            loaded = list(engines)
            _collect([start(i)], "loaded", deadline, watch=loaded)
        for e in engines:
            share = {kind: items[e.index :: n] for kind, items in prepared.items()}
            threading.Thread(target=_send_quietly, args=(e.link, share), daemon=True).start()
        del prepared
        ready = _collect(engines, "ready", deadline)
        out["all_ready_s"] = round(time.monotonic() - t0, 2)
        out["per_engine"] = ready
        print(
            f"{n} raw engines ready after {out['all_ready_s']}s "
            f"(start-up {[r['startup_s'] for r in ready]}s each)",
            flush=True,
        )
        latencies = all(r["latencies"] for r in ready)
        for kind in KINDS:
            if not any(r["jobs"][kind] for r in ready):
                continue
            for e in engines:
                e.link.send(("go", kind))
            out[kind] = summarise(n, kind, _collect(engines, "done", deadline), latencies)
            print(
                f"{label(n)} {kind}: {out[kind]['jobs_per_s']:.2f} jobs/s, "
                f"{out[kind]['output_tokens_per_s']:.0f} tok/s, per engine "
                f"{[e['jobs_per_s'] for e in out[kind]['per_engine']]}",
                flush=True,
            )
        for e in engines:
            e.link.send(("stop",))
        _collect(engines, "stopped", deadline)
        stopped = True
    finally:
        _reap(engines, 60.0 if stopped else 0.0)
    return out


def summarise(n: int, kind: str, done: list[dict[str, Any]], latencies: bool) -> dict[str, Any]:
    """One row for all engines: wall from the earliest start to the last finish, so a slow or
    late engine counts against the peer as it would against a user waiting for all results."""
    busy = [d for d in done if d["jobs"]]
    start = min(d["start"] for d in busy)
    wall = max(d["end"] for d in busy) - start
    tokens = [t for d in done for t in d["tokens"]]
    stats = PeerStats(
        peer=label(n),
        kind=kind,
        jobs=sum(d["jobs"] for d in done),
        wall_s=wall,
        output_tokens=sum(tokens),
        latencies_s=[f - start for d in done for f in d["finishes"]] if latencies else [],
        busy_s=wall,
    )
    doc = stats.to_json()
    doc.update(
        {
            "output_tokens_min_max": [min(tokens, default=0), max(tokens, default=0)],
            "prompt_tokens_mean": mean(t for d in done for t in d["prompt_tokens"]),
            "start_skew_s": round(max(d["start"] for d in busy) - start, 4),
            "per_engine": [
                {
                    "jobs": d["jobs"],
                    "wall_s": round(d["end"] - d["start"], 4),
                    "jobs_per_s": round(d["jobs"] / (d["end"] - d["start"]), 3)
                    if d["jobs"]
                    else None,
                }
                for d in done
            ],
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        }
    )
    return doc


# ---------------------------------------------------------------------------------------------
# Run from bench/e2e.py


def count_for(opts: Options) -> int:
    """Engines of this peer for an e2e run: `--raw-engines`, else as many as worker processes."""
    if opts.raw_engines is None:
        from bench.peers.worker import processes_for

        processes = processes_for(opts)
        return processes if processes > 1 else 0
    return max(0, opts.raw_engines)


def run_child(
    opts: Options,
    work: Path,
    base_args: list[str],
    model_path: str,
    images: list[Path],
    videos: list[Path],
    engines: int,
) -> dict[str, Any]:
    """This script on an e2e run's worker settings and media, in a subprocess of its own (like
    the single engine's peers) so the GPU is free again for the worker passes.

    The script keeps to `--timeout-s` itself (start-up included, every engine's load);
    the margin here only lets it stop its engines before the subprocess would be killed.
    """
    spec = Spec(
        worker_args=base_args,
        model_path=model_path,
        images=[str(p) for p in images],
        videos=[str(p) for p in videos],
        engines=engines,
        max_tokens=opts.max_tokens,
        ignore_eos=opts.ignore_eos,
        timeout_s=opts.timeout_s,
    )
    spec_path = work / "raw-engines-spec.json"
    result_path = work / "raw-engines.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    print(f"peers: starting {label(engines)} (subprocess) ...", flush=True)
    result = run_for_json(
        [sys.executable, __file__, "--spec", str(spec_path), "--result", str(result_path)],
        result_path,
        work / "raw-engines.log",
        env=child_env(opts),
        timeout_s=opts.timeout_s + 120,
        what=label(engines),
    )
    for kind in ("image", "video"):
        if kind in result:
            print(f"{result[kind]['peer']} {kind}: {result[kind]['jobs_per_s']:.2f} jobs/s")
    return result


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    d = Options()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=d.model, help="'tiny' or a model dir / HF id")
    p.add_argument("--engines", type=int, default=2, help="plain LLM engines on the one GPU")
    p.add_argument("--images", type=int, default=d.images)
    p.add_argument("--videos", type=int, default=d.videos)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--load-format", default=d.load_format, help="auto | dummy (random weights)")
    p.add_argument("--image-size", type=int, default=d.image_size)
    p.add_argument("--video-seconds", type=float, default=d.video_seconds)
    p.add_argument("--video-fps", type=int, default=d.video_fps)
    p.add_argument("--video-size", type=int, default=d.video_size)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", default=True)
    add_set_option(p, "worker setting, as bench/e2e.py takes it (engine.* reaches the engines)")
    p.add_argument(
        "--start-together",
        action="store_true",
        help="load every engine at once (they skew each other's KV-cache size; the default loads"
        " them one after another, as the worker does)",
    )
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="the whole peer")
    p.add_argument("--out", type=Path, default=OUT / "raw-engines.json")
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)  # from bench/e2e.py
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p


def spec_from_args(args: argparse.Namespace) -> Spec:
    """The worker settings `bench/e2e.py` would give a worker with `processes = engines`, and
    the same media files (made once, cached under bench/out/media)."""
    from bench import e2e
    from bench.common import make_images, make_videos

    opts = e2e.Options(
        model=args.model,
        images=args.images,
        videos=args.videos,
        max_tokens=args.max_tokens,
        load_format=args.load_format,
        image_size=args.image_size,
        video_seconds=args.video_seconds,
        video_fps=args.video_fps,
        video_size=args.video_size,
        ignore_eos=args.ignore_eos,
        processes=args.engines,
        max_model_len=args.max_model_len,
        sets=args.sets,
        timeout_s=args.timeout_s,
    )
    model_path = e2e.resolve_model_path(opts.model)
    images = make_images(opts.images, opts.image_size)
    videos = make_videos(opts.videos, opts.video_seconds, opts.video_fps, opts.video_size)
    allowed = sorted({p.parent.resolve() for p in videos} | {OUT.resolve()})
    probe = {"input": "unused", "output": "unused", "dlq": "unused"}
    worker_args = e2e.worker_args(
        opts, "127.0.0.1:9092", OUT, probe, "probe", model_path, 0, allowed
    )
    return Spec(
        worker_args=worker_args,
        model_path=model_path,
        images=[str(p) for p in images],
        videos=[str(p) for p in videos],
        engines=args.engines,
        max_tokens=opts.max_tokens,
        ignore_eos=opts.ignore_eos,
        timeout_s=opts.timeout_s,
        start_together=args.start_together,
    )


def print_rows(result: dict[str, Any]) -> None:
    rows = [
        [
            r["kind"],
            r["peer"],
            str(r["jobs"]),
            fmt(r["jobs_per_s"]),
            fmt(r["output_tokens_per_s"], ".0f"),
            fmt(r["latency_p50_s"], ".3f"),
            fmt(r["latency_p95_s"], ".3f"),
            " / ".join(fmt(e["jobs_per_s"]) for e in r["per_engine"]),
        ]
        for kind in KINDS
        if (r := result.get(kind))
    ]
    print_table(
        f"{label(result['engines'])} (all loaded after {result.get('all_ready_s')}s)",
        ["kind", "peer", "jobs", "jobs/s", "out tok/s", "p50 s", "p95 s", "jobs/s per engine"],
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.spec is not None:  # a child of bench/e2e.py: its settings, its result file
        spec = Spec(**json.loads(args.spec.read_text()))
        result = run_engines(spec)
        args.result.write_text(json.dumps(result, default=str))
        return 0
    spec = spec_from_args(args)
    report = {"spec": asdict(spec), "environment": environment(), **run_engines(spec)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print_rows(report)
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
