"""Hand memory that glibc's malloc holds free back to the system, on a timer, in each process.

A worker's processes free most of what they allocate within a job (a decoded image, a clip's
frames, a Kafka batch, vLLM's per-request tensors), but glibc returns freed memory only from the
top of a heap: a free block below a live one stays resident, and with dozens of threads each
allocating in an arena of its own the holes add up. `bench/soak.py` measured it: Python objects
(tracemalloc) and malloc's bytes in use stayed flat while the resident memory of the worker and
the engine core kept rising, and the growth sat in the heap mappings (the soak's per-mapping
table). `malloc_trim(0)` walks every arena and releases each free page inside it, so a timer
that calls it bounds resident memory at what is in use plus what one interval frees, at the
cost of a few milliseconds (10 ms for 100 MB of holes here) and re-faulting pages the next
allocation takes again.

The timer runs in the worker, its preprocessing processes and vLLM's engine core (through the
vLLM plugin in `mmworker.lifeline`); `MMWORKER_HEAP_TRIM_S` sets its period (0: off), read by
each process when it starts. A process that keeps its heap on purpose (the GPU front end,
`engine.frontend_keep_heap`) calls `hold()` and is not trimmed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

ENV = "MMWORKER_HEAP_TRIM_S"
#: Seconds between two trims. At the soak's ~90 jobs/s a period frees at most a few MiB of holes
#: per arena, and a trim's cost every half minute is lost in the noise of a running engine.
DEFAULT_PERIOD_S = 30.0
THREAD_NAME = "heap-trim"

_held = threading.Event()
#: This process's trimmer, once started (`start`).
_running: dict[str, HeapTrimmer] = {}
#: Guards `start` (a dict, so a forked child can replace a lock it may have inherited held).
_guard = {"start": threading.Lock()}


def malloc_trim() -> bool:
    """Release the free pages of every malloc arena now; False where the C library has no
    `malloc_trim` (musl, macOS), so callers need not know which one they run on."""
    fn = _malloc_trim_fn()
    return fn is not None and bool(fn(0))


def _malloc_trim_fn() -> Callable[[int], int] | None:
    return _libc_fn("malloc_trim", [ctypes.c_size_t])


def mallopt(param: int, value: int) -> bool:
    """glibc's `mallopt(param, value)` (parameters from malloc.h); False where the C library
    has none or refuses the value."""
    fn = _libc_fn("mallopt", [ctypes.c_int, ctypes.c_int])
    return fn is not None and bool(fn(param, value))


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """This process's C library, found once: `find_library` runs `ldconfig -p` (or a compiler)
    in a subprocess, which every trim would otherwise pay."""
    lib = ctypes.util.find_library("c")
    return ctypes.CDLL(lib) if lib is not None else None


def _libc_fn(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """A function of this process's C library that returns an int; None where it has none."""
    libc = _libc()
    fn = getattr(libc, name, None) if libc is not None else None
    if fn is None:
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


#: glibc's mallopt parameter (malloc.h) for the most malloc arenas a process creates.
_M_ARENA_MAX = -8
#: Arenas for the worker process on a CPU host. glibc gives each thread that allocates an arena
#: of its own, up to 8 per core, and a hole in any of them stays resident: the worker runs ~40
#: threads (Kafka client, publisher, 32 I/O threads, the event loop, the health server), and the
#: soak's per-mapping table put the worker's remaining growth (2.1-3.0 MiB per 1,000 jobs,
#: session 20) in its thread arenas. Its threads mostly wait on sockets, so two arenas cost no
#: measurable lock contention there.
WORKER_ARENAS = 2


def limit_arenas(arenas: int) -> bool:
    """Cap this process's malloc arenas at `arenas`, from now on: glibc fixes its limit when a
    thread first needs a new arena past its 8 free ones, so this is called before the worker
    starts its threads. MALLOC_ARENA_MAX in the environment (read by glibc itself) wins; False
    then, or where the C library is not glibc."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    return mallopt(_M_ARENA_MAX, arenas)


def hold() -> None:
    """This process keeps its freed memory on purpose (see `engine.frontend.keep_heap`): trim
    no more, also if a trimmer is running already."""
    _held.set()


class HeapTrimmer:
    """A daemon thread that calls `trim` every `period_s` seconds until stopped."""

    def __init__(self, period_s: float, trim: Callable[[], bool] = malloc_trim) -> None:
        if period_s <= 0:
            raise ValueError(f"a trim period must be positive, not {period_s}")
        self.period_s = period_s
        self.trims = 0
        self._trim = trim
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)

    def start(self) -> HeapTrimmer:
        self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if _held.is_set():
                continue
            try:
                self._trim()
            except OSError as exc:  # a C library refusing the call: nothing to release then
                log.debug("malloc_trim failed: %s", exc)
                return
            self.trims += 1


def period_from_env() -> float | None:
    """The period this process should trim at: `MMWORKER_HEAP_TRIM_S`, else the default; None
    when off (0, or a value that is not a number, said once in the log)."""
    raw = os.environ.get(ENV)
    if raw is None:
        return DEFAULT_PERIOD_S
    try:
        period = float(raw)
    except ValueError:
        log.warning("%s=%r is not a number of seconds: heap trimming off", ENV, raw)
        return None
    return period if period > 0 else None


def start_in_forked_child() -> HeapTrimmer | None:
    """`start` in a child forked from a process that may have had a trimmer, held trimming or
    been inside `start` on another thread: none of that state belongs to the child."""
    _guard["start"] = threading.Lock()
    _running.clear()
    _held.clear()
    return start()


def start() -> HeapTrimmer | None:
    """Start this process's trimmer once (later calls return the same one); None where the C
    library cannot trim or the environment turned it off. A child forked from a process with a
    trimmer has no thread: it calls `start_in_forked_child`."""
    with _guard["start"]:
        running = _running.get("trimmer")
        if running is not None and running.alive():
            return running
        period = period_from_env()
        if period is None or _malloc_trim_fn() is None:
            return None
        _running["trimmer"] = HeapTrimmer(period).start()
        return _running["trimmer"]
