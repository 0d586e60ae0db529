"""Settings for the process that runs vLLM's front end (prompt rendering, the HF processor).

On a GPU the front end, not the GPU, bounds throughput: vLLM renders every prompt on one thread
before the engine core sees it. Two costs of that thread are set by the process, not by vLLM:

- glibc's allocator. A float32 16-frame 448×448 clip tensor is 38.5 MB, above the largest
  mmap threshold glibc ever picks on its own (32 MiB), so every temporary of the processor is
  mmapped, page-faulted in and unmapped again, per clip: 28-38 K minor faults, about half of the
  processor's time on an H200 host. With mmap off for malloc and trimming left to a high mark,
  freed blocks are reused instead (faults fell 45×, videos/s +31 % in one measured run). The
  price is a heap that keeps its high-water mark, which a worker on a GPU host can afford; the
  CPU engine, where memory per job is what was measured tight, keeps glibc's defaults.
- torch's thread count inside the processor: vLLM wraps the HF processor call in
  `set_default_torch_num_threads()`, which reads `OMP_NUM_THREADS` at call time (else 1).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from mmworker import heap_trim

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

#: Heap bytes above which glibc returns freed memory to the system; high, so the processor's
#: per-clip temporaries stay mapped between clips.
TRIM_THRESHOLD = 1 << 30


def keeps_heap(setting: bool | None, gpu: bool) -> bool:
    """Whether the front end keeps its freed memory (`engine.frontend_keep_heap`; unset: on a
    GPU host). One answer for both sides of it: `keep_heap` at engine start, and the arena cap
    the worker process takes at its own start when it does not (`heap_trim.limit_arenas`)."""
    return setting if setting is not None else gpu


def keep_heap() -> bool:
    """Turn mmap off for malloc and raise the trim threshold in this process, now: mallopt acts
    on later allocations, so calling it once the engine has started covers the per-request
    churn, and a core forked at that start keeps glibc's defaults (the environment variables
    MALLOC_MMAP_MAX_/MALLOC_TRIM_THRESHOLD_ would need a re-exec). False where the C library is
    not glibc."""
    ok = heap_trim.mallopt(_M_MMAP_MAX, 0) and heap_trim.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    if ok:
        heap_trim.hold()  # a periodic malloc_trim would undo this
        log.info("front end: malloc keeps freed memory (mmap off, trim above %d MiB)",
                 TRIM_THRESHOLD >> 20)  # fmt: skip
    return ok


def processor_threads(threads: int | None) -> None:
    """Torch threads for the HF processor. A value the user put in OMP_NUM_THREADS wins."""
    if threads is None or "OMP_NUM_THREADS" in os.environ:
        return
    os.environ["OMP_NUM_THREADS"] = str(threads)


def core_threads(threads: int | None, cpu_only: bool) -> Callable[[], None]:
    """Export OMP_NUM_THREADS for an engine-core process about to be spawned; returns the undo,
    to call once it has started, so this process's own HF processor setting stays its own.

    vLLM lowers torch to one thread in its multi-GPU workers but not in the single-GPU engine
    core, where `MultiModalFlatField._reduce_data` concatenates every encoder batch's pixel rows
    into one pinned tensor. On an H200 host, beside the preprocessing pool, that copy took 388 of
    the engine cores' 1,066 main-loop samples in a cold image pass at one thread per core, and 11
    of 757 at one thread (cold images 74-75 → 93-95 per second). Timed alone on the same host the
    copy is fast at any thread count, so the stall belongs to the running core, not the copy.
    A value the user exported wins; on CPU the engine core runs the model and keeps torch's
    default."""
    if "OMP_NUM_THREADS" in os.environ or (threads is None and cpu_only):
        return lambda: None
    os.environ["OMP_NUM_THREADS"] = str(threads or 1)
    log.info("engine core: %s torch thread(s)", threads or 1)

    def restore() -> None:
        os.environ.pop("OMP_NUM_THREADS", None)

    return restore
