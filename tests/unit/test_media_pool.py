"""A preprocessing process that dies, for real: killed while it decodes, or killed by the media.

MediaStage on a real spawn ProcessPoolExecutor (through `DecodePool`), no engine, no broker. The
decode function is swapped for a thin wrapper (`_hooked_prepare`, defined here so that the spawned
children import it too) that runs the real `prepare_media` unless a test arms it: armed, the child
announces its pid and waits to be SIGKILLed by the test; media ending in `_KILLER` make the child
SIGSEGV itself, every time, also when decoded alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
from mmworker_preprocess.errors import PreprocessError, UndecodableImage, UndecodableVideo
from mmworker_preprocess.params import ImageParams, VideoParams
from mmworker_preprocess.prepare import prepare_media
from mmworker_schemas import Job, MediaRef
from mmworker_schemas.codes import RETRYABLE_CODES, ErrorCode

from mmworker import media as media_module
from mmworker.cache import NullFeatureCache
from mmworker.config import PreprocessConfig
from mmworker.devkit.samples import sample_image
from mmworker.errors import PreprocessPoolDead
from mmworker.exits import ExitCode
from mmworker.jobs import JobRunner
from mmworker.media import DecodePool, MediaStage, PreparedMedia
from mmworker.metrics import Metrics
from mmworker.worker import Worker
from tests.media_videos import encode_video
from tests.unit.loopkit import DLQ, Clients, Consumer, Producer, Suspects, config, run_until

_HOOK_DIR = "MMWORKER_TEST_POOL_HOOK_DIR"
_KILLER = b"KILL-THE-DECODER"


def _hooked_prepare(data: bytes, image: Any, video: Any) -> Any:
    """Runs in a pool process. `arm` (created by the test) is taken by one decode only: that
    one writes its pid to `running` and waits (the test kills it meanwhile)."""
    if data.endswith(_KILLER):
        os.kill(os.getpid(), signal.SIGSEGV)
    hooks = Path(os.environ[_HOOK_DIR])
    try:
        (hooks / "arm").rename(hooks / f"taken-{os.getpid()}")
    except FileNotFoundError:
        pass
    else:
        (hooks / "running.part").write_text(str(os.getpid()))
        (hooks / "running.part").rename(hooks / "running")
        time.sleep(60)  # SIGKILLed by the test long before
    return prepare_media(data, image, video)


def _die_at_start() -> None:
    os._exit(3)


def _spawn_pool(initializer: Any = None) -> Any:
    def factory(workers: int) -> Executor:
        context = multiprocessing.get_context("spawn")
        return ProcessPoolExecutor(workers, mp_context=context, initializer=initializer)

    return factory


@pytest.fixture
def hooks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(_HOOK_DIR, str(tmp_path))  # before any pool exists: children inherit it
    monkeypatch.setattr(media_module, "prepare_media", _hooked_prepare)
    return tmp_path


def _stage(pool: DecodePool) -> tuple[MediaStage, ThreadPoolExecutor]:
    io = ThreadPoolExecutor(4)
    return MediaStage(PreprocessConfig(), NullFeatureCache(), pool, io, writer=io), io


def _job(job_id: str, data: bytes) -> Job:
    return Job(job_id=job_id, media=[MediaRef(data=data)])


async def _prepare_all(stage: MediaStage, jobs: list[Job]) -> list[list[PreparedMedia] | Exception]:
    outcomes = await asyncio.gather(*(stage.prepare(job) for job in jobs), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
            raise outcome
    return list(outcomes)  # type: ignore[arg-type]


async def _wait_for(path: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} did not appear in {timeout_s}s")
        await asyncio.sleep(0.02)


def test_a_process_killed_while_it_decodes_costs_no_job_and_the_pool_is_rebuilt(
    hooks: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGKILL (the OOM killer's signal) of the process decoding one job, while two others are
    in the pool: all three get their result (each suspect decoded again alone is innocent), the
    pool is replaced once, and later jobs decode in the new pool."""
    images = [sample_image(640, 480, seed=s) for s in range(6)]
    pool = DecodePool(_spawn_pool(), workers=2)
    stage, io = _stage(pool)
    try:

        async def scenario() -> None:
            # Warm the processes first (spawn + imports take seconds on a loaded machine).
            assert all(not isinstance(o, Exception) for o in await _prepare_all(
                stage, [_job("warm-a", images[0]), _job("warm-b", images[1])]
            ))  # fmt: skip
            (hooks / "arm").touch()
            first = [_job(f"j{i}", images[i]) for i in range(2, 5)]
            running = asyncio.ensure_future(_prepare_all(stage, first))
            await _wait_for(hooks / "running")
            victim = int((hooks / "running").read_text())
            os.kill(victim, signal.SIGKILL)
            outcomes = await asyncio.wait_for(running, 180)
            for outcome in outcomes:
                assert not isinstance(outcome, Exception), repr(outcome)
            assert pool.rebuilds == 1
            assert "its pool is replaced" in caplog.text
            assert caplog.text.count("decoding it again alone") >= 1  # the victim, at least
            # Later jobs: the shared pool works again (the killed process is not in it).
            later = await _prepare_all(stage, [_job("later", images[5]), _job("again", images[2])])
            for outcome in later:
                assert not isinstance(outcome, Exception), repr(outcome)
                assert outcome[0].kind == "image"
            assert pool.rebuilds == 1
            assert not stage._crashed  # nobody was convicted

        asyncio.run(scenario())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        io.shutdown()


