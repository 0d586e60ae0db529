"""An engine core forked from the worker (`VLLM_WORKER_MULTIPROC_METHOD=fork`, ~16 s faster to
start on a GPU than a spawned one) must get the ties a spawned one gets from the plugin hook:
its own process group and death with the worker. vLLM loads plugins once per process and a
forked child inherits the mark, so the hook alone would leave it an orphan-to-be."""

from __future__ import annotations

import ast
import subprocess
import sys

SCRIPT = """
import ctypes, multiprocessing, os, sys
from mmworker import lifeline

def ties():
    sig = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
    return (os.getpgid(0) == os.getpid(), sig.value)

def grandchild(q):
    q.put(("grandchild", ties()))

def child(q):
    q.put(("child", ties()))
    p = multiprocessing.get_context("fork").Process(target=grandchild, args=(q,))
    p.start()
    p.join()

if sys.argv[1] == "armed":
    lifeline.arm()
ctx = multiprocessing.get_context("fork")
q = ctx.Queue()
p = ctx.Process(target=child, args=(q,))
p.start()
p.join()
print(dict(q.get(timeout=30) for _ in range(2)))
"""


def _ties(mode: str) -> dict[str, tuple[bool, int]]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
        start_new_session=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result: dict[str, tuple[bool, int]] = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    return result


def test_a_child_forked_from_an_armed_worker_leaves_its_group_and_dies_with_it() -> None:
    ties = _ties("armed")
    assert ties["child"] == (True, 9), "own process group, SIGKILL when the worker dies"
    # What the engine core forks in turn is the engine core's business, not the worker's.
    assert ties["grandchild"] == (False, 0)


def test_a_process_that_never_armed_forks_children_as_python_does() -> None:
    assert _ties("plain") == {"child": (False, 0), "grandchild": (False, 0)}
