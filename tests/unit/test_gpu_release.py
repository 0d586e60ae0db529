"""Before an in-process engine restart the worker waits until the driver no longer lists the dead
core's processes on the GPU (`engine._wait_gpu_released`), asking NVML rather than CUDA. A GPU is
needed to see it for real; here NVML is a stand-in that answers what a driver would."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from mmworker import engine
from mmworker.errors import EngineFatal


class _Nvml:
    """NVML as the driver would answer: one list of pids per device, per poll."""

    class NVMLError(Exception):
        pass

    def __init__(self, polls: list[list[set[int]]]) -> None:
        self._polls = polls
        self.open = 0

    def nvmlInit(self) -> None:
        self.open += 1

    def nvmlShutdown(self) -> None:
        self.open -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self._polls[0])

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        pids = self._polls[0][handle]
        if handle == len(self._polls[0]) - 1 and len(self._polls) > 1:
            self._polls.pop(0)  # the next poll sees the driver's next answer
        return [SimpleNamespace(pid=pid) for pid in pids]


def test_processes_on_every_gpu_are_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = _Nvml([[{10, 11}, {20}]])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert engine.gpu_pids() == {10, 11, 20}
    assert nvml.open == 0, "NVML is shut down again after each question"


def test_a_restart_waits_until_the_dead_cores_memory_is_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The dead core (11) is still listed twice, then gone; another tenant (99) stays.
    nvml = _Nvml([[{11, 99}], [{11, 99}], [{99}]])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(engine, "_cpu_only", lambda: False)
    engine._wait_gpu_released({11}, timeout_s=10)
    assert nvml._polls == [[{99}]], "it asked until the driver stopped listing 11"


def test_a_core_that_keeps_its_memory_stops_the_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _Nvml([[{11, 99}]]))
    monkeypatch.setattr(engine, "_cpu_only", lambda: False)
    with pytest.raises(EngineFatal, match=r"\[11\] still hold GPU memory"):
        engine._wait_gpu_released({11, 12}, timeout_s=0.3)
