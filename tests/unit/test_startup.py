"""Start-up phases: each logged as it begins, and one summary line that accounts for the time
since the process started (imports included)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from mmworker.startup import StartupPhases


def test_each_phase_is_logged_as_it_starts_and_the_summary_adds_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="mmworker.startup")
    phases = StartupPhases(started_at=time.time() - 5.0)  # 5 s of imports before the first
    phases.begin("loading the model")
    time.sleep(0.05)
    phases.begin("joining the group")
    summary = phases.summary()

    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "start-up: loading the model",
        "start-up: joining the group",
    ]
    assert phases.took["imports and config"] >= 5.0
    assert phases.took["loading the model"] >= 0.05
    total = float(summary.split("ready ")[1].split("s after")[0])  # rounded to 0.1 s
    assert total + 0.05 >= sum(phases.took.values()) >= 5.05
    assert "joining the group" in summary  # the phase still running is in the line too


def test_the_summary_is_logged_once_ready(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mmworker.startup")
    phases = StartupPhases()
    phases.begin("joining the group")
    ready = {"now": False}

    async def scenario() -> None:
        task = asyncio.create_task(phases.log_when(lambda: ready["now"], poll_s=0.01))
        await asyncio.sleep(0.05)
        assert not any("ready " in r.getMessage() for r in caplog.records)
        ready["now"] = True
        await asyncio.wait_for(task, 1.0)

    asyncio.run(scenario())
    assert sum("ready " in r.getMessage() for r in caplog.records) == 1
