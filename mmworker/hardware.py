"""What this host offers the worker: the GPU the engine will use, and the CPU cores it may run on.

Read once at start-up so the settings left unset (`mmworker.fast_defaults`) follow the machine
instead of one hand-tuned profile. NVML is read through ctypes from the driver's own library:
no Python package is needed, nothing initialises CUDA in this process (vLLM must still be able to
start its engine core afterwards), and a host without the driver simply has no GPU.
"""

from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class Hardware:
    #: Name of the GPU the engine will run on (the first visible one); None: no GPU.
    gpu_name: str | None
    #: Its memory in bytes (0 without a GPU).
    gpu_memory_bytes: int
    #: GPUs visible to this process.
    gpus: int
    #: CPU cores this process may use (affinity mask and cgroup quota).
    cores: int

    @property
    def gpu(self) -> bool:
        return self.gpu_name is not None

    def describe(self) -> str:
        cores = f"{self.cores} core{'s' if self.cores != 1 else ''}"
        if not self.gpu:
            return f"no GPU, {cores}"
        return f"{self.gpu_name} ({self.gpu_memory_bytes / GIB:.0f} GiB), {cores}"


@lru_cache(maxsize=1)
def probe() -> Hardware:
    """This host, read once per process."""
    name, memory, count = _nvml_first_visible_gpu()
    return Hardware(gpu_name=name, gpu_memory_bytes=memory, gpus=count, cores=usable_cores())


def usable_cores() -> int:
    """Cores from the affinity mask, lowered to a container's CPU quota: in a pod limited to 4
    CPUs on a 64-core node, os.cpu_count() says 64."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(Path("/sys/fs/cgroup/cpu.max").read_text() if _readable() else "")
    return max(1, min(cores, quota) if quota else cores)


def cgroup_cpu_quota(cpu_max: str) -> int | None:
    """Whole CPUs granted by a cgroup v2 `cpu.max` line ("QUOTA PERIOD" or "max PERIOD")."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


def _readable() -> bool:
    return os.access("/sys/fs/cgroup/cpu.max", os.R_OK)


def visible_index(cuda_visible_devices: str | None) -> int | str | None:
    """The NVML index (or UUID) of the device CUDA will number 0, from CUDA_VISIBLE_DEVICES;
    None when that variable hides every device."""
    if cuda_visible_devices is None:
        return 0
    first = cuda_visible_devices.split(",")[0].strip()
    if first in ("", "-1") or first.startswith("-"):
        return None
    return int(first) if first.isdigit() else first


class _Memory(ctypes.Structure):
    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


def _nvml_first_visible_gpu() -> tuple[str | None, int, int]:
    """(name, memory bytes, visible count) of the device the engine will use; (None, 0, 0) when
    there is no driver, no device, or CUDA_VISIBLE_DEVICES hides them all."""
    wanted = visible_index(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if wanted is None:
        return None, 0, 0
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None, 0, 0
    if nvml.nvmlInit_v2() != 0:
        return None, 0, 0
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0 or count.value == 0:
            return None, 0, 0
        handle = ctypes.c_void_p()
        if isinstance(wanted, int):
            found = nvml.nvmlDeviceGetHandleByIndex_v2(wanted, ctypes.byref(handle))
        else:
            found = nvml.nvmlDeviceGetHandleByUUID(wanted.encode(), ctypes.byref(handle))
        if found != 0:
            return None, 0, 0
        memory = _Memory()
        if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0:
            return None, 0, 0
        name = ctypes.create_string_buffer(96)
        nvml.nvmlDeviceGetName(handle, name, ctypes.c_uint(96))
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = count.value if env is None else min(count.value, len(env.split(",")))
        return name.value.decode(errors="replace") or "GPU", int(memory.total), visible
    finally:
        nvml.nvmlShutdown()
