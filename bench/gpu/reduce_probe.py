"""Why does vLLM's engine core take milliseconds per image to batch the worker's pixel rows?

Session 12's py-spy stacks of a cold image pass on the H200 put a quarter of each engine core's
main-thread samples on one line: `MultiModalFlatField._reduce_data`'s `torch.concat(batch,
out=out)` into a pinned buffer, about 7.6 ms per 448x448 image (602 KB of uint8 rows), where a
plain concat of the same bytes takes well under 0.1 ms per image on this repository's CPU. This
times that exact call on the same host, one factor at a time:

- pinned (`pin_memory=True`, as the GPU model runner asks) against pageable output;
- torch's intra-op threads: the default (one per core) against 1 and 4;
- with and without busy processes beside it (the worker's preprocessing pool is 14 processes on
  a 16-core host), since a parallel copy whose threads are descheduled waits for the slowest.

    python3 bench/gpu/reduce_probe.py --out /tmp/reduce.json     # ~10 s on the H200 host

Session 13's answer (bench/results/reduce-probe-h200-s13.json): alone, the copy takes 0.01-0.05
ms per image at 16, 4 or 1 threads, pinned or not, with or without 14 spinning processes. The
slowness does not reproduce outside the running engine core; one torch thread there removed it
all the same (bench/HISTORY.md, *H200 session 13*).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

#: One 448x448 image as the pixel path sends it: 32x32 patches of 14x14x3 bytes.
ROWS, ROW_BYTES = 1024, 588


def _spin(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def _reducer() -> Any:
    """vLLM's own `_reduce_data` when vLLM is installed; else the lines it runs for equal-shaped
    rows (vLLM 0.25.1 `MultiModalFlatField._reduce_data`), so the probe also runs on a bare
    torch host before the offline bundle has arrived."""
    import torch

    try:
        from vllm.multimodal.inputs import MultiModalFlatField
    except ImportError:

        def reduce(batch: list[Any], *, pin_memory: bool) -> Any:
            out = torch.empty(
                (sum(t.shape[0] for t in batch), *batch[0].shape[1:]),
                dtype=batch[0].dtype,
                pin_memory=pin_memory,
            )
            return torch.concat(batch, dim=0, out=out)

        return reduce
    return MultiModalFlatField(slices=[], dim=0)._reduce_data


def time_reduce(images: int, pin: bool, repeats: int) -> dict[str, float]:
    import torch

    reduce = _reducer()
    batch = [torch.randint(0, 255, (ROWS, ROW_BYTES), dtype=torch.uint8) for _ in range(images)]
    for _ in range(2):
        reduce(batch, pin_memory=pin)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        reduce(batch, pin_memory=pin)
        runs.append(time.perf_counter() - t0)
    med = statistics.median(runs)
    return {"batch_ms": round(1e3 * med, 3), "ms_per_image": round(1e3 * med / images, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=49, help="items per encoder batch")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--busy", type=int, default=14, help="spinning processes for the loaded rows")
    ap.add_argument("--out", type=Path)
    opts = ap.parse_args()
    import torch

    pin_ok = torch.cuda.is_available()
    rows: list[dict[str, Any]] = []
    stop = mp.Event()
    for load in (0, opts.busy):
        procs = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(load)]
        for p in procs:
            p.start()
        for threads in (os.cpu_count() or 1, 4, 1):
            torch.set_num_threads(threads)
            for pin in (True, False) if pin_ok else (False,):
                r = time_reduce(opts.images, pin, opts.repeats)
                row = {"busy_processes": load, "torch_threads": threads, "pinned": pin, **r}
                rows.append(row)
                print(row, flush=True)
        stop.set()
        for p in procs:
            p.join()
        stop.clear()
    if opts.out:
        opts.out.write_text(json.dumps({"images": opts.images, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
