"""The single raw engine and the naive loop: one `LLM`, in a child process of its own.

Both peers share the one engine (its start-up is paid once), and the child exits when they are
done, so the GPU is free again before the next engines start.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.child import run_for_json
from bench.common import ROOT, PeerStats, mean
from bench.e2e_config import Options, child_env
from bench.e2e_jobs import image_job, make_topics, post, video_job
from bench.peers import raw
from bench.peers.naive import naive_loop

#: The child is `bench/e2e.py --peers-spec SPEC`, the driver's hidden child mode.
E2E_SCRIPT = ROOT / "bench" / "e2e.py"


def run_peers(
    opts: Options,
    bootstrap: str,
    work: Path,
    base_args: list[str],
    model_path: str,
    images: list[Path],
    videos: list[Path],
) -> dict[str, Any]:
    """Post the naive loop's jobs, then run both peers in the child; returns what it measured."""
    naive_topics: dict[str, dict[str, str]] = {}
    if not opts.skip_naive:
        for kind, paths, limit, maker in (
            ("image", images, opts.naive_images, image_job),
            ("video", videos, opts.naive_videos, video_job),
        ):
            chosen = paths[:limit]
            if not chosen:
                continue
            naive_topics[kind] = make_topics(bootstrap, f"naive-{kind}")
            jobs = [
                (job_id, maker(job_id, p, opts.max_tokens, opts.ignore_eos))
                for i, p in enumerate(chosen)
                if (job_id := f"naive-{kind}-{i}")
            ]
            post(bootstrap, naive_topics[kind]["input"], jobs)
    result_path = work / "peers.json"
    spec = {
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
        "bootstrap": bootstrap,
        "worker_args": base_args,
        "model_path": model_path,
        "images": [str(p) for p in images],
        "videos": [str(p) for p in videos],
        "naive_topics": naive_topics,
        "result": str(result_path),
    }
    spec_path = work / "peers-spec.json"
    spec_path.write_text(json.dumps(spec))
    print("peers: starting raw engine + naive loop (subprocess) ...", flush=True)
    return run_for_json(
        [sys.executable, str(E2E_SCRIPT), "--peers-spec", str(spec_path)],
        result_path,
        work / "peers.log",
        env=child_env(opts),
        timeout_s=opts.timeout_s * 2,
        what="peers",
    )


def peers_main(spec_path: Path) -> int:
    """The child: load the one engine, run raw then naive on it, write the result, exit."""
    import logging

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("kafka").setLevel(logging.WARNING)
    spec = json.loads(spec_path.read_text())
    o = spec["options"]
    cfg = raw.load_worker_config(spec["worker_args"])
    prepared, prepare_facts = raw.prepare_all(
        cfg, [Path(p) for p in spec["images"]], [Path(p) for p in spec["videos"]]
    )

    from transformers import AutoTokenizer
    from vllm import LLM

    kwargs = raw.engine_kwargs(cfg, spec["model_path"])
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - t0
    tokenizer = AutoTokenizer.from_pretrained(
        spec["model_path"], revision=cfg.engine.model_revision
    )
    sampling = raw.sampling_params(o["max_tokens"], o["ignore_eos"])
    out: dict[str, Any] = {
        "engine_kwargs": kwargs,
        "scheduler": raw.scheduler_facts(llm),
        "startup_s": round(startup_s, 2),
        "preprocess": prepare_facts,
        "raw": {},
    }
    if not o["skip_raw"]:
        out["raw"] = run_raw(llm, tokenizer, sampling, prepared, o["raw_repeats"])
    if spec["naive_topics"]:
        out["naive"] = {
            kind: naive_loop(
                llm,
                tokenizer,
                cfg,
                spec["bootstrap"],
                topics,
                sampling,
                # What was posted: `paths[:limit]` is fewer than the limit when the pass has
                # fewer media, and waiting for the limit then hung to the deadline.
                min(
                    o["naive_images" if kind == "image" else "naive_videos"],
                    len(spec["images"] if kind == "image" else spec["videos"]),
                ),
            )
            for kind, topics in spec["naive_topics"].items()
        }
    Path(spec["result"]).write_text(json.dumps(out, default=str))
    raw.shutdown(llm)
    return 0


def run_raw(
    llm: Any, tokenizer: Any, sampling: Any, prepared: dict[str, list[Any]], repeats: int
) -> dict[str, Any]:
    hook_ok = raw.warm_up(llm, tokenizer, sampling, prepared)

    def timed(label: str, kind: str, ps: list[dict[str, Any]]) -> dict[str, Any]:
        clock = raw.FinishClock()
        t0 = time.perf_counter()
        outs = llm.generate(ps, sampling, use_tqdm=clock.factory if hook_ok else False)
        wall = time.perf_counter() - t0
        tokens = [len(o.outputs[0].token_ids) for o in outs]
        stats = PeerStats(
            peer=label,
            kind=kind,
            jobs=len(outs),
            wall_s=wall,
            output_tokens=sum(tokens),
            latencies_s=[t - t0 for t in clock.finish_times()],
            busy_s=wall,
        )
        doc = stats.to_json()
        doc["output_tokens_min_max"] = [min(tokens, default=0), max(tokens, default=0)]
        doc["prompt_tokens_mean"] = mean(len(o.prompt_token_ids or ()) for o in outs)
        doc["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
        print(
            f"{label} {kind}: {doc['jobs_per_s']:.2f} jobs/s, "
            f"{doc['output_tokens_per_s']:.0f} tok/s",
            flush=True,
        )
        return doc

    out: dict[str, Any] = {}
    for kind in ("image", "video"):
        if not prepared[kind]:
            continue
        # "raw": `repeats` runs, each the first sight of every item for the engine (a new uuid
        # suffix per run, the content hash alone the first time, like the worker): the median
        # run is the bar for both worker passes (each a new process, vLLM's caches cold), and
        # the spread says how noisy the host is. "raw hot": the first uuids again, so vLLM's
        # processor and prefix caches hit: a ceiling no new process meets.
        runs = [
            timed(
                f"raw #{i + 1}", kind, raw.prompts(tokenizer, prepared, kind, f"#{i}" if i else "")
            )
            for i in range(max(1, repeats))
        ]
        median = sorted(runs, key=lambda r: r["jobs_per_s"])[len(runs) // 2]
        out[kind] = {
            "raw": {**median, "peer": "raw", "runs_jobs_per_s": [r["jobs_per_s"] for r in runs]},
            "raw hot": timed("raw hot", kind, raw.prompts(tokenizer, prepared, kind, "")),
        }
    return out
