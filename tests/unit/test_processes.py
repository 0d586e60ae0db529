"""How `processes = N` splits one host's settings, how N exit codes become one, and how a set
whose start-up fails is taken down whole (real child processes, no engine)."""

from __future__ import annotations

import sys
import time

import pytest

from mmworker.config import load_config
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
    # The stand-in killed by SIGTERM (143) outranks 4; real children drain and exit 0.
    assert children.consume("") == 128 + 15
    assert [c.exitcode for c in children.procs] == [-15, 4]
