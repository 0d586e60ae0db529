"""Time a job spends waiting at the engine gate counts against neither its attempt's timeout nor
its job deadline.

The gate keeps backfill jobs out of the engine while any live job is being worked on, which under
sustained live traffic lasts as long as the traffic does. Counted in the attempt, a backfill job
that never ran was dead-lettered as job_timeout. The real JobRunner and EngineGate run here; the
engine and the media stage are stand-ins that answer when the test says.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from mmworker_preprocess.params import PreparedImage
from mmworker_schemas import Failure, Job, MediaRef, Result, SourceCoords

from mmworker.engine import EngineOutput
from mmworker.jobs import JobRunner
from mmworker.media import PreparedMedia
from mmworker.metrics import Metrics
from mmworker.records import Context
from tests.unit.loopkit import config

LIVE, BACKFILL = "jobs", "backfill"
#: Live jobs one after another, each inside the engine for STEP_S and overlapping the next, so
#: that one is always being worked on: STEPS x STEP_S is past the backfill job's job deadline
#: (1.2 s), each live job well inside its own attempt's limit (0.8 s).
STEPS, STEP_S = 10, 0.2


class _Stage:
    async def prepare(self, job: Job, budgets: Any) -> list[PreparedMedia]:
        image = PreparedImage(np.zeros((28, 28, 3), np.uint8), (28, 28))
        return [PreparedMedia(image, "ab" * 32, "key", False, 0.0, 0.0) for _ in job.media]


class _Engine:
    """A live job's generation lasts until the test sets the event it left in `live`; a
    backfill one takes `backfill_s`."""

    epoch = 0

    def alive(self) -> bool:
        return True

    def __init__(self, backfill_s: float) -> None:
        self.backfill_s = backfill_s
        self.live: list[asyncio.Event] = []
        self.ran: list[str] = []

    def prompt_tokens(self, instruction: str, kinds: tuple[str, ...]) -> int:
        return 10

    async def generate(
        self, request_id: str, instruction: str, items: list[Any], params: Any,
        guide: Any = None, background: bool = False,
    ) -> EngineOutput:  # fmt: skip
        self.ran.append(request_id.partition("@")[0])
        if request_id.startswith("live"):
            done = asyncio.Event()
            self.live.append(done)
            await done.wait()
        else:
            await asyncio.sleep(self.backfill_s)
        return EngineOutput("ok", "stop", 10, 1, 0.0)


def _raw(job_id: str) -> bytes:
    return (
        Job(job_id=job_id, media=[MediaRef(uri="https://example.test/a.jpg")])
        .model_dump_json()
        .encode()
    )


def _ctx(topic: str) -> Context:
    return Context(SourceCoords(topic=topic, partition=0, offset=1), None, "w", "tiny", None)


def _scenario(backfill_s: float) -> tuple[Result | Failure, _Engine]:
    cfg = config(job_timeout_s=0.8, job_deadline_s=1.2, max_attempts=3, retry_backoff_s=0.01)
    cfg = cfg.model_copy(
        update={"kafka": cfg.kafka.model_copy(update={"backfill_topic": BACKFILL})}
    )
    metrics = Metrics()

    async def run() -> tuple[Result | Failure, _Engine]:
        engine = _Engine(backfill_s)
        runner = JobRunner(cfg, engine=engine, media=_Stage(), metrics=metrics)  # type: ignore[arg-type]
        live: list[asyncio.Task[Any]] = []
        backfill = None
        for i in range(STEPS):
            live.append(asyncio.create_task(runner.run(_raw(f"live-{i}"), _ctx(LIVE), 0)))
            while len(engine.live) <= i:  # inside the engine
                await asyncio.sleep(0.005)
            if i:
                engine.live[i - 1].set()  # the one before may finish: this one holds the gate
            if backfill is None:
                backfill = asyncio.create_task(runner.run(_raw("bf"), _ctx(BACKFILL), 0))
            await asyncio.sleep(STEP_S)
        assert "bf" not in engine.ran  # it waited at the gate all along
        engine.live[-1].set()
        assert backfill is not None
        outs = await asyncio.wait_for(asyncio.gather(*live, backfill), 30)
        assert all(isinstance(o.record, Result) for o in outs[:-1]), outs
        return outs[-1].record, engine

    return asyncio.run(run())


def test_a_backfill_job_held_at_the_gate_runs_once_the_live_job_is_done() -> None:
    backfill, engine = _scenario(backfill_s=0.01)
    assert isinstance(backfill, Result), backfill  # before: job_timeout, never having run
    assert engine.ran == [*(f"live-{i}" for i in range(STEPS)), "bf"]


def test_the_attempt_timeout_still_bounds_the_jobs_own_engine_time() -> None:
    """Control: only the wait is left out; a generation slower than the attempt's limit still
    ends as job_timeout, after the gate wait, with the wait named in the message."""
    backfill, engine = _scenario(backfill_s=5.0)
    assert isinstance(backfill, Failure)
    assert backfill.code == "job_timeout"
    assert "engine gate" in backfill.message, backfill.message
    assert engine.ran[STEPS] == "bf"


def test_segments_preempted_together_give_back_their_overlapping_engine_time_once() -> None:
    """A segmented job's segments are preempted by one live job together: each credited its
    whole span, and the attempt got up to 4x the wall time back (its deadline too)."""
    from mmworker.gate import WaitClock

    async def scenario() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(10.0) as limit:
            clock = WaitClock(limit)
            first = limit.when()
            assert first is not None
            t0 = loop.time()
            await asyncio.sleep(0.2)
            before = loop.time() - t0
            for since in (t0, t0 + 0.05, t0 + 0.1, t0 + 0.15):  # four segments, one preemption
                clock.credit(since=since)
            once, after = clock.waited_s, loop.time() - t0
            # The union, since t0 (a loaded host's sleep may overshoot its 0.2 s); summed, the
            # four spans would be 4x that less 0.3 s.
            assert before >= 0.19 and before <= once <= after, (before, once, after)
            await asyncio.sleep(0.1)
            before = loop.time() - t0
            clock.credit(since=t0 + 0.1)  # a later preemption: only its span past the last one
            total, after = clock.waited_s, loop.time() - t0
            assert before <= total <= after, (before, total, after)
            when = limit.when()
            assert when is not None
            assert abs((when - first) - clock.waited_s) < 1e-6  # the limit moved by as much
            return once, total

    once, total = asyncio.run(scenario())
    assert total >= once + 0.09, (once, total)


def test_requests_of_one_attempt_waiting_side_by_side_stop_its_clock_until_the_last_is_through(
) -> None:  # fmt: skip
    """A segmented job's segments wait at the gate together. The first through restarted the
    clock under the others, and the attempt's limit (0.3 s here) fired while one still waited."""
    from mmworker.gate import WaitClock

    async def scenario() -> float:
        async with asyncio.timeout(0.3) as limit:
            clock = WaitClock(limit)

            async def wait(seconds: float) -> None:
                with clock.stopped():
                    await asyncio.sleep(seconds)

            t0 = asyncio.get_running_loop().time()
            await asyncio.gather(wait(0.2), wait(0.6))
            now = asyncio.get_running_loop().time()
            when = limit.when()
            assert when is not None and when > now
            return clock.waited_s, now - t0

    waited, elapsed = asyncio.run(scenario())
    assert waited > 0.55 and abs(waited - elapsed) < 0.05, (waited, elapsed)  # stopped throughout


