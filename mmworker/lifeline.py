"""Tie vLLM's own processes to the worker that started them.

vLLM starts its engine core (and, on GPUs, model-executor processes) as children of the worker.
Two things go wrong with them by default:

- they share the worker's process group, so a terminal's Ctrl-C (SIGINT to the foreground group)
  reaches the engine core directly; it aborts every running request at once, and the worker would
  see truncated generations instead of deciding how to stop;
- when the worker is SIGKILLed they live on as orphans, and an orphaned engine core keeps most of
  the GPU memory, so the restarted worker cannot start.

This module is registered as a vLLM general plugin (pyproject entry point), which vLLM loads in
each of its processes. It acts only where the worker asked for it through the environment, so
other vLLM users of the same environment are unaffected.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys

from mmworker import heap_trim

log = logging.getLogger(__name__)

#: Set by the worker before it starts the engine: its own pid.
ENV = "MMWORKER_LIFELINE_PID"
#: Set by the worker when it, not the user, chose to fork the engine core
#: (`engine._core_start_method`): the forked core then has its own children spawned.
CORE_FORKED_ENV = "MMWORKER_CORE_FORKED"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


#: `hooked`: the fork hooks are registered (once per process); `pid`: the process forking now.
_FORK = {"hooked": 0, "pid": 0}


def arm() -> None:
    """Called by the worker before vLLM starts: children spawned from now on take part, and
    children forked from this process too (`_forked`)."""
    os.environ[ENV] = str(os.getpid())
    if not _FORK["hooked"]:
        os.register_at_fork(before=_before_fork, after_in_child=_forked)
        _FORK["hooked"] = 1


def _before_fork() -> None:
    _FORK["pid"] = os.getpid()


def _forked() -> None:
    """A child forked from the armed worker (vLLM's engine core, with
    `VLLM_WORKER_MULTIPROC_METHOD=fork`) gets the same ties as a spawned one. The plugin hook
    cannot give them: vLLM loads plugins once per process and a forked child inherits the
    "loaded" mark, so `install` would never run there. Only the worker's direct children: a
    process the engine core forks in turn keeps its own parent's ties."""
    owner, forker = os.environ.get(ENV), _FORK["pid"]
    if not owner or int(owner) != forker:
        return
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != forker:  # the worker died while forking
        os._exit(1)
    try:
        os.setpgid(0, 0)
    except PermissionError:
        log.debug("forked process %d keeps its process group", os.getpid())
    _as_if_started_afresh()


def _as_if_started_afresh() -> None:
    """What a spawned engine core gets by starting a new interpreter, a forked one must be given.

    - Its own children (the executor processes of a multi-GPU engine) spawn, as they did when
      the core itself was spawned, so the plugin hook ties them to it; forked, they would inherit
      the "plugins loaded" mark and get no ties (unless the user asked for fork).
    - The worker's signal wakeup fd (asyncio's self-pipe) is not the core's: a signal to the
      core would otherwise reach the worker's event loop as if the worker had got it.
    - torch read OMP_NUM_THREADS when the worker imported it, so the one thread the worker
      exports for its core (`engine.core_threads`) would not reach a forked core's torch.
    - vLLM's logger has the worker's quieter level; a fresh vLLM takes VLLM_LOGGING_LEVEL (the
      first H100 run with forked cores showed none of the core's INFO start-up lines).
    - The heap trimmer's thread, and its hold, are the worker's, not the child's.

    Each step stands alone: an exception in an at-fork hook would skip the steps after it."""
    if os.environ.pop(CORE_FORKED_ENV, None) == "1":
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not forked from the main thread: no wakeup fd is ours to drop
        log.debug("forked from a thread other than the main one: wakeup fd left")
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        try:
            torch.set_num_threads(int(threads))
        except RuntimeError as exc:
            log.warning("forked engine core keeps torch's threads: %s", exc)
    if level := os.environ.get("VLLM_LOGGING_LEVEL"):
        try:
            logging.getLogger("vllm").setLevel(level.upper())
        except ValueError:  # not a level name: vLLM itself would refuse it too
            log.warning("VLLM_LOGGING_LEVEL=%r is not a logging level", level)
    heap_trim.start_in_forked_child()


def install() -> None:
    """vLLM plugin hook: in a child of an armed worker, leave its process group and die with it."""
    owner = os.environ.get(ENV)
    if not owner or int(owner) == os.getpid():
        return  # not started by a worker, or the worker's own process (the front end)
    die_with_parent()
    heap_trim.start()  # the engine core's freed heap memory goes back to the system too
    # Own process group: signals for the worker's group (Ctrl-C, `kill -INT -PGID`) skip us;
    # the worker stops the engine through vLLM's shutdown.
    try:
        os.setpgid(0, 0)
    except PermissionError:  # already a session leader: already out of the worker's group
        log.debug("engine process %d keeps its process group", os.getpid())


class _SpawnWithSigintHeld(multiprocessing.context.SpawnProcess):
    """A pool process that starts with SIGINT blocked: a Ctrl-C in its first second (a new
    interpreter importing the worker's modules, before `pool_child` ignores SIGINT) waits in
    the mask instead of raising KeyboardInterrupt in multiprocessing's bootstrap, which printed
    a traceback and broke the pool. The mask is the starting thread's, kept across fork and exec;
    that thread gets its own back at once (a SIGINT held meanwhile is delivered then)."""

    def start(self) -> None:
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


class PoolContext(multiprocessing.context.SpawnContext):
    """`spawn` (no inherited engine threads or CUDA state), SIGINT held until `pool_child`."""

    Process = _SpawnWithSigintHeld


def pool_child(level: str = "INFO", fmt: str = "text") -> None:
    """Initializer of the worker's preprocessing processes: the same ties as the engine's,
    SIGINT ignored (a Ctrl-C would otherwise break the pool under the jobs still draining), and
    the worker's logging (without it a library's warning there went out bare, bypassing
    `logging.format = "json"`)."""
    from mmworker import logs

    logs.setup(level, fmt="json" if fmt == "json" else "text")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # held since start: now dropped
    die_with_parent()
    heap_trim.start()
    try:
        os.setpgid(0, 0)
    except PermissionError:
        log.debug("pool process %d keeps its process group", os.getpid())


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies; exit now if the parent is already gone.

    The second check closes the window between the parent's death and the prctl call, which in
    a spawned child comes seconds after start (imports).
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)