def _probe_crashes_on_the_killer() -> None:
    """Pool initializer: FFmpeg's container probe segfaults on media ending in `_KILLER`, every
    time: a stand-in for a crafted container that crashes libavformat."""
    from mmworker_preprocess import sniff as sniff_module

    probe = sniff_module._probe_video

    def crashing(data: bytes) -> Any:
        if data.endswith(_KILLER):
            os.kill(os.getpid(), signal.SIGSEGV)
        return probe(data)

    sniff_module._probe_video = crashing


def test_a_container_that_crashes_ffmpegs_probe_kills_a_pool_process_not_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Media with no signature (NUT, ASF, MXF...) is a video only if FFmpeg's probe says so.
    That probe ran in the worker's own process: a container that crashes it killed the worker,
    and again at each redelivery, so its partition stopped there. It runs in the pool now, for
    whole media and for segment mode, and the media is refused like one that kills its
    decoder."""
    from mmworker_preprocess import sniff as sniff_module

    def in_the_worker(data: bytes) -> Any:
        raise AssertionError("FFmpeg's probe ran in the worker's own process")

    monkeypatch.setattr(sniff_module, "_probe_video", in_the_worker)
    nut = encode_video("mpeg4", container="nut", n_frames=30)
    killer = nut + _KILLER
    pool = DecodePool(_spawn_pool(_probe_crashes_on_the_killer), workers=2)
    stage, io = _stage(pool)
    try:

        async def scenario() -> None:
            assert await stage.kind(nut, "nut") == "video"  # probed in the pool
            with pytest.raises(UndecodableVideo, match="died reading this media's container"):
                await asyncio.wait_for(stage.kind(killer, "killer"), 180)
            assert "probe:killer" in stage._crashed  # its repeats are probed alone
            rebuilds = pool.rebuilds
            with pytest.raises(UndecodableVideo):
                await asyncio.wait_for(stage.kind(killer, "killer"), 180)
            assert pool.rebuilds == rebuilds  # the shared pool was not broken again
            jobs = [_job("killer", killer), _job("nut", nut), _job("still", sample_image(64, 48))]
            refused, *others = await asyncio.wait_for(_prepare_all(stage, jobs), 180)
            assert isinstance(refused, UndecodableVideo), repr(refused)
            assert not refused.retryable
            assert [o[0].kind for o in others] == ["video", "image"], others  # type: ignore[index]

        asyncio.run(scenario())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        io.shutdown()


def test_media_that_kills_its_decoder_is_refused_and_everything_else_flows(
    hooks: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file whose decode segfaults the process, every time: its job gets a typed, permanent
    refusal (undecodable_image); the jobs that shared the pool with it and the jobs after it get
    their results; a repeat of the file is decoded alone at once and breaks no pool again."""
    killer = sample_image(640, 480, seed=20) + _KILLER
    good = [sample_image(800, 600, seed=s) for s in range(21, 26)]
    pool = DecodePool(_spawn_pool(), workers=2)
    stage, io = _stage(pool)
    try:

        async def scenario() -> None:
            jobs = [
                _job("innocent-1", good[0]),
                _job("killer", killer),
                _job("innocent-2", good[1]),
            ]
            outcomes = await asyncio.wait_for(_prepare_all(stage, jobs), 180)
            refused = outcomes[1]
            assert isinstance(refused, UndecodableImage), repr(refused)
            assert refused.code is ErrorCode.UNDECODABLE_IMAGE and not refused.retryable
            assert ErrorCode.UNDECODABLE_IMAGE not in RETRYABLE_CODES
            assert "died" in refused.message
            for outcome in (outcomes[0], outcomes[2]):
                assert not isinstance(outcome, Exception), repr(outcome)
            assert pool.rebuilds == 1
            assert caplog.text.count("killed the image decoder's process on its own") == 1
            later = await _prepare_all(
                stage, [_job(f"later-{i}", g) for i, g in enumerate(good[2:])]
            )
            assert all(not isinstance(o, Exception) for o in later), later
            # The same media again (a redelivery, a duplicate job): refused again, decoded alone,
            # and the shared pool is not broken a second time.
            (again,) = await _prepare_all(stage, [_job("killer-again", killer)])
            assert isinstance(again, UndecodableImage)
            assert pool.rebuilds == 1

        asyncio.run(scenario())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        io.shutdown()


