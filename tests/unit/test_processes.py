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


def _children(stopping: bool = False) -> _Children:
    return _Children(load_config(limits={"shutdown_grace_s": 5}), lambda: stopping)


def test_a_child_that_dies_before_it_is_ready_takes_the_started_ones_down() -> None:
    children = _children()
    earlier = children.ctx.Process(target=time.sleep, args=(60,), name="mmworker-0")
    dying = children.ctx.Process(target=sys.exit, args=(3,), name="mmworker-1")
    children.procs += [earlier, dying]
    earlier.start()
    dying.start()
    started = time.monotonic()
    code = children.start_failed(dying, children.ctx.Event())
    assert code == 3, "its engine death (3) wins over the SIGTERM of the child stopped for it"
    assert earlier.exitcode == -15, "the child already up was stopped with SIGTERM"
    assert children.go.is_set(), "a child still waiting to consume must be let go to see SIGTERM"
    assert time.monotonic() - started < 20


def test_a_stop_asked_for_during_start_up_ends_it_once_the_child_is_ready() -> None:
    children = _children(stopping=True)
    child = children.ctx.Process(target=time.sleep, args=(60,), name="mmworker-0")
    children.procs.append(child)
    child.start()
    ready = children.ctx.Event()
    ready.set()
    assert children.start_failed(child, ready) == 128 + 15
    assert child.exitcode == -15


def test_once_consuming_the_first_child_to_exit_stops_the_others() -> None:
    children = _children()
    stays = children.ctx.Process(target=time.sleep, args=(60,), name="mmworker-0")
    leaves = children.ctx.Process(target=sys.exit, args=(4,), name="mmworker-1")
    children.procs += [stays, leaves]
    stays.start()
    leaves.start()
    # The stand-in killed by SIGTERM (143) outranks 4; real children drain and exit 0.
    assert children.consume("") == 128 + 15
    assert stays.exitcode == -15 and leaves.exitcode == 4
