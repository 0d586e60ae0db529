"""Engine recovery: the degrade policy on plain values, and the restart protocol against a
scripted runner and engine (the real engine's restart: tests/integration/test_worker_faults.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from mmworker_schemas import SourceCoords

from mmworker.config import LimitsConfig
from mmworker.errors import EngineFatal
from mmworker.exits import ExitCode
from mmworker.health import Health
from mmworker.metrics import Metrics
from mmworker.offsets import TopicPartition
from mmworker.recovery import Degrade, EngineRecovery, ProbeReport, after_calm, after_death
from mmworker.suspects import suspect_key
from mmworker.worker import Worker
from tests.unit.loopkit import (
    INPUT,
    OUTPUT,
    Clients,
    Consumer,
    Producer,
    ScriptedRunner,
    Suspects,
    config,
    run_until,
)

TP = TopicPartition(INPUT, 0)

LIMITS = LimitsConfig(
    engine_restarts=3, engine_restart_window_s=100.0, engine_recover_after_s=10.0,
    max_in_flight=64,
)  # fmt: skip


def jobs(*names: str) -> frozenset[str]:
    return frozenset(names)


def test_a_first_death_restarts_without_a_cap() -> None:
    v = after_death(Degrade(), 0.0, jobs("a", "b"), LIMITS)
    assert not v.give_up and v.state.cap is None and v.state.deaths == (0.0,)


def test_a_second_death_with_other_jobs_inside_quarters_what_was_inside() -> None:
    first = after_death(Degrade(), 0.0, jobs(*"abcdefgh"), LIMITS).state
    second = after_death(first, 5.0, jobs(*"ijklmnop", "q", "r", "w", "x"), LIMITS)
    assert not second.give_up and second.state.cap == 3  # 12 inside → 3
    third = after_death(second.state, 9.0, jobs("s", "t", "u", "v", "y"), LIMITS)
    assert third.state.cap == 1  # the cap of 3, not the 5 inside, is quartered: at least 1


def test_the_cap_quarters_the_requests_inside_not_the_jobs() -> None:
    """Two segmented jobs with four segments each inside: eight requests, which is what the
    gate's cap counts; quartering the two jobs gave a cap of 1."""
    first = after_death(Degrade(), 0.0, jobs("a"), LIMITS, requests=1).state
    second = after_death(first, 5.0, jobs("seg-1", "seg-2"), LIMITS, requests=8)
    assert second.state.cap == 2


def test_the_same_job_inside_again_is_the_suspects_business_not_load() -> None:
    first = after_death(Degrade(), 0.0, jobs("killer", "a", "b"), LIMITS).state
    second = after_death(first, 5.0, jobs("killer", "c"), LIMITS)
    assert second.state.cap is None and "same jobs" in second.why


def test_two_suspects_that_die_alone_in_turn_are_not_load() -> None:
    """Two killers in one batch: each then dies alone, and the second's death has other jobs
    inside than the first's; taken for load, it held the engine to one request for minutes."""
    batch = jobs("k1", "k2", *(f"j{i}" for i in range(100)))
    state = after_death(Degrade(), 0.0, batch, LIMITS, requests=102).state
    state = after_death(state, 20.0, jobs("k1"), LIMITS, requests=1).state
    last = after_death(state, 40.0, jobs("k2"), LIMITS, requests=1)
    assert last.state.cap is None and "not load" in last.why


def test_deaths_beyond_the_budget_in_the_window_give_up_and_old_ones_expire() -> None:
    state = Degrade()
    for t in (0.0, 1.0, 2.0):
        v = after_death(state, t, jobs(str(t)), LIMITS)
        assert not v.give_up
        state = v.state
    assert after_death(state, 3.0, jobs("x"), LIMITS).give_up  # 4 deaths > 3 in 100 s
    assert not after_death(state, 150.5, jobs("x"), LIMITS).give_up  # 0, 1 and 2 expired


def test_no_restarts_allowed_gives_up_at_the_first_death() -> None:
    limits = LIMITS.model_copy(update={"engine_restarts": 0})
    assert after_death(Degrade(), 0.0, jobs("a"), limits).give_up


