"""How `processes = N` splits one host's settings, how N exit codes become one, and how a set
whose start-up fails is taken down whole (real child processes, no engine)."""

from __future__ import annotations

import signal
import sys
import time
from typing import Any

import pytest

from mmworker import processes
from mmworker.config import load_config
from mmworker.errors import ConfigError
from mmworker.kv_sizes import KvSize
from mmworker.processes import _Children, child_config, combined_exit_code


def test_children_split_gpu_memory_and_the_default_pool() -> None:
    cfg = load_config(
        processes=2,
        worker_id="host",
        metrics_port=9400,
        engine={"gpu_memory_utilization": 0.9},
        preprocess={},
    )
    first, second = child_config(cfg, 0), child_config(cfg, 1)
    for child in (first, second):
        assert child.processes == 1
        assert child.engine.gpu_memory_utilization == pytest.approx(0.45)
        assert child.preprocess.workers == max(1, cfg.preprocess.workers // 2)
        assert child.kafka == cfg.kafka  # one consumer group
    assert (first.worker_id, second.worker_id) == ("host-0", "host-1")
    # One cache directory: each process evicts what it knows, so each keeps its share.
    assert first.cache.max_bytes + second.cache.max_bytes <= cfg.cache.max_bytes
    assert first.cache.directory == cfg.cache.directory
    # 9400 is the supervisor's, answering for both (mmworker.processes._serve_health).
    assert (first.metrics_port, second.metrics_port) == (9401, 9402)


def test_an_explicit_pool_size_is_per_process_and_no_port_stays_off() -> None:
    cfg = load_config(processes=4, preprocess={"workers": 3})
    child = child_config(cfg, 3)
    assert child.preprocess.workers == 3
    assert child.metrics_port is None


@pytest.mark.parametrize(
    ("codes", "want"),
    [
        ([0, 0], 0),
        ([0, 3, 130], 3),  # engine death wins: the orchestrator should look at the GPU
        ([0, 130], 130),
        ([-9, 0], 137),  # killed by SIGKILL → the shell's 128 + 9
        ([None, 0], 1),  # never started
        # The cause outranks the sibling killed because it did not stop in time after it.
        ([4, -9], 4),
        ([-15, 2, 0], 2),
    ],
)
def test_exit_codes_combine(codes: list[int | None], want: int) -> None:
    assert combined_exit_code(codes) == want


def test_the_processes_the_hardware_chose_split_the_host_like_set_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two processes chosen for a large GPU halve its memory and the pool; the jobs each holds
    (max_in_flight, also chosen for that GPU) are per process, as with a set `processes`."""
    from mmworker import hardware
    from mmworker.hardware import GIB, Hardware

    big = Hardware(gpu_name="NVIDIA H200", gpu_memory_bytes=140 * GIB, gpus=1, cores=16)
    monkeypatch.setattr(hardware, "probe", lambda: big)
    cfg = load_config(engine={"gpu_memory_utilization": 0.92})
    assert cfg.processes == 2
    child = child_config(cfg, 1)
    assert child.processes == 1
    assert child.engine.gpu_memory_utilization == pytest.approx(0.46)
    assert child.engine.compile_vision_encoder is True
    assert child.limits.max_in_flight == 1024
    assert child.preprocess.workers == max(1, cfg.preprocess.workers // 2)


def test_on_an_h100_the_default_fraction_leaves_room_beside_each_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mmworker import hardware
    from mmworker.hardware import Hardware

    h100 = Hardware(
        gpu_name="NVIDIA H100 80GB HBM3", gpu_memory_bytes=81559 * 1024**2, gpus=1, cores=16
    )
    monkeypatch.setattr(hardware, "probe", lambda: h100)
    cfg = load_config()
    assert cfg.processes == 2
    assert child_config(cfg, 0).engine.gpu_memory_utilization == pytest.approx(0.4247, abs=1e-3)
    set_by_user = load_config(engine={"gpu_memory_utilization": 0.9})
    assert child_config(set_by_user, 0).engine.gpu_memory_utilization == pytest.approx(0.45)


def _children(*exits: int | None, stopping: bool = False) -> _Children:
    """Started stand-ins for worker processes: one that exits at once with each given code, or
    sleeps (None) until a signal ends it."""
    children = _Children(load_config(limits={"shutdown_grace_s": 5}), lambda: stopping)
    for index, code in enumerate(exits):
        target, args = (time.sleep, (60,)) if code is None else (sys.exit, (code,))
        child = children.ctx.Process(target=target, args=args, name=f"mmworker-{index}")
        child.start()
        children.procs.append(child)
    return children


def test_a_child_that_dies_before_it_is_ready_takes_the_started_ones_down() -> None:
    children = _children(None, 3)
    earlier, dying = children.procs
    started = time.monotonic()
    code = children.start_failed(dying, children.ctx.Event())
    assert code == 3, "its engine death (3) wins over the SIGTERM of the child stopped for it"
    assert earlier.exitcode == -15, "the child already up was stopped with SIGTERM"
    assert children.go.is_set(), "a child still waiting to consume must be let go to see SIGTERM"
    assert time.monotonic() - started < 20


def test_a_stop_asked_for_during_start_up_ends_it_once_the_child_is_ready() -> None:
    children = _children(None, stopping=True)
    ready = children.ctx.Event()
    ready.set()
    assert children.start_failed(children.procs[0], ready) == 128 + 15
    assert children.procs[0].exitcode == -15


def test_a_stop_that_reached_no_child_is_passed_on_once_instead_of_waiting_out_its_load() -> None:
    """A SIGTERM the supervisor took while no child of this set was listed (between a child's
    start and its listing, or before a failed set was replaced) reaches the loading child once:
    without it the stop waited for a full engine load (minutes), past Kubernetes' grace."""
    children = _children(None, stopping=True)
    loading = children.procs[0]  # sleeps 60 s: an engine load, never ready
    started = time.monotonic()
    assert children.start_failed(loading, children.ctx.Event()) == 128 + 15
    assert time.monotonic() - started < 20, "the stop did not wait for the load"
    assert loading.exitcode == -15 and loading.pid in children.signalled


def test_once_consuming_the_first_child_to_exit_stops_the_others() -> None:
    children = _children(None, 4)
    # Why the set stopped (4) outranks the stand-in the SIGTERM killed (143).
    assert children.consume("") == 4
    assert [c.exitcode for c in children.procs] == [-15, 4]


#: A stand-in for a worker process's signal handling (`mmworker.exits`, then the poll loop's):
#: the first SIGTERM starts a drain that ends with exit 0, a second one exits 130 at once.
DRAINS = """
import os, signal, time
seen = []
def handler(signum, frame):
    if seen:
        os._exit(130)
    seen.append(signum)
    caught.set()
signal.signal(signal.SIGTERM, handler)
ready.set()
while not seen:
    time.sleep(0.02)
time.sleep(1.0)
os._exit(0)
"""


def _drainers(count: int, stopping: bool) -> tuple[_Children, list[Any]]:
    """The children, once their handlers are installed, and for each an event set when it has
    taken its first SIGTERM (the tests wait on these, not on a sleep: a spawned child on a busy
    2-core host can take over a second to start)."""
    children = _Children(load_config(limits={"shutdown_grace_s": 5}), lambda: stopping)
    caught = []
    for index in range(count):
        ready, caught_one = children.ctx.Event(), children.ctx.Event()
        child = children.ctx.Process(
            target=exec,
            args=(DRAINS, {"ready": ready, "caught": caught_one}),
            name=f"mmworker-{index}",
            daemon=True,  # a failed wait below must not leave one waiting for a SIGTERM forever
        )
        child.start()
        children.procs.append(child)
        assert ready.wait(60), "the stand-in did not install its handler"
        caught.append(caught_one)
    return children, caught


def test_a_stop_during_start_up_lets_the_children_drain_and_the_set_exits_0() -> None:
    """The supervisor passed the stop on (`run_processes`' `forward`); taking the set down must
    not send a second SIGTERM (exit 130, undrained), and children that stopped as asked are no
    start failure: `mmworker run` exits 0, as with one process."""
    children, _ = _drainers(2, stopping=True)
    children.send(signal.SIGTERM, once=True)  # what forward does with the first stop
    code = children.start_failed(children.procs[0], children.ctx.Event())
    assert [c.exitcode for c in children.procs] == [0, 0]
    assert code == 0


def test_a_stop_during_a_bring_down_does_not_cut_the_siblings_drain_short() -> None:
    """A sibling failed, so the others were sent SIGTERM and drain; the orchestrator's own stop
    (a failed probe, a rollout) arriving then must not reach them as a second one."""
    children, caught = _drainers(1, stopping=False)
    children.send(signal.SIGTERM, once=True)  # the bring-down (`terminate`)
    assert caught[0].wait(30)  # taken: two pending SIGTERMs would reach the child as one
    children.send(signal.SIGTERM, once=True)  # the stop `forward` passes on first
    children.procs[0].join(10)
    assert children.procs[0].exitcode == 0


def test_a_second_stop_asked_of_the_supervisor_is_passed_on_as_one() -> None:
    children, caught = _drainers(1, stopping=True)
    children.send(signal.SIGTERM, once=True)
    assert caught[0].wait(30)
    children.send(signal.SIGTERM, once=False)  # forward, stopping already
    children.procs[0].join(10)
    assert children.procs[0].exitcode == 130


def _stand_in_spawn(target: Any, args: tuple[Any, ...]) -> Any:
    """`_Children.spawn` starting `target(*args)` instead of a worker (no engine, no broker)."""

    def spawn(self: _Children, index: int, core: Any = None) -> tuple[Any, Any]:
        ready, turn = self.ctx.Event(), self.ctx.Event()
        self.turns.append(turn)
        child = self.ctx.Process(target=target, args=args, name=f"mmworker-{index}")
        child.start()
        self.procs.append(child)
        return child, ready

    return spawn


def test_a_supervisor_that_fails_after_starting_its_children_takes_them_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Children wait for their turn; a supervisor error (here: reading the model's config for the
    KV size key) left them waiting, and the supervisor itself, joining them at exit, for ever."""
    spawned: list[_Children] = []
    spawn = _stand_in_spawn(time.sleep, (60,))

    def recording_spawn(self: _Children, index: int, core: Any = None) -> tuple[Any, Any]:
        spawned.append(self)
        return spawn(self, index, core)  # type: ignore[no-any-return]

    def unreadable(_cfg: Any) -> None:
        raise RuntimeError("model config unreadable")

    monkeypatch.setattr(processes._Children, "spawn", recording_spawn)
    monkeypatch.setattr(processes, "_inspect_ahead", lambda _cfg: None)
    monkeypatch.setattr(processes, "together_size", unreadable)
    cfg = load_config(processes=2, limits={"shutdown_grace_s": 5})
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="unreadable"):
        processes.run_processes(cfg)
    assert [c.exitcode for c in spawned[0].procs] == [-15, -15]
    assert time.monotonic() - started < 30


def test_engines_that_fail_together_on_their_configuration_are_not_loaded_again_in_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed together-load is retried in turn, since a kept KV size may no longer fit; a
    child's configuration error (exit 2) would fail there again, so it is reported at once."""
    sets: list[int] = []
    spawn = _stand_in_spawn(sys.exit, (2,))

    def counting_spawn(self: _Children, index: int, core: Any = None) -> tuple[Any, Any]:
        sets.append(id(self))
        return spawn(self, index, core)  # type: ignore[no-any-return]

    size = KvSize(bytes=2**30, blocks=100)
    monkeypatch.setattr(processes._Children, "spawn", counting_spawn)
    monkeypatch.setattr(processes, "_inspect_ahead", lambda _cfg: None)
    monkeypatch.setattr(processes, "together_size", lambda _cfg: ("key", size))
    assert processes.run_processes(load_config(processes=2)) == 2
    assert len(sets) == 2 and len(set(sets)) == 1, "one set started, none in turn after it"


#: A child whose `run_worker` raises the given error before its engine is up.
FAILS = """
import mmworker.app
from mmworker.processes import _child_main

def run_worker(*args, **kwargs):
    raise error

mmworker.app.run_worker = run_worker
_child_main(cfg, ready, go, None, turn, planned)
"""


#: A child stopped by SIGTERM during start-up, in a step that turns what it meets into an
#: error of its own.
SIGNALLED = """
import os, signal, time
import mmworker.app
from mmworker.processes import _child_main

def run_worker(*args, **kwargs):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
    except BaseException as exc:
        raise error from exc

mmworker.app.run_worker = run_worker
_child_main(cfg, ready, go, None, turn, planned)
"""


@pytest.mark.parametrize(
    ("script", "error", "want"),
    [
        (FAILS, ConfigError("task 'x': bad response_format"), 2),
        (FAILS, RuntimeError("engine load"), 1),
        (SIGNALLED, ConfigError("cannot reach the brokers"), 0),  # a stop as asked
        (SIGNALLED, RuntimeError("engine load"), 0),
    ],
)
def test_a_childs_exit_is_2_for_configuration_1_for_a_failed_start_0_for_a_stop(
    script: str, error: Exception, want: int
) -> None:
    """As `mmworker run` with one process: exit 2 is a configuration to fix, 1 a start that
    failed; either after a logged line, not a hang on the child's library threads. An error a
    stop caused is the stop (0): with exit 2, the set's combined exit was 2 too."""
    children = _Children(load_config(processes=2), lambda: False)
    ctx = children.ctx
    names = {
        "cfg": child_config(children.cfg, 0),
        "ready": ctx.Event(),
        "go": ctx.Event(),
        "turn": ctx.Event(),
        "planned": ctx.Value("q", 0),
        "error": error,
    }
    child = ctx.Process(target=exec, args=(script, names))
    child.start()
    child.join(60)
    assert child.exitcode == want
