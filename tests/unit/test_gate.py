"""The engine gate: a suspect runs alone, and nobody overtakes a suspect that is waiting."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

from mmworker.gate import EngineGate


def test_a_waiting_suspect_holds_back_later_jobs_and_runs_alone() -> None:
    async def scenario() -> list[str]:
        gate = EngineGate()
        events: list[str] = []
        release_early = asyncio.Event()

        async def ordinary(name: str, hold: asyncio.Event | None = None) -> None:
            async with gate.shared():
                events.append(f"+{name}")
                if hold is not None:
                    await hold.wait()
                await asyncio.sleep(0.01)
                events.append(f"-{name}")

        async def suspect() -> None:
            async with gate.alone():
                events.append("+suspect")
                await asyncio.sleep(0.01)
                events.append("-suspect")

        early = asyncio.create_task(ordinary("early", release_early))
        await asyncio.sleep(0)
        s = asyncio.create_task(suspect())
        await asyncio.sleep(0)
        late = asyncio.create_task(ordinary("late"))
        await asyncio.sleep(0.05)
        assert events == ["+early"]  # the suspect waits for early; late waits for the suspect
        release_early.set()
        await asyncio.gather(early, s, late)
        return events

    assert asyncio.run(scenario()) == [
        "+early", "-early", "+suspect", "-suspect", "+late", "-late",
    ]  # fmt: skip


def test_a_suspect_that_gives_up_waiting_lets_the_others_in() -> None:
    async def scenario() -> bool:
        gate = EngineGate()
        hold = asyncio.Event()

        async def ordinary() -> None:
            async with gate.shared():
                await hold.wait()

        async def suspect() -> None:
            async with gate.alone():
                pass

        first = asyncio.create_task(ordinary())
        await asyncio.sleep(0)
        waiting = asyncio.create_task(suspect())
        await asyncio.sleep(0)
        blocked = asyncio.create_task(ordinary())
        await asyncio.sleep(0.02)
        assert gate._inside == 1  # blocked is held back by the waiting suspect
        waiting.cancel()  # e.g. its job timed out
        await asyncio.sleep(0.02)
        entered = gate._inside == 2
        hold.set()
        await asyncio.gather(first, blocked, return_exceptions=True)
        return entered

    assert asyncio.run(scenario()) is True


def test_backfill_jobs_wait_while_a_live_job_is_worked_on_and_those_inside_finish() -> None:
    async def scenario() -> list[str]:
        gate = EngineGate()
        events: list[str] = []
        live_done = asyncio.Event()

        async def backfill(name: str) -> None:
            async with gate.shared(background=True):
                events.append(f"+{name}")
                await asyncio.sleep(0.02)
                events.append(f"-{name}")

        async def live() -> None:
            async with gate.foreground():
                await asyncio.sleep(0.01)  # fetch and decode: the gate is held already
                async with gate.shared():
                    events.append("+live")
                    await live_done.wait()
                    events.append("-live")

        inside = asyncio.create_task(backfill("inside"))
        await asyncio.sleep(0)
        lv = asyncio.create_task(live())
        await asyncio.sleep(0)
        later = asyncio.create_task(backfill("later"))
        await asyncio.sleep(0.05)
        # The one inside went on and finished; the later one waits for the live job.
        assert events == ["+inside", "+live", "-inside"], events
        live_done.set()
        await asyncio.gather(inside, lv, later)
        return events

    assert asyncio.run(scenario())[-3:] == ["-live", "+later", "-later"]


def test_a_live_job_after_a_quiet_spell_preempts_the_backfill_beyond_keep() -> None:
    """vLLM preempts only for KV-cache room: the gate aborts backfill engine calls beyond `keep`
    when a live job arrives (they go round again), and while live traffic is recent admits at
    most `keep` backfill jobs."""

    async def scenario() -> None:
        gate = EngineGate(keep=1, idle_s=0.2)
        started: list[str] = []
        preempted: list[str] = []

        async def backfill(name: str) -> None:
            while True:
                async with gate.shared(background=True):
                    started.append(name)
                    call = asyncio.ensure_future(asyncio.sleep(10))
                    gate.track(call)
                    try:
                        await call
                        return
                    except asyncio.CancelledError:
                        if not gate.untrack(call):
                            raise
                        preempted.append(name)
                    finally:
                        gate.untrack(call)

        tasks = [asyncio.create_task(backfill(f"b{i}")) for i in range(3)]
        await asyncio.sleep(0.01)
        assert started == ["b0", "b1", "b2"]  # no live traffic: all inside
        async with gate.foreground():
            await asyncio.sleep(0.01)
            assert sorted(preempted) == ["b1", "b2"]  # beyond keep=1: aborted, waiting again
        await asyncio.sleep(0.05)
        assert len(started) == 3  # traffic still recent: b0 inside is all `keep` allows
        await asyncio.sleep(0.3)  # no longer recent: the rest come in
        assert len(started) == 5, started
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_a_suspects_own_requests_share_its_turn_and_no_one_else_enters() -> None:
    """A segmented suspect's segments: all inside together, alone; another suspect and an
    ordinary job wait until the last of them is out."""

    async def scenario() -> list[str]:
        gate = EngineGate()
        events: list[str] = []
        hold = asyncio.Event()

        async def request(name: str, owner: str | None) -> None:
            async with gate.alone(owner) if owner is not None else gate.shared():
                events.append(f"+{name}")
                await hold.wait()
                events.append(f"-{name}")

        tasks = [asyncio.create_task(request(f"seg{i}", "in/0/7")) for i in range(3)]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(request("other-suspect", "in/1/2")))
        tasks.append(asyncio.create_task(request("ordinary", None)))
        await asyncio.sleep(0.01)
        assert events == ["+seg0", "+seg1", "+seg2"], events
        tasks.append(asyncio.create_task(request("seg3", "in/0/7")))  # the suspect's, later
        await asyncio.sleep(0.01)
        assert events[-1] == "+seg3", events
        hold.set()
        await asyncio.gather(*tasks)
        return events

    events = asyncio.run(scenario())
    last_seg = max(events.index(f"-seg{i}") for i in range(4))
    assert events.index("+other-suspect") > last_seg
    assert events.index("+ordinary") > last_seg


def test_a_backfill_job_cancelled_as_its_wait_ends_stays_cancelled() -> None:
    """Python 3.11's asyncio.wait_for returns the wait's result when the waiting task is
    cancelled as the wait ends: the job entered the engine with its cancellation (a time limit,
    a stop) lost. Tried at each loop step after the gate opens."""

    async def trial(steps: int) -> str:
        gate = EngineGate(keep=0, idle_s=60.0)
        async with gate.foreground():
            pass  # live traffic is recent: backfill waits, to be woken when it no longer is

        async def backfill() -> None:
            async with gate.shared(background=True):
                await asyncio.sleep(5)

        task = asyncio.create_task(backfill())
        for _ in range(3):
            await asyncio.sleep(0)
        gate._last_live = float("-inf")
        await gate.set_cap(None)  # wakes the waiters
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        try:
            async with asyncio.timeout(1):
                await task
        except asyncio.CancelledError:
            return "cancelled"
        except TimeoutError:
            return "cancellation lost"
        return "finished"

    async def trials() -> list[str]:
        return [await trial(steps) for steps in range(8)]

    assert asyncio.run(trials()) == ["cancelled"] * 8


def test_no_asyncio_wait_for_in_the_worker() -> None:
    """It loses cancellations on Python 3.11 (above); `asyncio.timeout` does not."""
    root = Path(__file__).resolve().parents[2] / "mmworker"
    found = [
        f"{path.relative_to(root)}:{node.lineno}"
        for path in sorted(root.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.Attribute) and node.attr == "wait_for"
            and isinstance(node.value, ast.Name) and node.value.id == "asyncio")
        or (isinstance(node, ast.ImportFrom) and node.module == "asyncio"
            and any(alias.name == "wait_for" for alias in node.names))
    ]  # fmt: skip
    assert not found, found
