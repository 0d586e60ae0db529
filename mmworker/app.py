"""Wiring: config → metrics, cache, pools, engine, worker. Owns start-up order and teardown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

from mmworker_preprocess.prepare import warm_up

from mmworker import hardware, health, heap_trim, kv_sizes, lifeline, logs
from mmworker.broker_watch import quiet_connection_noise, watch_brokers
from mmworker.cache import DiskFeatureCache, FeatureCache, NullFeatureCache, prune_lru_files
from mmworker.config import WorkerConfig, cache_home
from mmworker.engine import Engine, frontend, model_info, preload, resolve_model
from mmworker.engine.shared_core import CoreLink
from mmworker.errors import ConfigError
from mmworker.exits import check_interrupted
from mmworker.jobs import JobRunner
from mmworker.kafka_io import ensure_worker_topics
from mmworker.media import DecodePool, MediaStage, lower_thread_priority
from mmworker.metrics import Metrics
from mmworker.recovery import STUCK_GRACE_S, EngineRecovery, ProbeReport
from mmworker.startup import StartupPhases
from mmworker.worker import Worker

log = logging.getLogger(__name__)

PRUNE_EVERY_S = 300.0
#: Interval of the worker's one-line progress summary while it has work.
SUMMARY_EVERY_S = 30.0


def make_cache(cfg: WorkerConfig) -> FeatureCache:
    if not cfg.cache.enabled:
        return NullFeatureCache()
    try:
        return DiskFeatureCache(
            cfg.cache.directory, cfg.cache.max_bytes, zstd_level=cfg.cache.zstd_level,
            part=cfg.cache.part,
        )  # fmt: skip
    except OSError as exc:  # a traceback from the middle of start-up said less
        raise ConfigError(
            f"cache.directory {str(cfg.cache.directory)!r} cannot be used ({exc.strerror or exc}):"
            " name a writable directory, or set cache.enabled = false"
        ) from exc


def encoder_store_dir(cfg: WorkerConfig) -> Path | None:
    """Root of vLLM's vision-encoder outputs kept across processes (None: not kept).

    The engine's store keeps each model's outputs in `<root>/<identity digest>/` (see
    `mmworker.engine.identity`), so models sharing this volume never read each other's; the
    root is what `_prune_forever` bounds: one budget over every model that has used it.
    """
    if not (cfg.cache.enabled and cfg.cache.encoder_outputs):
        return None
    path = cfg.cache.directory / "encoder"
    path.mkdir(parents=True, exist_ok=True)
    return path


async def _prune_forever(
    root: Path, max_bytes: int, pool: ThreadPoolExecutor, metrics: Metrics
) -> None:
    loop = asyncio.get_running_loop()
    kept = metrics.encoder_store_bytes.set
    while True:
        try:
            freed = await loop.run_in_executor(
                pool, lambda: prune_lru_files(root, max_bytes, kept=kept)
            )
        except OSError as exc:  # e.g. permissions: keep serving, try again next round
            log.warning("encoder store: pruning failed: %s", exc)
        else:
            if freed:
                log.info("encoder store: pruned %.1f MB", freed / 1e6)
        await asyncio.sleep(PRUNE_EVERY_S)


async def _summarise_forever(metrics: Metrics, every_s: float = SUMMARY_EVERY_S) -> None:
    """One line per `every_s` while there is work: what the worker is doing, without turning
    on DEBUG or scraping metrics. Silent while idle."""
    sample = metrics.registry.get_sample_value
    last = 0.0
    while True:
        await asyncio.sleep(every_s)
        ok = sample("mmworker_jobs_total", {"outcome": "result"}) or 0.0
        failed = sample("mmworker_jobs_total", {"outcome": "failure"}) or 0.0
        held = sample("mmworker_in_flight") or 0.0
        if ok + failed == last and not held:
            continue
        log.info(
            "%d ok, %d failed, %d in flight; %.2f jobs/s over the last %gs",
            ok, failed, held, (ok + failed - last) / every_s, every_s,
        )  # fmt: skip
        last = ok + failed


async def _beat_forever(state: health.Health) -> None:
    """The event loop's proof of life for /livez (see mmworker.health)."""
    while True:
        state.beat()
        await asyncio.sleep(state.beat_every_s())


def model_cache_dir() -> Path:
    """Where the `tiny` test model is built once per machine."""
    return cache_home() / "mmworker" / "models"


def make_engine(cfg: WorkerConfig, core: CoreLink | None = None) -> Engine:
    """The worker's engine as `cfg` asks for it; `mmworker.processes` builds the same one to
    know its arguments before the children load it."""
    return Engine(
        cfg.engine,
        resolve_model(cfg.engine.model, model_cache_dir()),
        encoder_store=encoder_store_dir(cfg),
        core=core,
        # A progress bar is a terminal's; in a JSON log it is a line no parser can read.
        progress_bars=cfg.logging.format == "text",
        lanes=cfg.kafka.backfill_topic is not None,
    )