def test_calm_doubles_the_cap_each_interval_until_it_no_longer_binds() -> None:
    state = Degrade(deaths=(0.0,), cap=12, since=0.0)
    assert after_calm(state, 9.9, LIMITS) == state  # not calm for long enough yet
    state = after_calm(state, 10.0, LIMITS)
    assert state.cap == 24 and state.since == 10.0
    state = after_calm(state, 20.0, LIMITS)
    assert state.cap == 48
    assert after_calm(state, 30.0, LIMITS).cap is None  # 96 ≥ max_in_flight 64
    assert after_calm(Degrade(), 1e9, LIMITS).cap is None  # nothing to raise


class Engine:
    def __init__(self, fail: bool = False) -> None:
        self.epoch = 0
        self.restarts = 0
        self._fail = fail
        self.dead = False
        self.inside = 0
        self.last_output = 0.0
        self.kills = 0

    def alive(self) -> bool:
        return not self.dead

    def progress(self) -> tuple[int, float]:
        return self.inside, self.last_output

    def kill_core(self) -> bool:
        self.kills += 1
        self.dead = True
        return True

    def restart(self) -> float:
        if self._fail:
            raise RuntimeError("no memory for a new core")
        self.restarts += 1
        self.epoch += 1
        self.dead = False
        return 0.01


class Runner:
    def __init__(self, inside: frozenset[str]) -> None:
        self._inside = inside
        self.up = True
        self.cap: int | None = None
        self.log: list[str] = []

    def inside(self) -> int:
        return 0

    def dead_inside(self) -> frozenset[str]:
        return self._inside

    def dead_requests(self) -> int:
        return len(self._inside)

    async def set_engine_cap(self, cap: int | None) -> None:
        self.cap = cap

    async def engine_down(self) -> None:
        self.up = False
        self.log.append("down")

    async def engine_up(self) -> None:
        self.up = True
        self.log.append("up")


class Report:
    def __init__(self) -> None:
        self.states: list[tuple[str, int | None]] = []
        self.restarts = 0

    def engine_restarted(self, seconds: float) -> None:
        self.restarts += 1

    def engine_state(self, state: str, cap: int | None) -> None:
        self.states.append((state, cap))


def test_a_core_that_died_with_nobody_inside_is_replaced_without_waiting_for_a_job() -> None:
    engine, runner, report = Engine(), Runner(jobs()), Report()
    recovery = EngineRecovery(LIMITS, engine, runner, report)
    assert not asyncio.run(recovery.replace_idle_death())  # alive: nothing to do
    engine.dead = True
    assert asyncio.run(recovery.replace_idle_death())
    assert engine.restarts == 1 and engine.alive() and report.restarts == 1
    assert recovery.state.cap is None and runner.log == ["down", "up"]
    assert not asyncio.run(recovery.replace_idle_death())


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_death_found_idle_after_a_job_saw_it_writes_that_jobs_suspects() -> None:
    """A segmented job's requests fail and leave the engine; the job notices at its next
    segment. The calm loop found the core dead with nobody inside first and restarted it with
    no suspects written, and the job's own recovery then found the core already replaced."""
    engine, runner, report = Engine(), Runner(jobs("a")), Report()
    recovery = EngineRecovery(LIMITS, engine, runner, report)
    written: list[str] = []

    async def write() -> None:
        written.append("suspects")

    recovery.write_suspects = write
    engine.dead = True
    assert asyncio.run(recovery.replace_idle_death())
    assert written == ["suspects"] and engine.restarts == 1


def test_a_core_stuck_with_requests_inside_is_killed_after_the_stall_limit_only() -> None:
    """Killing it hands the wedge to the death path (suspects, a new core); an idle engine, one
    whose requests still produce output, or one without a limit is left alone."""
    clock = Clock()
    engine, runner, report = Engine(), Runner(jobs()), Report()
    recovery = EngineRecovery(LIMITS, engine, runner, report, stuck_after_s=30.0, clock=clock)
    clock.now = 100.0  # no output since t=0, but nothing inside: idle, not stuck
    assert not recovery.kill_stuck_core() and engine.kills == 0
    engine.inside, engine.last_output = 4, 75.0
    assert not recovery.kill_stuck_core()  # 25 s without output: under the limit
    clock.now = 106.0
    assert recovery.kill_stuck_core() and engine.kills == 1 and not engine.alive()
    assert not recovery.kill_stuck_core()  # dead now: the death path's business
    unjudged = EngineRecovery(LIMITS, Engine(), runner, report)
    assert not unjudged.kill_stuck_core()


