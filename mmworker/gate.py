"""Who may be inside the engine at once: everyone, or one suspect alone.

After an engine death every job that was inside it is a suspect; running each alone is how the
one that kills the engine is told apart from its innocent batch-mates. A suspect waits until the
engine is empty and, while it waits or runs, no other job enters (writer preference), so it also
runs before the later jobs of its partition that are still being prepared.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class EngineGate:
    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._inside = 0  # ordinary jobs in the engine
        self._alone = False  # a suspect holds the engine
        self._waiting_alone = 0

    @property
    def isolating(self) -> bool:
        return self._alone or self._waiting_alone > 0

    @asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self.isolating)
            self._inside += 1
        try:
            yield
        finally:
            async with self._cond:
                self._inside -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        self._waiting_alone += 1  # before the first await: later arrivals see it at once
        got = False
        try:
            async with self._cond:
                await self._cond.wait_for(lambda: self._inside == 0 and not self._alone)
                self._alone = got = True
        finally:
            self._waiting_alone -= 1
            if not got:  # gave up waiting (cancelled): wake the jobs it was holding back
                async with self._cond:
                    self._cond.notify_all()
        try:
            yield
        finally:
            async with self._cond:
                self._alone = False
                self._cond.notify_all()