def kv_size_key(cfg: WorkerConfig, engine: Engine) -> str | None:
    """Key of the engine's KV cache size in the book (`mmworker.kv_sizes`); None where no
    size is kept: CPU hosts (a fixed budget, nothing profiled) or the cache turned off."""
    hw = hardware.probe()
    if not hw.gpu or not cfg.cache.enabled:
        return None
    return kv_sizes.size_key(engine.engine_kwargs(), hw)


def keep_kv_size(cfg: WorkerConfig, engine: Engine, planned: int) -> None:
    """After a start: keep the size a profiled start found, or check that a start given the
    kept size (`planned` bytes) got the same blocks, forgetting it if not."""
    key = kv_size_key(cfg, engine)
    size = engine.kv_size()
    if key is None or size is None:
        return
    book = kv_sizes.book_for(cfg.cache.directory)
    if not planned:
        if cfg.engine.kv_cache_memory_bytes is None:
            book.put(key, size)
        return
    known = book.get(key)
    if known is not None and known.blocks != size.blocks:
        log.warning(
            "engine got %d KV blocks from the kept size, %d when it was measured: forgetting "
            "the size, the next start profiles",
            size.blocks, known.blocks,
        )  # fmt: skip
        book.forget(key)


def run_worker(
    cfg: WorkerConfig,
    create_topics: int | None = None,
    ready: Callable[[], object] | None = None,
    go: Callable[[], object] | None = None,
    core: CoreLink | None = None,
    turn: Callable[[], int] | None = None,
) -> int:
    """Start everything, consume until stopped, tear down; returns the process exit code.

    `turn` (blocking) is called before the engine loads, `ready` once it is up and `go`
    (blocking) before the first poll: the hooks `mmworker.processes` uses to start several
    processes at once, load their engines one at a time (or together, `turn` then returning
    the KV cache bytes each is given) and then consume.
    `core`: attach to the supervisor's shared engine core instead of starting an engine.
    """
    logs.quiet_libraries(
        cfg.log_level, cfg.logging.format
    )  # before vLLM starts: its processes read it at start
    if not frontend.keeps_heap(cfg.engine.frontend_keep_heap, gpu=hardware.probe().gpu):
        heap_trim.limit_arenas(heap_trim.WORKER_ARENAS)  # before the worker's threads start
    return asyncio.run(_serve(cfg, create_topics, ready, go, core, turn))


