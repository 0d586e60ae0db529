"""MediaStage on a real disk cache and thread pools (no engine, no broker)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from mmworker_preprocess.errors import ForbiddenUri, UndecodableImage
from mmworker_schemas import Job, MediaRef

from mmworker.cache import DiskFeatureCache
from mmworker.config import PreprocessConfig
from mmworker.devkit.samples import sample_image
from mmworker.media import MediaStage, PreparedMedia


def _stage(tmp_path: Path, roots: tuple[Path, ...]) -> tuple[MediaStage, ThreadPoolExecutor]:
    cfg = PreprocessConfig(allowed_roots=roots)
    cache = DiskFeatureCache(tmp_path / "cache", max_bytes=64 * 1024 * 1024)
    pool = ThreadPoolExecutor(2)
    # writer=pool: the test waits for the write by shutting the pool down.
    return MediaStage(cfg, cache, cpu_pool=pool, io_pool=pool, writer=pool), pool


def test_declared_hash_hit_still_obeys_the_uri_rules(tmp_path: Path) -> None:
    """A cache hit by declared sha256 skips the fetch, not the rules on where media come from."""
    allowed, secret = tmp_path / "allowed", tmp_path / "secret"
    allowed.mkdir()
    secret.mkdir()
    data = sample_image(640, 480, seed=5)
    (allowed / "a.jpg").write_bytes(data)
    (secret / "a.jpg").write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()

    stage, pool = _stage(tmp_path, (allowed,))
    first = asyncio.run(
        stage.prepare(Job(job_id="j1", media=[MediaRef(uri=(allowed / "a.jpg").as_uri())]))
    )
    assert not first[0].cache_hit
    pool.shutdown(wait=True)  # the background cache write is done

    stage, pool = _stage(tmp_path, (allowed,))
    hit = asyncio.run(
        stage.prepare(
            Job(job_id="j2", media=[MediaRef(uri=(allowed / "a.jpg").as_uri(), sha256=sha)])
        )
    )
    assert hit[0].cache_hit and hit[0].fetch_s == 0.0
    forbidden = Job(job_id="j3", media=[MediaRef(uri=(secret / "a.jpg").as_uri(), sha256=sha)])
    with pytest.raises(ForbiddenUri):
        asyncio.run(stage.prepare(forbidden))
    pool.shutdown(wait=True)


def test_inline_bytes_beside_another_medias_hash_are_a_checksum_mismatch(tmp_path: Path) -> None:
    """Inline bytes with the declared hash of a cached media got that media's features (and its
    caption): the declared-hash shortcut is for URIs, whose bytes are not here yet."""
    from mmworker_preprocess.errors import ChecksumMismatch

    cached = sample_image(640, 480, seed=5)
    other = sample_image(640, 480, seed=6)
    stage, pool = _stage(tmp_path, ())
    asyncio.run(stage.prepare(Job(job_id="j1", media=[MediaRef(data=cached)])))
    pool.shutdown(wait=True)  # the background cache write is done

    stage, pool = _stage(tmp_path, ())
    borrowed = MediaRef(data=other, sha256=hashlib.sha256(cached).hexdigest())
    with pytest.raises(ChecksumMismatch):
        asyncio.run(stage.prepare(Job(job_id="j2", media=[borrowed])))
    pool.shutdown(wait=True)


class _GatedPool(ThreadPoolExecutor):
    """One worker thread; every task waits for `gate`, so the test decides when decodes run."""

    def __init__(self) -> None:
        super().__init__(1)
        self.gate = threading.Event()
        self.started: list[str] = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        def gated():  # type: ignore[no-untyped-def]
            self.gate.wait(30)
            self.started.append(getattr(fn, "__name__", repr(fn)))
            return fn(*args, **kwargs)

        return super().submit(gated)


def _gated_stage(tmp_path: Path) -> tuple[MediaStage, _GatedPool, ThreadPoolExecutor]:
    cpu, io = _GatedPool(), ThreadPoolExecutor(4)
    cache = DiskFeatureCache(tmp_path / "cache", max_bytes=64 * 1024 * 1024)
    return MediaStage(PreprocessConfig(), cache, cpu_pool=cpu, io_pool=io, writer=io), cpu, io


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(3000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in 30 s")


def test_concurrent_jobs_on_the_same_media_share_one_decode(tmp_path: Path) -> None:
    data = sample_image(1280, 960, seed=8)
    stage, cpu, io = _gated_stage(tmp_path)

    async def burst() -> list[PreparedMedia]:
        jobs = [Job(job_id=f"j{i}", media=[MediaRef(data=data)]) for i in range(4)]
        tasks = [asyncio.ensure_future(stage.prepare(job)) for job in jobs]
        await _until(lambda: sum(d.waiters for d in stage._decoding.values()) == 4)
        cpu.gate.set()
        return [media for (media,) in await asyncio.gather(*tasks)]

    results = asyncio.run(burst())
    assert cpu.started.count("prepare_media") == 1
    assert sum(m.shared_decode for m in results) == 3
    assert not any(m.cache_hit for m in results)
    assert all(m.prepared is results[0].prepared for m in results)
    # Another size of the same image is another decode.
    small = Job(job_id="j5", media=[MediaRef(data=data)], image={"max_pixels": 64 * 28 * 28})
    (other,) = asyncio.run(stage.prepare(small))
    assert not other.shared_decode and other.key != results[0].key
    assert cpu.started.count("prepare_media") == 2
    cpu.shutdown()
    io.shutdown()


def test_a_decode_nobody_waits_for_any_more_is_dropped_from_the_queue(tmp_path: Path) -> None:
    """What a job timeout did before decodes were shared: the queued work goes, not just the job."""
    stage, cpu, io = _gated_stage(tmp_path)
    job = Job(job_id="late", media=[MediaRef(data=sample_image(640, 480, seed=9))])
    cpu.submit(time.sleep, 0)  # holds the one thread at the gate: the decode stays queued

    async def give_up() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(stage.prepare(job), timeout=0.5)
        await _until(lambda: not stage._decoding)

    asyncio.run(give_up())
    cpu.gate.set()
    cpu.shutdown(wait=True)
    io.shutdown()
    assert cpu.started == ["sleep"]  # the decode was cancelled while queued: it never ran


def test_a_failed_shared_decode_fails_every_waiter_with_the_same_typed_error(
    tmp_path: Path,
) -> None:
    stage, cpu, io = _gated_stage(tmp_path)
    truncated = sample_image(640, 480, seed=10)[:500]

    async def burst() -> list[BaseException | list[PreparedMedia]]:
        jobs = [Job(job_id=f"bad{i}", media=[MediaRef(data=truncated)]) for i in range(3)]
        tasks = [asyncio.ensure_future(stage.prepare(job)) for job in jobs]
        await _until(lambda: sum(d.waiters for d in stage._decoding.values()) == 3)
        cpu.gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    outcomes = asyncio.run(burst())
    assert [type(o) for o in outcomes] == [UndecodableImage] * 3
    assert cpu.started.count("prepare_media") == 1
    assert not stage._decoding
    cpu.shutdown()
    io.shutdown()


def test_a_budget_reaches_the_params_and_the_key_only_when_it_binds(tmp_path: Path) -> None:
    from mmworker_preprocess.tokens import image_tokens

    from mmworker.media import TokenBudget

    data = sample_image(1280, 960, seed=11)
    stage, pool = _stage(tmp_path, ())
    job = Job(job_id="b", media=[MediaRef(data=data)])
    (free,) = asyncio.run(stage.prepare(job))
    (roomy,) = asyncio.run(stage.prepare(job, [TokenBudget(image=16384, video=16384)]))
    (fitted,) = asyncio.run(stage.prepare(job, [TokenBudget(image=300, video=None)]))
    pool.shutdown(wait=True)
    assert image_tokens(*free.prepared.pixels.shape[:2]) > 300
    # A budget it fits changes nothing, not even the key (vLLM's caches are keyed by it).
    assert roomy.key == free.key and roomy.cache_hit
    assert fitted.key != free.key and not fitted.cache_hit
    assert image_tokens(*fitted.prepared.pixels.shape[:2]) <= 300


def test_features_prepared_without_a_budget_serve_a_budget_they_fit(tmp_path: Path) -> None:
    """Jobs that differ only in max_tokens (a budget that might bind, so part of the key) must
    still share features when the unfitted ones fit: fitting would have changed nothing."""
    from mmworker_preprocess.tokens import video_tokens

    from mmworker.devkit.samples import sample_video
    from mmworker.media import TokenBudget

    stage, pool = _stage(tmp_path, ())
    job = Job(job_id="v", media=[MediaRef(data=sample_video(seconds=3))])
    (free,) = asyncio.run(stage.prepare(job))
    need = video_tokens(*free.prepared.frames.shape[:3])
    (fits,) = asyncio.run(stage.prepare(job, [TokenBudget(image=None, video=need + 100)]))
    (tight,) = asyncio.run(stage.prepare(job, [TokenBudget(image=None, video=need // 2)]))
    pool.shutdown(wait=True)
    assert fits.cache_hit and fits.key == free.key
    assert not tight.cache_hit and tight.key != free.key
    assert video_tokens(*tight.prepared.frames.shape[:3]) <= need // 2