def test_requests_let_in_one_at_a_time_keep_their_attempts_clock_running() -> None:
    """A segmented job under a cap of one (or running alone as a suspect): one segment inside,
    the others waiting. The clock stopped whenever one waited, so eight 0.25 s segments ran
    2 s under a 1 s limit; it now runs while one of them is inside."""
    from mmworker.gate import WAIT_CLOCK, EngineGate, WaitClock

    async def scenario() -> tuple[bool, float]:
        gate = EngineGate()
        await gate.set_cap(1)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            async with asyncio.timeout(1.0) as limit:
                WAIT_CLOCK.set(WaitClock(limit))

                async def segment() -> None:
                    async with gate.shared():
                        await asyncio.sleep(0.25)

                await asyncio.gather(*(segment() for _ in range(8)))
        except TimeoutError:
            return True, loop.time() - t0
        return False, loop.time() - t0

    timed_out, took = asyncio.run(scenario())
    assert timed_out and 0.9 < took < 1.9, took  # 2 s of segments ran in full before


def test_a_request_leaving_the_gate_after_its_attempt_ended_changes_nothing() -> None:
    """A cancelled segment leaves the gate after its job's attempt is over; rescheduling the
    finished timeout raised RuntimeError in that task ("Task exception was never retrieved")."""
    from mmworker.gate import WAIT_CLOCK, EngineGate, WaitClock

    async def scenario() -> BaseException | None:
        gate = EngineGate()
        await gate.set_down(True)  # an engine being replaced: requests wait at the gate
        async with asyncio.timeout(5.0) as limit:
            clock = WaitClock(limit)
            WAIT_CLOCK.set(clock)

            async def segment() -> None:
                async with gate.shared():
                    pass

            task = asyncio.create_task(segment())
            await asyncio.sleep(0.05)
            clock.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return task.exception() if not task.cancelled() else None

    assert asyncio.run(scenario()) is None


def test_engine_time_a_preemption_threw_away_does_not_count_against_the_attempt() -> None:
    """A backfill job preempted by live jobs again and again (each aborted generation starts
    over) ran out its attempt's limit on work that was thrown away, three attempts in a row,
    and was dead-lettered as job_timeout; preemption is documented not to count."""
    cfg = config(job_timeout_s=0.8, job_deadline_s=1.2, max_attempts=3, retry_backoff_s=0.01,
                 backfill_beside_live=0, live_idle_s=0.0)  # fmt: skip
    cfg = cfg.model_copy(
        update={"kafka": cfg.kafka.model_copy(update={"backfill_topic": BACKFILL})}
    )
    metrics = Metrics()

    async def run() -> Result | Failure:
        engine = _Engine(backfill_s=0.5)
        runner = JobRunner(cfg, engine=engine, media=_Stage(), metrics=metrics)  # type: ignore[arg-type]
        backfill = asyncio.create_task(runner.run(_raw("bf"), _ctx(BACKFILL), 0))
        for i in range(6):  # a live job every 0.35 s: each preempts the backfill's generation
            await asyncio.sleep(0.35)
            live = asyncio.create_task(runner.run(_raw(f"live-{i}"), _ctx(LIVE), 0))
            while len(engine.live) <= i:
                await asyncio.sleep(0.005)
            engine.live[i].set()
            assert isinstance((await live).record, Result)
        return (await asyncio.wait_for(backfill, 30)).record

    backfill = asyncio.run(run())
    assert isinstance(backfill, Result), backfill
    assert metrics.preempted._value.get() >= 5  # about 2 s of generation thrown away