async def _serve(
    cfg: WorkerConfig,
    create_topics: int | None,
    ready: Callable[[], object] | None,
    go: Callable[[], object] | None,
    core: CoreLink | None = None,
    turn: Callable[[], int] | None = None,
) -> int:
    # The engine is built inside the running loop: AsyncLLM binds its output handler to it.
    metrics = Metrics()
    probes = health.Health(cfg.health)
    metrics.ready.set_function(probes.ready)
    beating = asyncio.create_task(_beat_forever(probes))
    server = None
    if cfg.metrics_port is not None:
        # First: /startupz must answer during the model load it reports on.
        server = health.serve(cfg.metrics_port, metrics.registry, probes)
    cache = make_cache(cfg)
    metrics.feature_cache_bytes.set_function(lambda: cache.stats().bytes)
    metrics.feature_cache_entries.set_function(lambda: cache.stats().entries)
    # spawn: pool processes must not inherit the engine's threads or CUDA state. A DecodePool
    # replaces the pool when one of its processes dies (mmworker.media.DecodePool).
    cpu_pool = DecodePool(
        lambda workers: ProcessPoolExecutor(
            workers,
            mp_context=lifeline.PoolContext(),
            initializer=lifeline.pool_child,
            initargs=(cfg.log_level, cfg.logging.format),
        ),
        cfg.preprocess.workers,
        recycle_after=cfg.preprocess.recycle_after,
    )
    io_pool = ThreadPoolExecutor(32, thread_name_prefix="io")
    writer = ThreadPoolExecutor(1, "cache-write", initializer=lower_thread_priority)
    engine: Engine | None = None
    store = encoder_store_dir(cfg)
    pruning = None
    summary: asyncio.Task[None] | None = None
    calming: asyncio.Task[None] | None = None
    if store is not None:
        pruning = asyncio.create_task(
            _prune_forever(store, cfg.cache.encoder_max_bytes, io_pool, metrics)
        )
    phases = StartupPhases()
    told: asyncio.Task[None] | None = None
    watching: asyncio.Task[None] | None = None
    try:
        looking: list[str] = []  # several processes: their supervisor has it taken before the turns
        if turn is None and core is None:
            model_path = resolve_model(cfg.engine.model, model_cache_dir())
            looking = model_info.pending(model_path, cfg.engine.pixels_on_engine)
        if looking:  # new vLLM caches: its look at the model class, beside the import
            phases.begin("importing vLLM (its look at the model class and the preprocessing "
                         "pool beside it)")  # fmt: skip
        else:
            phases.begin(
                f"{'loading the model' if turn is None else 'importing vLLM'} (the preprocessing "
                "pool warms up beside it)"
            )
        warming = [cpu_pool.executor.submit(warm_up) for _ in range(cfg.preprocess.workers)]
        if create_topics:
            ensure_worker_topics(cfg.kafka, create_topics)
        lifeline.arm()  # vLLM's processes leave our process group and die with us
        heap_trim.start()  # freed heap memory goes back to the system (soak: flat memory)
        planned = 0
        if looking:
            inspecting = None
            try:
                inspecting = model_info.start(looking)  # after arm(): tied to us as vLLM's own
                preload()
                phases.begin("waiting for vLLM's look at the model class")
                await asyncio.to_thread(inspecting.wait)
            finally:
                if inspecting is not None:
                    inspecting.stop()  # a signal cut the start-up short
            check_interrupted()
            phases.begin("loading the model")
        elif turn is not None:
            preload()  # in the main thread: an import may install signal handlers
            phases.begin("waiting for the turn to load the engine")
            planned = await asyncio.to_thread(turn)
            check_interrupted()
            if planned:
                engine_cfg = cfg.engine.model_copy(update={"kv_cache_memory_bytes": planned})
                cfg = cfg.model_copy(update={"engine": engine_cfg})
                phases.begin(f"loading the model beside the others ({planned / 2**30:.2f} GiB KV)")
            else:
                phases.begin("loading the model now that the engine before it is up")
        engine = make_engine(cfg, core)
        check_interrupted()
        engine.start()
        check_interrupted()
        if turn is not None and cfg.engine.start_together:
            keep_kv_size(cfg, engine, planned)
        metrics.engine_busy_seconds.set_function(engine.busy_seconds)
        metrics.watch_engine(engine.state)
        probes.engine = health.EngineProbe(alive=engine.alive, progress=engine.progress)
        phases.begin("waiting for the preprocessing pool")
        for f in warming:
            f.result()
        probes.started = True
        if ready is not None:
            ready()
        if go is not None:
            phases.begin("waiting for the other worker processes' engines")
            await asyncio.to_thread(go)
        phases.begin("checking the configured tasks")
        media = MediaStage(
            cfg.preprocess, cache, cpu_pool, io_pool, cfg.cache.min_image_pixels, writer
        )
        runner = JobRunner(cfg, engine, media, metrics)
        await runner.check_tasks()
        check_interrupted()
        recovery = None
        if core is None:  # a shared core belongs to the supervisor, which replaces the process
            recovery = EngineRecovery(
                cfg.limits, engine, runner, ProbeReport(metrics, probes),
                stuck_after_s=cfg.health.engine_stall_s,
            )  # fmt: skip
            probes.stall_grace_s = STUCK_GRACE_S
            calming = asyncio.create_task(recovery.calm_forever())
        worker = Worker(
            cfg, runner, metrics, model=cfg.engine.model, health=probes, recovery=recovery
        )
        phases.begin("connecting to the brokers and joining the group")
        told = asyncio.create_task(phases.log_when(lambda: probes.assigned() > 0))
        if cfg.log_level != "DEBUG":
            quiet_connection_noise()
        watching = asyncio.create_task(watch_brokers(cfg.kafka))
        log.info("worker %s consuming %s", cfg.worker_id, cfg.kafka.input_topic)
        summary = asyncio.create_task(_summarise_forever(metrics))
        code = await worker.run()
        stats = cache.stats()
        log.info(
            "stopped (exit %d); feature cache hits=%d misses=%d; engine busy %.1fs",
            code, stats.hits, stats.misses, engine.busy_s,
        )  # fmt: skip
        return code
    finally:
        probes.stopping = True
        beating.cancel()
        if server is not None:
            server.shutdown()
        if summary is not None:
            summary.cancel()
        if calming is not None:
            calming.cancel()
        if told is not None:
            told.cancel()
        if watching is not None:
            watching.cancel()
        if pruning is not None:
            pruning.cancel()
        if engine is not None:
            engine.shutdown()
        cpu_pool.shutdown(cancel_futures=True)
        io_pool.shutdown(cancel_futures=True)
        writer.shutdown(wait=True)  # what was prepared is worth keeping for the next process
