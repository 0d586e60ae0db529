"""MediaStage on a real disk cache and thread pools (no engine, no broker)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mmworker.cache import DiskFeatureCache
from mmworker.config import PreprocessConfig
from mmworker.media import MediaStage, PreparedMedia
from mmworker.samples import sample_image
from preprocess.errors import ForbiddenUri
from schemas import Job, MediaRef


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


class _SlowCountingPool(ThreadPoolExecutor):
    """Counts decodes and holds each for 0.5 s, so every job of a burst arrives while it runs."""

    def __init__(self) -> None:
        super().__init__(2)
        self.submitted: list[str] = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        self.submitted.append(getattr(fn, "__name__", repr(fn)))

        def slow():  # type: ignore[no-untyped-def]
            time.sleep(0.5)
            return fn(*args, **kwargs)

        return super().submit(slow)


def test_concurrent_jobs_on_the_same_media_share_one_decode(tmp_path: Path) -> None:
    data = sample_image(1280, 960, seed=8)
    cpu = _SlowCountingPool()
    io = ThreadPoolExecutor(4)
    cache = DiskFeatureCache(tmp_path / "cache", max_bytes=64 * 1024 * 1024)
    stage = MediaStage(PreprocessConfig(), cache, cpu_pool=cpu, io_pool=io, writer=io)

    async def burst() -> list[list[PreparedMedia]]:
        jobs = [Job(job_id=f"j{i}", media=[MediaRef(data=data)]) for i in range(4)]
        return await asyncio.gather(*(stage.prepare(job) for job in jobs))

    results = [media for (media,) in asyncio.run(burst())]
    assert cpu.submitted.count("prepare_media") == 1
    assert sum(m.shared_decode for m in results) == 3
    assert not any(m.cache_hit for m in results)
    assert all(m.prepared is results[0].prepared for m in results)
    # Another size of the same image is another decode.
    small = Job(job_id="j5", media=[MediaRef(data=data)], image={"max_pixels": 64 * 28 * 28})
    (other,) = asyncio.run(stage.prepare(small))
    assert not other.shared_decode and other.key != results[0].key
    assert cpu.submitted.count("prepare_media") == 2
    cpu.shutdown()
    io.shutdown()
