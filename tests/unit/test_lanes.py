"""The preprocessing queue serves live jobs first (`mmworker.lanes.PrioritySlots`)."""

from __future__ import annotations

import asyncio

from mmworker.lanes import BACKGROUND, PrioritySlots


def test_waiting_live_jobs_go_before_waiting_backfill_ones_and_a_cancelled_waiter_is_skipped(
) -> None:  # fmt: skip
    async def scenario() -> list[str]:
        slots = PrioritySlots(1)
        order: list[str] = []

        async def job(name: str, background: bool) -> None:
            BACKGROUND.set(background)  # each task has a context of its own
            await slots.acquire()
            order.append(name)
            await asyncio.sleep(0.01)
            slots.release()

        await slots.acquire()  # the pool is full
        tasks = [asyncio.create_task(job(n, n.startswith("b"))) for n in ("b1", "b2", "l1")]
        gone = asyncio.create_task(job("l0", False))
        await asyncio.sleep(0.01)
        gone.cancel()
        tasks.append(asyncio.create_task(job("l2", False)))
        await asyncio.sleep(0.01)
        slots.release()
        await asyncio.gather(*tasks)
        await asyncio.gather(gone, return_exceptions=True)
        slots_free = slots._free
        assert slots_free == 1, slots_free  # every place came back
        return order

    assert asyncio.run(scenario()) == ["l1", "l2", "b1", "b2"]