def test_processes_that_cannot_live_at_all_stop_the_worker_rather_than_refuse_media(
    hooks: Path,
) -> None:
    """If even a trivial call kills a fresh process, no media is to blame: PreprocessPoolDead,
    which JobRunner lets through to the worker (exit 5, uncommitted), not a refusal."""
    pool = DecodePool(_spawn_pool(_die_at_start), workers=1)
    stage, io = _stage(pool)
    try:
        with pytest.raises(PreprocessPoolDead) as dead:
            asyncio.run(
                asyncio.wait_for(stage.prepare(_job("j", sample_image(320, 240, seed=1))), 180)
            )
        assert not isinstance(dead.value, PreprocessError)
        assert not stage._crashed
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        io.shutdown()


def test_a_pool_broken_while_idle_is_replaced_before_the_next_decode(hooks: Path) -> None:
    """A process killed between decodes (nothing of any job ran in it): the next decode finds
    the pool broken at submit, and runs in a new one without a suspect's detour."""
    pool = DecodePool(_spawn_pool(), workers=1)
    stage, io = _stage(pool)
    try:

        async def scenario() -> None:
            (first,) = await _prepare_all(stage, [_job("a", sample_image(320, 240, seed=2))])
            assert not isinstance(first, Exception), repr(first)
            broken = pool.executor
            for process in list(multiprocessing.active_children()):
                os.kill(process.pid, signal.SIGKILL)  # type: ignore[arg-type]
            deadline = time.monotonic() + 30
            while not getattr(broken, "_broken", False):  # the pool notices on its own
                assert time.monotonic() < deadline, "the pool did not notice its dead process"
                await asyncio.sleep(0.02)
            (second,) = await _prepare_all(stage, [_job("b", sample_image(320, 240, seed=3))])
            assert not isinstance(second, Exception), repr(second)
            assert pool.executor is not broken and pool.rebuilds == 1

        asyncio.run(scenario())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        io.shutdown()


def test_a_dead_pool_stops_the_worker_with_exit_5_uncommitted_and_dead_letters_nothing() -> None:
    """PreprocessPoolDead goes through JobRunner's retry loop untouched (as EngineFatal does):
    the worker stops with the exit code of an unexpected error, commits nothing, and the job
    is redelivered to the restarted worker instead of dead-lettered."""
    cfg = config(max_attempts=3, retry_backoff_s=0.01)
    metrics = Metrics()
    runner = JobRunner(cfg, engine=None, media=None, metrics=metrics)  # type: ignore[arg-type]
    attempts = []

    async def attempt(*_a: Any) -> Any:
        attempts.append(1)
        raise PreprocessPoolDead("preprocessing processes die even without media to decode")

    runner._attempt = attempt  # type: ignore[method-assign]
    consumer, producer = Consumer({0: 1}), Producer()
    clients = Clients(consumer, producer, Suspects())
    worker = Worker(cfg, runner, metrics, "tiny", clients=clients)  # type: ignore[arg-type]
    code = asyncio.run(run_until(worker, lambda: worker.fatal is not None))
    assert code == ExitCode.INTERNAL == 5
    assert attempts == [1]  # not retried
    assert producer.on(DLQ) == [] and consumer.commits == []


def _pid_after_decode(data: bytes) -> tuple[int, Any]:
    return os.getpid(), prepare_media(data, ImageParams(), VideoParams())


def test_the_pool_is_replaced_by_fresh_processes_every_recycle_after_decodes() -> None:
    """Decoder memory grows slowly with what a process has decoded; a fresh pool every
    `recycle_after` calls bounds it. Calls in flight at the switch finish in the old pool, whose
    processes then exit; none of them fails."""
    pool = DecodePool(_spawn_pool(), workers=1, recycle_after=3)
    image = sample_image(64, 48, seed=5)

    async def scenario() -> list[int]:
        pids = []
        for _ in range(7):
            pid, prepared = await pool.run(_pid_after_decode, image)
            assert prepared.pixels.size
            pids.append(pid)
        # Several at once across a switch: every one answered.
        many = await asyncio.gather(*(pool.run(_pid_after_decode, image) for _ in range(5)))
        assert all(prepared.pixels.size for _, prepared in many)
        return pids

    try:
        first = pool.executor
        pids = asyncio.run(scenario())
        assert len(set(pids[:3])) == 1 and len(set(pids[3:6])) == 1, pids
        assert len({pids[0], pids[3], pids[6]}) == 3, pids
        assert pool.recycles == 3 and pool.rebuilds == 0
        assert pool.executor is not first
        with contextlib.suppress(psutil.NoSuchProcess):
            _, alive = psutil.wait_procs([psutil.Process(pids[0])], timeout=20)
            assert not alive, "the replaced pool's process did not exit"
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
