"""Start-up told as it happens: each phase logged when it begins, and one line saying where the
seconds went once the worker holds partitions.

Why: a model load is tens of seconds on a CPU and minutes on a GPU host; a worker that prints
nothing meanwhile looks hung, and "engine ready in 30s" alone hides the imports before it and the
group join after it. The clock starts when the process did (the kernel's record of it), so the
imports count too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import psutil

log = logging.getLogger(__name__)


class StartupPhases:
    def __init__(self, started_at: float | None = None) -> None:
        #: Wall-clock time the process started.
        self._t0 = started_at if started_at is not None else psutil.Process().create_time()
        self._current: str | None = None
        self._since = self._t0
        self.took: dict[str, float] = {}

    def begin(self, phase: str) -> None:
        """End the phase running now (if any) and log the next one as it starts."""
        now = time.time()
        self.took[self._current or "imports and config"] = now - self._since
        self._current, self._since = phase, now
        log.info("start-up: %s (%.1fs after the process started)", phase, now - self._t0)

    def summary(self) -> str:
        now = time.time()
        took = dict(self.took)
        if self._current is not None:
            took[self._current] = now - self._since
        parts = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in took.items())
        return f"ready {now - self._t0:.1f}s after the process started: {parts}"

    async def log_when(self, ready: Callable[[], bool], poll_s: float = 0.2) -> None:
        """Log the summary once `ready()` holds (the first partitions assigned)."""
        while not ready():
            await asyncio.sleep(poll_s)
        log.info("start-up: %s", self.summary())
