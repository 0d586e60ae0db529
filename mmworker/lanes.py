"""Which lane the job being worked on belongs to: live (the input topic) or backfill
(`kafka.backfill_topic`), for the queues a job waits in on its way to the engine.

A context variable, set once per job task by `JobRunner.run`: the preprocessing queue
(`PrioritySlots` below) reads it without every call on the way passing it down, and asyncio
copies it into the tasks a job starts.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from contextvars import ContextVar

#: True while a backfill job is being worked on in this task.
BACKGROUND: ContextVar[bool] = ContextVar("mmworker_background", default=False)


class PrioritySlots:
    """A semaphore whose waiters are served live first, then in arrival order.

    A live job's decode would otherwise queue behind every backfill decode already waiting for
    the preprocessing pool (an asyncio.Semaphore is first come, first served)."""

    def __init__(self, value: int) -> None:
        self._free = value
        self._waiters: list[tuple[bool, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    async def acquire(self) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (BACKGROUND.get(), next(self._order), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a place, then cancelled: pass it on
                self.release()
            raise

    def release(self) -> None:
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():  # a cancelled waiter is skipped
                fut.set_result(None)
                return
        self._free += 1