def test_a_request_sent_to_a_core_already_dead_is_no_suspect() -> None:
    """The first job to meet a core that had died idle was recorded as its suspect."""
    from mmworker_schemas import Job, MediaRef

    from mmworker.jobs import JobRunner
    from mmworker.records import Context
    from tests.unit.loopkit import config

    class Dead:
        epoch = 3

        def alive(self) -> bool:
            return False

    runner = JobRunner(config(), engine=Dead(), media=None, metrics=Metrics())  # type: ignore[arg-type]
    ctx = Context(SourceCoords(topic="in", partition=0, offset=1), None, "w", "tiny", None)
    job = Job(job_id="newcomer", media=[MediaRef(data=b"x")])
    with pytest.raises(EngineFatal) as death:
        asyncio.run(runner._generate(job, ctx, "describe", [], None, False, False))
    assert death.value.epoch == 3
    assert runner.dead_with == [] and runner.dead_inside() == frozenset()


def test_every_job_that_saw_one_death_waits_for_one_restart_after_the_suspects_are_written() -> (
    None
):
    engine, runner, report = Engine(), Runner(jobs("a", "b")), Report()
    recovery = EngineRecovery(LIMITS, engine, runner, report)

    async def record() -> None:
        assert not runner.up  # written while no job can reach the engine
        runner.log.append("suspects")

    async def scenario() -> list[bool]:
        death = EngineFatal("engine died", epoch=0)
        return list(await asyncio.gather(*(recovery.recover(death, record) for _ in range(5))))

    assert asyncio.run(scenario()) == [True] * 5
    assert engine.restarts == 1 and report.restarts == 1
    assert runner.log == ["down", "suspects", "up"]
    assert report.states == [("restarting", None), ("up", None)]


def test_a_death_seen_late_from_a_replaced_core_restarts_nothing() -> None:
    engine, runner = Engine(), Runner(jobs("a"))
    engine.epoch = 1
    recovery = EngineRecovery(LIMITS, engine, runner, Report())

    async def record() -> None:
        raise AssertionError("no death to record")

    assert asyncio.run(recovery.recover(EngineFatal("old", epoch=0), record))
    assert engine.restarts == 0 and runner.log == []


def test_a_core_that_cannot_start_again_gives_up_for_good() -> None:
    engine, runner = Engine(fail=True), Runner(jobs("a"))
    recovery = EngineRecovery(LIMITS, engine, runner, Report())
    recorded: list[int] = []

    async def record() -> None:
        recorded.append(1)

    async def scenario() -> tuple[bool, bool]:
        first = await recovery.recover(EngineFatal("died", epoch=0), record)
        second = await recovery.recover(EngineFatal("died", epoch=0), record)
        return first, second

    assert asyncio.run(scenario()) == (False, False)
    assert recorded == [1]  # the suspects were written once, before the attempt


def test_the_worker_reruns_the_jobs_of_a_dead_engine_on_a_new_core_without_stopping() -> None:
    """The loop with a scripted engine: the first core dies with three jobs inside; they are
    recorded as suspects, the core is replaced once, the suspects run alone on it, and every
    job is answered and committed with the worker still running (no exit code 3)."""
    consumer = Consumer({0: 6})
    engine = Engine()
    inside = asyncio.Event()
    entered: list[SourceCoords] = []

    async def behave(s: SourceCoords) -> None:
        if engine.epoch == 0:
            entered.append(s)
            if len(entered) == 3:
                inside.set()
            await inside.wait()
            raise EngineFatal("engine died: test", epoch=0)
        await asyncio.sleep(0)

    cfg = config(max_in_flight=3)
    metrics = Metrics()
    runner = ScriptedRunner(cfg, metrics, behave, engine=engine)
    producer, suspects = Producer(), Suspects()
    health = Health(cfg.health)
    recovery = EngineRecovery(cfg.limits, engine, runner, ProbeReport(metrics, health))
    worker = Worker(cfg, runner, metrics, "tiny", clients=Clients(consumer, producer, suspects),
                    health=health, recovery=recovery)  # fmt: skip

    code = asyncio.run(run_until(worker, lambda: consumer.committed() == {TP: 6}))

    assert code == ExitCode.OK and engine.restarts == 1
    (recorded,) = suspects.recorded
    assert sorted(s.offset for s in recorded) == [s.offset for s in entered] == [0, 1, 2]
    assert sorted(json.loads(json.dumps(d))["job_id"] for d in producer.on(OUTPUT)) == sorted(
        f"p0-o{i}" for i in range(6)
    )
    assert sorted(suspects.cleared) == sorted(suspect_key(s) for s in recorded)  # ran alone, ok
    assert metrics.engine_restarts._value.get() == 1
    assert health.engine_state == "up"
    # A death the calm loop finds writes the suspects through the same handler.
    assert getattr(recovery.write_suspects, "__name__", "") == "record_suspects"


