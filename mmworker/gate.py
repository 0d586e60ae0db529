"""Who may be inside the engine at once: everyone, or one suspect alone; and backfill jobs only
while no live job is being worked on.

After an engine death every job that was inside it is a suspect; running each alone is how the
one that kills the engine is told apart from its innocent batch-mates. A suspect waits until the
engine is empty and, while it waits or runs, no other job enters (writer preference), so it also
runs before the later jobs of its partition that are still being prepared.

A live job shares each engine step with every request inside, so backfill jobs already prepared
wait at the gate while a live job is anywhere between its parse and its result (`foreground`).
vLLM preempts only for KV-cache room, never for priority, so a live job arriving after a quiet
spell would share every step with a full backfill batch: more than `keep` backfill requests
inside are then preempted (aborted in the engine; each goes back to the gate and runs again
from the start once the live jobs are done). Fewer than that are left to finish beside it: the
worker holds backfill to `limits.backfill_beside_live` jobs while live traffic is recent.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any


class WaitClock:
    """One attempt's time limit, stopped while its job waits at the gate with nothing inside.

    A backfill job waits here while any live job is being worked on, and a suspect until the
    engine is empty: under sustained live traffic, as long as the traffic lasts. Counted in the
    attempt's limits (`limits.job_timeout_s`, `job_deadline_s`), such a job was dead-lettered as
    job_timeout without having run. `JobRunner` sets one per attempt in `WAIT_CLOCK`.

    A segmented job's requests (a segment each) wait and run side by side: the clock stops only
    while some wait and none is inside the engine. Stopped whenever one waited, the job had no
    limit at all where its segments go in one at a time (a suspect running alone, a degraded
    cap, backfill beside live traffic); restarted by the first one through, the limit fired
    while the others still waited."""

    def __init__(self, limit: asyncio.Timeout) -> None:
        self._limit = limit
        #: Seconds this attempt's clock was stopped (its job deadline moves by as much).
        self.waited_s = 0.0
        self._waiting = 0  # requests of this attempt waiting at the gate now
        self._inside = 0  # and inside the engine
        self._stopped_at: float | None = None
        self._when = 0.0
        self._closed = False
        #: Loop time up to which thrown-away engine time was given back (`credit`).
        self._credited_to = float("-inf")

    def close(self) -> None:
        """The attempt is over: requests still leaving the gate (cancelled segments) must not
        reschedule its finished timeout (asyncio refuses that with a RuntimeError)."""
        self._closed = True

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        """Around a request's wait at the gate."""
        self._waiting += 1
        self._settle()
        try:
            yield
        finally:
            self._waiting -= 1
            self._settle()

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Around a request's time inside the engine."""
        self._inside += 1
        self._settle()
        try:
            yield
        finally:
            self._inside -= 1
            self._settle()

    def credit(self, since: float) -> None:
        """Give back engine time that a preemption threw away, from `since` (loop time) to now:
        a backfill job preempted by live jobs again and again (each aborted generation starts
        over) ran out its limit on work thrown away, and was dead-lettered as job_timeout;
        preemption does not count. A segmented job's segments are preempted together: their
        spans overlap, and only what no earlier credit covered counts (each one whole gave the
        job up to 4x the wall time)."""
        now = asyncio.get_running_loop().time()
        seconds = now - max(since, self._credited_to)
        self._credited_to = max(self._credited_to, now)
        if self._closed or seconds <= 0:
            return
        self.waited_s += seconds  # its job deadline moves by as much
        if self._stopped_at is not None:
            self._when += seconds
            return
        when = self._limit.when()
        if when is not None and not self._limit.expired():
            self._limit.reschedule(when + seconds)

    def _settle(self) -> None:
        if self._closed:
            return
        now = asyncio.get_running_loop().time()
        stop = self._waiting > 0 and self._inside == 0
        if stop and self._stopped_at is None:
            when = self._limit.when()
            if when is None or self._limit.expired():
                return
            self._when, self._stopped_at = when, now
            self._limit.reschedule(None)
        elif not stop and self._stopped_at is not None:
            waited, self._stopped_at = now - self._stopped_at, None
            self.waited_s += waited
            self._limit.reschedule(self._when + waited)


#: The clock of the attempt running in this task, None outside one (a test calling the gate).
WAIT_CLOCK: ContextVar[WaitClock | None] = ContextVar("wait_clock", default=None)


@contextlib.contextmanager
def _waiting() -> Iterator[None]:
    clock = WAIT_CLOCK.get()
    with clock.stopped() if clock is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _inside() -> Iterator[None]:
    clock = WAIT_CLOCK.get()
    with clock.inside() if clock is not None else contextlib.nullcontext():
        yield


