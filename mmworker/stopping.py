"""Whether the worker is stopping, and why: asked to (a signal, `Worker.request_stop`), or
fatally (the engine is dead, the broker refuses our records, a bug), which also decides the exit
code and that nothing more is committed.

Threads: the event loop only (the signal handler and the job tasks run there)."""

from __future__ import annotations

import asyncio
import logging

from mmworker.exits import ExitCode
from mmworker.health import Health

#: The worker's own name, whichever of its parts logs: operators filter its lines on it.
log = logging.getLogger("mmworker.worker")


class Stopping:
    def __init__(self, health: Health) -> None:
        self._health = health
        self.asked = asyncio.Event()
        #: The error that stopped the worker fatally; None for a stop as asked, or no stop.
        self.error: BaseException | None = None
        self.exit_code = ExitCode.OK

    @property
    def requested(self) -> bool:
        return self.asked.is_set()

    def request(self) -> None:
        """Finish the jobs in flight (up to `limits.shutdown_grace_s`), commit, exit 0."""
        self._health.stopping = True
        self.asked.set()

    def fatally(self, code: ExitCode, what: str, exc: BaseException) -> None:
        """Stop without draining or committing anything further: the jobs are redelivered. The
        first fatal stop decides the exit code."""
        if self.error is None:
            self._health.stopping = True
            log.error("%s, stopping without further commits: %s", what, exc)
            self.error = exc
            self.exit_code = code
            self.asked.set()
