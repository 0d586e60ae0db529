"""How long the worker's engine takes to start, with and without each part the worker adds to a
plain engine: the encoder store (an EC connector: vLLM sets producers apart at start-up) and the
model class for raw pixels (`engine.pixels_on_engine`).

Why: on an H100 (session 23) the worker's engine started in ~35 s where a plain engine with the
same compile cache took ~15 s, and a worker's start-up and its in-process engine recovery are
both bounded by it. Each variant runs in a fresh process (vLLM imported there, timed apart), so
one start's caches in memory do not flatter the next.

    .venv/bin/python bench/engine_start.py                 # CPU, the tiny model, 2 rounds
    python3 bench/engine_start.py --model DIR --load-format dummy --rounds 2   # GPU host
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = [(True, True), (False, True), (True, False), (False, False)]  # (store, pixels)


def one_start(model: str, store: bool, pixels: bool, load_format: str | None) -> dict[str, float]:
    """In this process: import vLLM, then start the engine as the worker would."""
    from mmworker.config import load_config
    from mmworker.engine import Engine, preload

    update: dict[str, object] = {"pixels_on_engine": pixels}
    if load_format:
        update["load_format"] = load_format
    engine_cfg = load_config().engine.model_copy(update=update)
    t0 = time.monotonic()
    preload()
    t1 = time.monotonic()
    directory = Path(tempfile.mkdtemp(prefix="engine-start-")) if store else None
    engine = Engine(engine_cfg, model, encoder_store=directory, progress_bars=False)
    engine.start()
    t2 = time.monotonic()
    engine.shutdown()
    return {"import_s": round(t1 - t0, 2), "start_s": round(t2 - t1, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="'tiny' (built if missing) or a model dir")
    p.add_argument("--load-format", help="e.g. dummy (random weights)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, help="JSON report")
    p.add_argument("--child", nargs=2, metavar=("STORE", "PIXELS"), help=argparse.SUPPRESS)
    opts = p.parse_args()
    model = opts.model
    if model == "tiny":
        from mmworker.app import model_cache_dir
        from mmworker.devkit.tiny_model import ensure_tiny_model

        model = str(ensure_tiny_model(model_cache_dir()))
    if opts.child:
        store, pixels = (x == "1" for x in opts.child)
        print(json.dumps(one_start(model, store, pixels, opts.load_format)))
        return 0
    rows = []
    for round_ in range(opts.rounds):
        for store, pixels in VARIANTS:
            cmd = [sys.executable, __file__, "--model", model, "--child", str(int(store)),
                   str(int(pixels))]  # fmt: skip
            if opts.load_format:
                cmd += ["--load-format", opts.load_format]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
            lines = done.stdout.strip().splitlines()
            if done.returncode != 0 or not lines:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            row = {"round": round_ + 1, "encoder_store": store, "pixels_on_engine": pixels,
                   **json.loads(lines[-1])}  # fmt: skip
            rows.append(row)
            print(
                f"round {row['round']}: store={store!s:5} pixels={pixels!s:5} "
                f"import {row['import_s']:5.1f} s  engine start {row['start_s']:5.1f} s"
            )
    if opts.out:
        opts.out.write_text(json.dumps({"model": model, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