class EngineGate:
    def __init__(self, keep: int = 0, idle_s: float = 0.0) -> None:
        #: Backfill requests allowed inside while live traffic is recent (a live job within
        #: `idle_s`); more are preempted when a live job arrives.
        self._keep = keep
        self._idle_s = idle_s
        self._last_live = float("-inf")
        #: Engine calls of backfill jobs inside now (`track`), and those preempted.
        self._background: list[asyncio.Future[Any]] = []
        self._preempted: set[asyncio.Future[Any]] = set()
        self._cond = asyncio.Condition()
        self._inside = 0  # ordinary jobs in the engine
        self._background_inside = 0
        #: The suspect holding the engine (its input coordinates) and how many of its requests
        #: are inside (> 0: it holds it): a segmented suspect's segments share its turn
        #: instead of taking one turn each.
        self._alone_owner: str | None = None
        self._alone_inside = 0
        self._waiting_alone = 0
        self._foreground = 0  # live jobs being worked on (only counted with a backfill lane)
        #: Most ordinary jobs inside at once after load-dependent engine deaths
        #: (`mmworker.recovery`); None: no cap.
        self._cap: int | None = None
        #: While a dead engine is replaced nobody enters (`mmworker.recovery`); the wait
        #: counts in no time limit, as any wait here.
        self.down = False

    @property
    def isolating(self) -> bool:
        return self._alone_inside > 0 or self._waiting_alone > 0

    def _recent_left(self) -> float:
        """Seconds until live traffic stops counting as recent (≤ 0: it does not)."""
        return self._last_live + self._idle_s - time.monotonic()

    async def set_cap(self, cap: int | None) -> None:
        async with self._cond:
            self._cap = cap
            self._cond.notify_all()  # a raised or dropped cap lets waiting jobs in

    async def set_down(self, down: bool) -> None:
        async with self._cond:
            self.down = down
            self._cond.notify_all()

    def _may_enter(self, background: bool) -> bool:
        if self.isolating or self.down:
            return False
        if self._cap is not None and self._inside >= self._cap:
            return False
        if not background:
            return True
        if self._foreground:
            return False
        return self._background_inside < self._keep or self._recent_left() <= 0

    @asynccontextmanager
    async def foreground(self) -> AsyncIterator[None]:
        """Held by a live job from its parse to its result: backfill jobs do not enter meanwhile,
        and the first live job after none preempts the backfill calls beyond `keep`."""
        if self._foreground == 0:
            for call in self._background[self._keep :]:
                self._preempted.add(call)
                call.cancel()
        self._foreground += 1
        self._last_live = time.monotonic()
        try:
            yield
        finally:
            self._foreground -= 1
            self._last_live = time.monotonic()
            if self._foreground == 0:
                async with self._cond:
                    self._cond.notify_all()

    @asynccontextmanager
    async def shared(self, background: bool = False) -> AsyncIterator[None]:
        async with self._cond:
            with _waiting():
                while not self._may_enter(background):
                    left = self._recent_left() if background else 0.0
                    if left > 0 and not self._foreground:  # wake when traffic is no longer recent
                        # Not asyncio.wait_for: on Python 3.11 it returns the wait's result when
                        # the job is cancelled as the wait ends, and the job entered the engine
                        # with its cancellation lost (a timed-out or preempted job ran on).
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(left):
                                await self._cond.wait()
                    else:
                        await self._cond.wait()
            self._inside += 1
            self._background_inside += background
        try:
            with _inside():
                yield
        finally:
            async with self._cond:
                self._inside -= 1
                self._background_inside -= background
                self._cond.notify_all()

    def track(self, call: asyncio.Future[Any]) -> None:
        """A backfill job's engine call, which a live job may preempt."""
        self._background.append(call)

    def untrack(self, call: asyncio.Future[Any]) -> bool:
        """Forget the call; True if it ended because the gate preempted it."""
        if call in self._background:
            self._background.remove(call)
        if call in self._preempted:
            self._preempted.discard(call)
            return call.cancelled()
        return False

    @asynccontextmanager
    async def alone(self, owner: str = "") -> AsyncIterator[None]:
        """The engine for `owner`'s requests only. Another request of the suspect holding it
        joins at once: a segmented suspect ran its segments one at a time (four times slower)
        and, between two of them, let a whole batch of other jobs in first."""
        self._waiting_alone += 1  # before the first await: later arrivals see it at once
        got = False
        try:
            async with self._cond:
                with _waiting():
                    await self._cond.wait_for(lambda: self._may_hold(owner))
                got = True
                self._alone_owner = owner
                self._alone_inside += 1
        finally:
            self._waiting_alone -= 1
            if not got:  # gave up waiting (cancelled): wake the jobs it was holding back
                async with self._cond:
                    self._cond.notify_all()
        try:
            with _inside():
                yield
        finally:
            async with self._cond:
                self._alone_inside -= 1
                if self._alone_inside == 0:
                    self._alone_owner = None
                self._cond.notify_all()

    def _may_hold(self, owner: str) -> bool:
        if self.down:
            return False
        if self._alone_inside:
            return bool(owner) and owner == self._alone_owner
        return self._inside == 0
