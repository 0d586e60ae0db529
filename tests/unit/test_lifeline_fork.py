"""An engine core forked from the worker (`VLLM_WORKER_MULTIPROC_METHOD=fork`, ~16 s faster to
start on a GPU than a spawned one) must get the ties a spawned one gets from the plugin hook:
its own process group and death with the worker. vLLM loads plugins once per process and a
forked child inherits the mark, so the hook alone would leave it an orphan-to-be. It must also
start as a spawned core would: torch on the threads exported for it, a heap trimmer of its own."""

from __future__ import annotations

import ast
import contextlib
import logging
import signal
import subprocess
import sys

import psutil
import pytest

SCRIPT = """
import ctypes, logging, multiprocessing, os, signal, socket, sys
from mmworker import heap_trim, lifeline

def ties():
    sig = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
    return (os.getpgid(0) == os.getpid(), sig.value)

def grandchild(q):
    q.put(("grandchild", ties()))

def child(q):
    q.put(("child", ties()))
    q.put(("afresh", afresh()))
    p = multiprocessing.get_context("fork").Process(target=grandchild, args=(q,))
    p.start()
    p.join()

def afresh():
    # torch's threads, and whether this process has a heap trimmer of its own
    import threading
    import torch
    trimmer = any(t.name == heap_trim.THREAD_NAME for t in threading.enumerate())
    wakeup_dropped = signal.set_wakeup_fd(-1) == -1
    method = os.environ["VLLM_WORKER_MULTIPROC_METHOD"]
    return (torch.get_num_threads(), trimmer, logging.getLogger("vllm").level, method,
            wakeup_dropped)

import torch  # imported before the fork, as vLLM has it in the worker
torch.set_num_threads(2)
if sys.argv[1] == "armed":
    lifeline.arm()
heap_trim.start()
heap_trim.hold()  # the front end holds its heap (engine.frontend_keep_heap)
os.environ["OMP_NUM_THREADS"] = "1"  # engine.core_threads, exported for the core
os.environ["VLLM_LOGGING_LEVEL"] = "INFO"  # what the core's own vLLM would log at
logging.getLogger("vllm").setLevel(logging.WARNING)  # the worker's own, quieter policy
os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"  # the worker's choice for its core ...
os.environ[lifeline.CORE_FORKED_ENV] = "1"  # ... not the user's
_pipe = socket.socketpair()  # asyncio's self-pipe in the worker
_pipe[1].setblocking(False)
signal.set_wakeup_fd(_pipe[1].fileno())
ctx = multiprocessing.get_context("fork")
q = ctx.Queue()
p = ctx.Process(target=child, args=(q,))
p.start()
p.join()
print(dict(q.get(timeout=30) for _ in range(3)))
"""


def _ties(mode: str) -> dict[str, tuple[object, ...]]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
        start_new_session=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result: dict[str, tuple[object, ...]] = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    return result


def test_a_child_forked_from_an_armed_worker_leaves_its_group_and_dies_with_it() -> None:
    ties = _ties("armed")
    assert ties["child"] == (True, 9), "own process group, SIGKILL when the worker dies"
    # What the engine core forks in turn is the engine core's business, not the worker's.
    assert ties["grandchild"] == (False, 0)


def test_a_forked_core_starts_as_a_spawned_one_would() -> None:
    """torch read OMP_NUM_THREADS when the worker imported it; the worker's trimmer thread does
    not survive the fork, and its hold (the front end's) is not the core's; vLLM's logger gets
    the level VLLM_LOGGING_LEVEL gives a fresh vLLM, not the worker's quieter one; the core's
    own children (multi-GPU executors) spawn, so vLLM's plugin hook ties them to it; and the
    worker's signal wakeup fd is dropped, so a signal to the core does not wake the worker's
    event loop as if it were the worker's."""
    assert _ties("armed")["afresh"] == (1, True, logging.INFO, "spawn", True)


def test_a_process_that_never_armed_forks_children_as_python_does() -> None:
    ties = _ties("plain")
    assert ties["child"] == (False, 0) and ties["grandchild"] == (False, 0)
    assert ties["afresh"] == (2, False, logging.WARNING, "fork", False)


ORPHAN = """
import multiprocessing, os, sys, time
from mmworker import lifeline

def core():
    time.sleep(600)  # an engine core busy with its model

if sys.argv[1] == "armed":
    lifeline.arm()
p = multiprocessing.get_context("fork").Process(target=core, daemon=False)
p.start()
print(p.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(("mode", "dies"), [("armed", True), ("plain", False)])
def test_a_forked_core_is_gone_once_its_worker_is_sigkilled(mode: str, dies: bool) -> None:
    """The fault itself: SIGKILL the worker while its forked core runs. Armed, the core goes
    with it (the GPU memory it held is free for the next worker); a plain fork outlives it."""
    worker = subprocess.Popen(
        [sys.executable, "-c", ORPHAN, mode], stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    assert worker.stdout is not None
    core = psutil.Process(int(worker.stdout.readline()))
    try:
        assert core.is_running()
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
        gone, _ = psutil.wait_procs([core], timeout=10 if dies else 2)
        assert bool(gone) is dies, f"{mode}: core {core.pid} {'gone' if gone else 'alive'}"
    finally:
        worker.stdout.close()
        with contextlib.suppress(psutil.NoSuchProcess):
            core.kill()