def test_the_gate_holds_jobs_beyond_the_cap_and_everyone_while_the_engine_is_down() -> None:
    from mmworker.gate import EngineGate

    async def scenario() -> list[str]:
        gate, order = EngineGate(), []
        release = asyncio.Event()

        async def job(name: str) -> None:
            async with gate.shared():
                order.append(name)
                await release.wait()

        await gate.set_cap(2)
        tasks = [asyncio.create_task(job(n)) for n in ("a", "b", "c")]
        await asyncio.sleep(0.05)
        assert order == ["a", "b"]  # c waits: two inside is the cap
        await gate.set_down(True)
        await gate.set_cap(None)
        await asyncio.sleep(0.05)
        assert order == ["a", "b"]  # no cap, but the engine is down
        await gate.set_down(False)
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["a", "b", "c"]


def test_a_new_core_starts_with_a_fresh_stall_clock_and_kill_core_kills_only_its_own() -> None:
    """A request that outlived the old core's drain kept the engine's count above 0, so the
    stall clock ran on from before the restart and the new core was killed as stuck at once.
    Its own: the core vLLM's manager names and the core's children, not a process that merely
    appeared while it started (a preprocessing pool's, recycled during an in-process restart)."""
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    import psutil

    from mmworker.config import EngineConfig
    from mmworker.engine import Engine

    engine = Engine(EngineConfig(), "tiny")
    engine._active, engine._last_progress = 3, 0.0  # stuck since long before the restart
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    started: dict[str, subprocess.Popen[bytes]] = {}
    started_executor: list[psutil.Process] = []

    def fake_start() -> None:  # vLLM's start: a core (with an executor of its own) appears
        started["core"] = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import subprocess, time; subprocess.Popen({sleep!r}); time.sleep(60)",
            ]
        )
        started["pool"] = subprocess.Popen(sleep)  # a pool process spawned meanwhile
        manager = SimpleNamespace(processes=[started["core"]])
        resources = SimpleNamespace(engine_manager=manager, coordinator=None)
        engine._llm = SimpleNamespace(engine_core=SimpleNamespace(resources=resources))
        deadline = time.monotonic() + 30
        while not psutil.Process(started["core"].pid).children():
            assert time.monotonic() < deadline, "the core's executor never started"
            time.sleep(0.05)

    engine._start = fake_start  # type: ignore[method-assign]
    before = time.monotonic()
    try:
        engine.start()
        inside, since = engine.progress()
        assert inside == 3 and since >= before
        core = psutil.Process(started["core"].pid)
        executor = core.children()[0]
        started_executor.append(executor)
        assert {p.pid for p in engine._core_procs} == {core.pid, executor.pid}
        assert engine.kill_core()
        assert started["core"].wait(10) == -9
        gone, _ = psutil.wait_procs([executor], timeout=10)  # killed (reaped, or a zombie)
        assert gone or executor.status() == psutil.STATUS_ZOMBIE
        assert started["pool"].poll() is None  # not the core's: still running
        assert not engine.kill_core()  # nothing of its own left running
    finally:
        for proc in started.values():
            proc.kill()
            proc.wait(10)
        for orphan in started_executor:  # left sleeping if the test failed before the kill
            with contextlib.suppress(psutil.NoSuchProcess):
                orphan.kill()


def test_core_processes_of_an_attached_client_are_none_and_an_unknown_client_falls_back() -> None:
    """A front end attached to a shared core started no core of its own, even when a process
    appeared meanwhile; a client whose manager is not where this vLLM keeps it falls back to
    every process that appeared during the start."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from mmworker.engine import _started_core_processes

    resources = SimpleNamespace(engine_manager=None, coordinator=None)
    attached = SimpleNamespace(engine_core=SimpleNamespace(resources=resources))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _started_core_processes(attached, before=set()) == []
        fallback = _started_core_processes(SimpleNamespace(), before=set())
        assert child.pid in {p.pid for p in fallback}
    finally:
        child.kill()
        child.wait(10)
