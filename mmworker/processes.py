"""Several worker processes on one host, each a full consumer-group member with its own engine.

Why: one process's vLLM front end (HF image processor, tokenizer, request serialisation) runs on
one Python thread, and on a fast GPU that thread, not the GPU, bounds images/s (the H200 profile
in bench/results/profile-h200-images.txt). Kafka's consumer group already spreads partitions over
members, so N processes need no coordination of their own beyond three rules:

- engines load one after another the first time: vLLM sizes its KV cache from the GPU memory it
  sees change while it profiles, which a neighbour loading at the same moment would skew (the
  processes themselves start together, so each one's imports and preprocessing pool overlap the
  load of the engine before it). Each keeps the size it found (`mmworker.kv_sizes`); once every
  engine's size is known, later starts give it to them and they load together (a set that fails
  to is replaced by one that loads in turn);
- nobody consumes before every engine is up, so the group rebalances once, not N times;
- the first child that fails takes the others down (SIGTERM: they drain and commit), so the
  supervisor above (Kubernetes, systemd) restarts the whole set rather than a silently smaller one.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from types import FrameType
from typing import Any

from prometheus_client import CollectorRegistry

from mmworker import fast_defaults, hardware, health, kv_sizes, lifeline, logs
from mmworker.config import WorkerConfig
from mmworker.engine import model_info, resolve_model
from mmworker.engine.shared_core import CoreLink
from mmworker.errors import WorkerError
from mmworker.exits import ExitCode, exit_now, signal_behind, stop_on_signals
from mmworker.kafka_io import ensure_worker_topics
from mmworker.lifeline import die_with_parent

log = logging.getLogger(__name__)


def child_config(cfg: WorkerConfig, index: int) -> WorkerConfig:
    """The settings of child `index`: an equal share of the GPU memory (unless they share one
    engine core, which gets all of it; `fast_defaults.engine_memory_share` leaves headroom
    beside each when the fraction is the default), of the CPU pool and of the feature cache's
    byte budget."""
    n = cfg.processes
    engine = cfg.engine
    if not engine.shared_core:
        share = fast_defaults.engine_memory_share(
            hardware.probe(),
            engine.gpu_memory_utilization,
            n,
            user_set="gpu_memory_utilization" in engine.model_fields_set,
        )
        engine = engine.model_copy(update={"gpu_memory_utilization": share.value})
    preprocess = cfg.preprocess
    if "workers" not in preprocess.model_fields_set:  # the default is per host: split it
        preprocess = preprocess.model_copy(update={"workers": max(1, preprocess.workers // n)})
    # One directory, and each process evicts only the entries it knows (its own, and its share
    # of those on disk when it started): with the whole budget each, the directory grew to
    # N x max_bytes; with all of the directory each, every start evicted it to one share.
    cache = cfg.cache.model_copy(
        update={"max_bytes": max(1, cfg.cache.max_bytes // n), "part": (index, n)}
    )
    port = cfg.metrics_port
    return cfg.model_copy(
        update={
            "processes": 1,
            "engine": engine,
            "preprocess": preprocess,
            "cache": cache,
            "worker_id": f"{cfg.worker_id}-{index}",
            # The supervisor answers on `port` for all (`_serve_health`); child i on port + 1 + i.
            "metrics_port": port + 1 + index if port else port,
        }
    )


def combined_exit_code(codes: list[int | None]) -> int:
    """Engine death wins (it tells the orchestrator the GPU is suspect), then a failure of the
    worker's own (exit codes below 128), then a death by signal: a child killed because it did
    not stop in time after a sibling failed must not hide why that sibling failed."""
    real = [_as_exit_code(c) for c in codes]
    if ExitCode.ENGINE_DEAD in real:
        return ExitCode.ENGINE_DEAD
    failed = [c for c in real if c != ExitCode.OK]
    own = [c for c in failed if c < 128]
    return max(own or failed, default=ExitCode.OK)


def run_processes(cfg: WorkerConfig, create_topics: int | None = None) -> int:
    """Run `cfg.processes` workers; returns when all have exited."""
    if create_topics:
        ensure_worker_topics(cfg.kafka, create_topics)
    stopping = False
    children = _Children(cfg, lambda: stopping)
    supervisor, server = _serve_health(cfg)

    def forward(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        # The first stop reaches only children not already stopping (a sibling's failure took
        # them down, or start-up signalled them): a second SIGTERM makes a child exit at once,
        # undrained. A second stop asked of the supervisor is passed on as one.
        again = stopping
        stopping = True
        if supervisor is not None:
            supervisor.stopping = True  # the pod's /readyz fails at once
        name = signal.Signals(signum).name
        log.info("%s: passing it to %d worker processes", name, len(children.procs))
        children.send(signum, once=not again)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        if cfg.engine.shared_core:
            return _run_shared(children)
        # All start at once (imports, preprocessing pool); the engines load together if their
        # KV cache size is known, else one after another, since vLLM then sizes it from the
        # memory it sees free.
        inspecting = _inspect_ahead(cfg)  # beside the children's imports, before any turn
        started = [children.spawn(index) for index in range(cfg.processes)]
        known = together_size(cfg)  # while the children import
        if inspecting is not None and inspecting.wait():
            log.info("vLLM's look at the model class taken beside the imports (new vLLM caches)")
        if known is None:
            return _in_turn(children, started)
        key, size = known
        log.info(
            "engines load together, %.2f GiB of KV cache each (%d blocks, as their first start "
            "measured)", size.bytes / 2**30, size.blocks,
        )  # fmt: skip
        children.planned.value = size.bytes
        for turn in children.turns:
            turn.set()
        for child, ready in started:
            if (failed := children.start_failed(child, ready)) is not None:
                # A stop is not a failure (the size stays good); a configuration error would
                # fail again in turn.
                if stopping or failed == ExitCode.USAGE:
                    return failed
                kv_sizes.book_for(cfg.cache.directory).forget(key)  # profiled again below
                # Loading together is the default, so a kept size that no longer fits beside
                # the other engines (a driver or CUDA that holds more than when it was measured,
                # a neighbour's peak at the same moment) must not cost the worker its start: a
                # new set loads in turn, each engine profiling what it sees free. A failure
                # that is not about loading together fails again there, and that is reported.
                log.warning(
                    "the engines did not load together (exit %d): loading them one after "
                    "another", failed,
                )  # fmt: skip
                children = _Children(cfg, lambda: stopping)
                return _in_turn(children, [children.spawn(i) for i in range(cfg.processes)])
        return children.consume(", engines loaded together")
    except BaseException:
        # Children wait for their turn or for `go`: with no one to let them go, they and this
        # process (multiprocessing joins them at exit) would wait for ever.
        children.terminate()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if server is not None:
            server.shutdown()


def _inspect_ahead(cfg: WorkerConfig) -> model_info.Inspection | None:
    from mmworker.app import model_cache_dir

    return model_info.inspect_ahead(
        resolve_model(cfg.engine.model, model_cache_dir()), cfg.engine.pixels_on_engine
    )


def _in_turn(children: _Children, started: list[tuple[BaseProcess, Event]]) -> int:
    """Each engine loads once the one before it is up, so vLLM sizes its KV cache from the
    memory it sees free with no neighbour loading beside it."""
    for turn, (child, ready) in zip(children.turns, started, strict=True):
        turn.set()
        if (failed := children.start_failed(child, ready)) is not None:
            return failed
    return children.consume("")


def together_size(cfg: WorkerConfig) -> tuple[str, kv_sizes.KvSize] | None:
    """The key and KV cache size the children's engines can load together with, or None: one
    after another (one process, a shared core, a CPU host, the switch off, a size the user set,
    or none kept yet)."""
    engine = cfg.engine
    if (
        cfg.processes < 2
        or engine.shared_core
        or not engine.start_together
        or engine.kv_cache_memory_bytes is not None
    ):
        return None
    from mmworker.app import kv_size_key, make_engine

    first = child_config(cfg, 0)
    key = kv_size_key(first, make_engine(first))
    if key is None:
        return None
    size = kv_sizes.book_for(cfg.cache.directory).get(key)
    return None if size is None else (key, size)


def _serve_health(cfg: WorkerConfig) -> tuple[health.Processes | None, Any]:
    """One port for the pod: probes that pass only when every process passes, and one scrape
    with every process's series (label `worker_process`). Kubernetes probes one port; a wedged
    process other than the first would otherwise go unseen."""
    port = cfg.metrics_port
    if not port:
        return None, None
    ports = [child_config(cfg, i).metrics_port or 0 for i in range(cfg.processes)]
    supervisor = health.Processes(ports)
    registry = CollectorRegistry()
    registry.register(health.ProcessesCollector(ports))
    return supervisor, health.serve(port, registry, supervisor)


def _run_shared(children: _Children) -> int:
    """`engine.shared_core`: this process launches one engine core, the children attach to it
    as its front ends (all at once: there is one KV cache to size, not N). The core is stopped
    after the children, so every drained job still had its engine."""
    from mmworker.app import encoder_store_dir, model_cache_dir
    from mmworker.engine import (
        Engine,
        core_threads_env,
        encoder_widths,
        engine_process_env,
        resolve_model,
        shared_core,
    )

    cfg = children.cfg
    engine_process_env()
    lifeline.arm()  # the engine core leaves our process group and dies with this process
    model = resolve_model(cfg.engine.model, model_cache_dir())
    kwargs = Engine(
        cfg.engine,
        model,
        encoder_store=encoder_store_dir(cfg),
        progress_bars=cfg.logging.format == "text",  # the core loads the weights
        lanes=cfg.kafka.backfill_topic is not None,
    ).engine_kwargs()
    if "ec_transfer_config" in kwargs:  # a core this process forks runs no plugin of its own
        encoder_widths.skip_for_disk_store()
    started: list[tuple[BaseProcess, Event]] = []

    def start_clients(links: list[shared_core.CoreLink]) -> list[BaseProcess]:
        restore()  # the core has started; the clients keep their own OMP_NUM_THREADS
        started.extend(children.spawn(index, link) for index, link in enumerate(links))
        return children.procs

    restore = core_threads_env(cfg.engine)
    try:
        with shared_core.launch(kwargs, cfg.processes, start_clients):
            for child, ready in started:
                if (failed := children.start_failed(child, ready)) is not None:
                    return failed
            return children.consume(" on one engine core")
    finally:
        restore()


class _Children:
    """The worker processes of one run. They start (`spawn`, `start_failed`) and consume
    (`consume`) as a set: `go` holds every one back until all are ready, and the first to
    fail, in start-up or after, takes the others down."""

    def __init__(self, cfg: WorkerConfig, stopping: Callable[[], bool]) -> None:
        self.cfg = cfg
        self.ctx = multiprocessing.get_context("spawn")  # no inherited CUDA state or threads
        self.go = self.ctx.Event()
        self.procs: list[BaseProcess] = []
        #: Child i's engine loads once turns[i] is set (`run_processes` sets them one by one, or
        #: all at once when `planned` holds the KV cache bytes each engine is given).
        self.turns: list[Event] = []
        self.planned: Any = self.ctx.Value("q", 0)
        self._stopping = stopping
        self._grace = cfg.limits.shutdown_grace_s + 60
        #: pids a stop signal was sent to
        self.signalled: set[int] = set()

    def spawn(self, index: int, core: CoreLink | None = None) -> tuple[BaseProcess, Event]:
        """Start child `index` (listed at once, so a signal reaches it); the event is set by the
        child once its engine is up."""
        ready = self.ctx.Event()
        turn = self.ctx.Event()
        self.turns.append(turn)
        child = self.ctx.Process(
            target=_child_main,
            args=(child_config(self.cfg, index), ready, self.go, core, turn, self.planned),
            name=f"mmworker-{index}",
        )
        child.start()
        self.procs.append(child)
        return child, ready

    def start_failed(self, child: BaseProcess, ready: Event) -> int | None:
        """Wait for `child` to be ready; if it died first, or a stop was asked for meanwhile,
        stop every child and return the exit code (the set runs whole or not at all)."""
        while not ready.wait(0.5):
            if child.exitcode is not None:
                break
            if self._stopping() and child.pid is not None and child.pid not in self.signalled:
                # A stop that reached no process of this set (it came between a child's start
                # and its listing, or went to a set replaced since): one SIGTERM, as `forward`
                # gives (a second one would make the child exit at once, undrained).
                os.kill(child.pid, signal.SIGTERM)
                self.signalled.add(child.pid)
        if ready.is_set() and not self._stopping():
            return None
        log.error("%s did not start (exit %s)", child.name, child.exitcode)
        self.terminate()
        if self._stopping():  # children that stopped as asked exit 0, and so does the set
            return self.exit_code()
        return self.exit_code() or ExitCode.START_FAILED

    def consume(self, how: str) -> int:
        """Every child is ready: all consume at once (one rebalance, not N); returns when all
        have exited, the first to exit on its own stopping the rest."""
        log.info("%d worker processes ready%s: consuming", len(self.procs), how)
        self.go.set()
        brought_down = False
        while alive := [c for c in self.procs if c.exitcode is None]:
            wait([c.sentinel for c in alive], timeout=1.0)  # returns as soon as one exits
            gone = [c for c in self.procs if c.exitcode is not None]
            if gone and not brought_down and not self._stopping():
                first = gone[0]
                log.error("%s exited (%s): stopping the other workers", first.name, first.exitcode)
                self.terminate()
                brought_down = True
        return self.exit_code()

    def send(self, signum: int, once: bool = False) -> None:
        """`once`: not to a child signalled before (a second stop makes it exit undrained)."""
        for child in self.procs:
            if child.pid is None or child.exitcode is not None:
                continue
            if once and child.pid in self.signalled:
                continue
            os.kill(child.pid, signum)
            self.signalled.add(child.pid)

    def terminate(self) -> None:
        """SIGTERM every child (they drain), then SIGKILL what is still there after the grace.
        `go` and every turn are set first: a child still waiting for one would otherwise never
        get past start-up."""
        for turn in self.turns:
            turn.set()
        self.go.set()
        self.send(signal.SIGTERM, once=True)
        deadline = time.monotonic() + self._grace
        for child in self.procs:
            child.join(max(0.0, deadline - time.monotonic()))
            if child.exitcode is None:
                log.error("%s did not stop within %.0fs: killing it", child.name, self._grace)
                child.kill()
                child.join()

    def exit_code(self) -> int:
        return combined_exit_code([c.exitcode for c in self.procs])


def _as_exit_code(code: int | None) -> int:
    if code is None:
        return ExitCode.START_FAILED
    return 128 - code if code < 0 else code  # multiprocessing reports death by signal N as -N


def _child_main(
    cfg: WorkerConfig, ready: Event, go: Event, core: CoreLink | None, turn: Event, planned: Any
) -> None:
    """Entry of a spawned child: its own session, so a terminal's Ctrl-C reaches it only once
    (through the parent), and tied to the parent's life, so a killed supervisor leaves no orphan
    consumers behind (as a container runtime would kill them all)."""
    # First, before the heavy import below (seconds): a terminal's Ctrl-C in that window reached
    # the child directly as well as through the parent, and a stop there left a traceback.
    stop_on_signals()
    os.setsid()
    die_with_parent()
    logs.setup(cfg.log_level, tag=cfg.worker_id, fmt=cfg.logging.format)

    def my_turn() -> int:
        """Wait to load the engine; the KV cache bytes it is given (0: it profiles)."""
        turn.wait()
        return int(planned.value)

    try:
        from mmworker.app import run_worker

        code = run_worker(
            cfg,
            ready=ready.set,
            go=go.wait,
            core=core,
            turn=my_turn if core is None else None,  # a shared core is up already
        )
    except BaseException as exc:  # noqa: BLE001 - each way out has its exit code
        code = _child_exit(exc, cfg.worker_id, ready.is_set())
    exit_now(code)


def _child_exit(exc: BaseException, worker_id: str, ready: bool) -> int:
    """The exit code of a worker process that ended in `exc`: as `mmworker run` with one
    process reports it. Whatever error a start-up signal caused is that signal (a stop as asked,
    0), also when a step wrapped it in an error of its own."""
    if signal_behind(exc) is not None:
        return ExitCode.OK
    if isinstance(exc, WorkerError):
        log.error("%s: %s", worker_id, exc.message)
        return ExitCode.USAGE
    if not isinstance(exc, Exception):
        raise exc  # SystemExit and the like: as they would without this handler
    # Logged with its traceback, then the same exit as every other: a Kafka client thread or
    # the preprocessing pool must not hold it (the interpreter's exit hooks join them).
    log.error("%s failed", worker_id, exc_info=exc)
    return ExitCode.INTERNAL if ready else ExitCode.START_FAILED
