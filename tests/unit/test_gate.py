"""The engine gate: a suspect runs alone, and nobody overtakes a suspect that is waiting."""

from __future__ import annotations

import asyncio

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
