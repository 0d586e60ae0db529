"""The front-end process settings do what their docstrings promise, measured by page faults."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mmworker.engine import frontend

_CHILD = """
import resource, sys
import numpy as np
if sys.argv[1] == "keep":
    from mmworker.engine.frontend import keep_heap
    assert keep_heap()
x = np.ones(10_000_000, dtype=np.float32)  # 40 MB: above glibc's largest mmap threshold
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    y = x * 2.0  # a fresh 40 MB temporary each time, as the HF processor makes per clip
    del y
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True,
                         check=True, env={k: v for k, v in os.environ.items()
                                          if not k.startswith("MALLOC_")})  # fmt: skip
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keeping_the_heap_stops_large_temporaries_from_faulting_in_again() -> None:
    default, kept = _faults("default"), _faults("keep")
    # By default each of the 20 temporaries is mapped and faulted in anew (here ~570 faults
    # each: the kernel maps several pages per fault); kept, only the first one faults.
    assert default > 5_000, default
    assert kept * 5 < default, (kept, default)


def test_processor_threads_set_omp_unless_the_user_did(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    frontend.processor_threads(None)
    assert "OMP_NUM_THREADS" not in os.environ
    frontend.processor_threads(4)
    assert os.environ["OMP_NUM_THREADS"] == "4"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    frontend.processor_threads(8)
    assert os.environ["OMP_NUM_THREADS"] == "2"


def test_renderer_threads_turn_vllms_processor_cache_off() -> None:
    """vLLM refuses more renderer threads beside its processor cache (not thread-safe), so the
    setting must bring the cache's switch with it, and leave both alone when unset."""
    from mmworker.config import EngineConfig
    from mmworker.engine import Engine

    plain = Engine(EngineConfig(), "m").engine_kwargs()
    assert "renderer_num_workers" not in plain
    assert plain["mm_processor_cache_gb"] == 0.5
    threaded = Engine(EngineConfig(renderer_threads=6), "m").engine_kwargs()
    assert threaded["renderer_num_workers"] == 6
    assert threaded["mm_processor_cache_gb"] == 0
    assert (
        "renderer_num_workers" not in Engine(EngineConfig(renderer_threads=1), "m").engine_kwargs()
    )


def test_core_threads_are_set_for_the_core_start_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine core reads OMP_NUM_THREADS when it is spawned; this process's HF processor
    reads it at call time, so the value must be gone again once the core has started."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    restore = frontend.core_threads(None, cpu_only=False)
    assert os.environ["OMP_NUM_THREADS"] == "1"
    restore()
    assert "OMP_NUM_THREADS" not in os.environ
    restore = frontend.core_threads(3, cpu_only=False)
    assert os.environ["OMP_NUM_THREADS"] == "3"
    restore()
    # On CPU the core runs the model: left alone unless asked for.
    frontend.core_threads(None, cpu_only=True)()
    assert "OMP_NUM_THREADS" not in os.environ
    # A value the user exported wins and survives the restore.
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    frontend.core_threads(2, cpu_only=False)()
    assert os.environ["OMP_NUM_THREADS"] == "6"


def test_the_grammar_tokenizer_is_known_while_a_dead_core_is_replaced() -> None:
    """`restart` shuts the dead core down first and starts the next (seconds to minutes); a
    guided job's first grammar compile in that window asked the absent core for its vocabulary
    size and was dead-lettered as internal_error. The size is kept from the core's start."""
    from mmworker.config import EngineConfig
    from mmworker.engine import Engine

    engine = Engine(EngineConfig(), "m")
    # What `_start` leaves (the tokenizer, and the vocabulary size read from the core) ...
    engine._tokenizer, engine._vocab_size = "tokenizer", 151_936
    engine.shutdown()  # ... and what `restart` does first
    assert engine.grammar_tokenizer() == ("tokenizer", 151_936)
