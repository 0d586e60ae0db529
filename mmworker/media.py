"""The media stage of a job: fetch → hash → feature cache → decode/resize in a process pool.

Fetching is I/O and runs in threads; decoding and resizing hold the GIL and run in processes, so
neither stalls the event loop that keeps the engine fed. A job whose media all hit the cache costs
one hash and one zstd decode per item.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from mmworker.cache import FeatureCache, make_key
from mmworker.config import PreprocessConfig
from preprocess.fetch import FetchHandle, check_allowed, fetch_bytes
from preprocess.params import ImageParams, PreparedImage, PreparedVideo, VideoParams
from preprocess.prepare import prepare_media
from preprocess.sniff import sniff
from preprocess.tokens import image_tokens, video_tokens
from schemas import Job, MediaRef

log = logging.getLogger(__name__)

#: Prepared media waiting for the cache writer; beyond this, new items are not cached.
MAX_PENDING_WRITE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class PreparedMedia:
    prepared: PreparedImage | PreparedVideo
    sha256: str
    #: Content + preprocessing parameters: the feature-cache key, and the `multi_modal_uuid`
    #: vLLM keys its processor, encoder and prefix caches by, so a repeat of the same media at
    #: another size or frame rate never gets the first one's features.
    key: str
    cache_hit: bool
    fetch_s: float
    preprocess_s: float
    #: Not a cache hit, but not decoded for this job either: it joined a decode in progress.
    shared_decode: bool = False

    @property
    def kind(self) -> str:
        return "image" if isinstance(self.prepared, PreparedImage) else "video"


@dataclass(frozen=True, slots=True)
class TokenBudget:
    """Visual tokens one item may take, by the kind it turns out to be (sniffed, not declared):
    what the prompt's text leaves of the context depends on the kinds. None: no limit."""

    image: int | None = None
    video: int | None = None


@dataclass(slots=True)
class _SharedDecode:
    future: asyncio.Future[PreparedImage | PreparedVideo]
    waiters: int = 0


class MediaStage:
    def __init__(
        self,
        cfg: PreprocessConfig,
        cache: FeatureCache,
        cpu_pool: Executor,
        io_pool: Executor,
        min_image_pixels_cached: int = 0,
        writer: Executor | None = None,
    ) -> None:
        self._cfg = cfg
        self._min_image_pixels = min_image_pixels_cached
        self._pending: dict[str, PreparedImage | PreparedVideo] = {}
        self._pending_bytes = 0
        #: The event loop adds to the backlog and the writer thread subtracts: `+=` is not atomic.
        self._pending_lock = threading.Lock()
        #: Decodes running now, by feature key (event-loop thread only).
        self._decoding: dict[str, _SharedDecode] = {}
        #: Cache writes are background work (zstd + checksum: ~35 ms of CPU per 16-frame clip).
        #: One low-priority thread keeps them off the cores the engine needs when CPU is scarce
        #: (a 2-core host: cold videos 0.87× → see bench/README.md); past the backlog budget an
        #: item is simply not cached rather than held in memory.
        self._writer = writer or io_pool
        self._policy = cfg.fetch_policy()
        self._cache = cache
        self._cpu_pool = cpu_pool
        self._io_pool = io_pool

    async def prepare(
        self, job: Job, budgets: Sequence[TokenBudget] | None = None
    ) -> list[PreparedMedia]:
        """`budgets[i]`, when given, is what `job.media[i]` is fitted to (see JobRunner)."""
        image = self._cfg.image_params(job.image.min_pixels, job.image.max_pixels)
        video = self._cfg.video_params(
            job.video.strategy,
            job.video.fps,
            job.video.interval_s,
            job.video.max_frames,
            job.video.max_pixels,
        )
        budgets = budgets or [TokenBudget()] * len(job.media)
        items = [
            asyncio.ensure_future(
                self._one(ref, image.with_budget(b.image), video.with_budget(b.video))
            )
            for ref, b in zip(job.media, budgets, strict=True)
        ]
        try:
            return list(await asyncio.gather(*items))
        finally:
            # The job fails with its first failed item; the others are no use to it any more,
            # and a fetch among them would hold an I/O thread until its deadline (no-op if done).
            for item in items:
                item.cancel()

    async def _one(self, ref: MediaRef, image: ImageParams, video: VideoParams) -> PreparedMedia:
        loop = asyncio.get_running_loop()
        handle = FetchHandle()
        try:
            got = await loop.run_in_executor(
                self._io_pool, self._acquire, ref, image, video, handle
            )
        except asyncio.CancelledError:
            # Cancelling the await only drops a call still queued; one already running would keep
            # its I/O thread on a slow or hostile server until the fetch deadline, and a few
            # timed-out jobs (each retried) would then hold every thread of the pool.
            handle.abort()
            raise
        if got.cached is not None:
            return PreparedMedia(got.cached, got.sha256, got.key, True, got.fetch_s, got.lookup_s)
        assert got.data is not None
        t0 = time.perf_counter()
        prepared, shared = await self._decode(got.key, got.data, image, video)
        preprocess_s = got.lookup_s + time.perf_counter() - t0
        unfitted = isinstance(prepared, PreparedVideo) and not prepared.fitted
        if unfitted and video.max_tokens is not None:
            # The budget changed nothing: file it where any budget it fits looks (`_lookup`).
            plain = dataclasses.replace(video, max_tokens=None)
            got = dataclasses.replace(got, key=make_key(got.sha256, plain))
        if self._worth_caching(prepared) and got.key not in self._pending:
            # Written in the background: the engine should not wait for zstd. Until the entry is
            # on disk, a repeat finds it in `_pending`.
            with self._pending_lock:
                self._pending[got.key] = prepared
                self._pending_bytes += _nbytes(prepared)
            self._writer.submit(self._put, got.key, prepared)
        return PreparedMedia(
            prepared, got.sha256, got.key, False, got.fetch_s, preprocess_s, shared_decode=shared
        )

    async def _decode(
        self, key: str, data: bytes, image: ImageParams, video: VideoParams
    ) -> tuple[PreparedImage | PreparedVideo, bool]:
        """One decode per feature key at a time, shared by every job that wants it meanwhile;
        returns the prepared media and whether this job joined a decode already running.

        A backfill often posts the same media many times in a row; each would otherwise decode
        it again, on the cores the running decode needs. The decode is shielded from one job's
        timeout while others wait for it, and cancelled (dropped from the pool's queue if it
        has not started) when the last of them leaves, as an unshared one would be.
        """
        shared = self._decoding.get(key)
        # A cancelled one stays listed until its done-callback runs: never join it.
        joined = shared is not None and not shared.future.cancelled()
        if shared is None or not joined:
            loop = asyncio.get_running_loop()
            future = loop.run_in_executor(self._cpu_pool, prepare_media, data, image, video)
            entry = shared = self._decoding[key] = _SharedDecode(future)

            def forget(fut: asyncio.Future[PreparedImage | PreparedVideo]) -> None:
                if self._decoding.get(key) is entry:
                    del self._decoding[key]
                if not fut.cancelled():
                    fut.exception()  # retrieved here: the last waiter may have left

            future.add_done_callback(forget)
        shared.waiters += 1
        try:
            return await asyncio.shield(shared.future), joined
        finally:
            shared.waiters -= 1
            if shared.waiters == 0:
                shared.future.cancel()  # no-op once done

    def _acquire(
        self, ref: MediaRef, image: ImageParams, video: VideoParams, handle: FetchHandle
    ) -> _Acquired:
        """Cache lookup, fetch, hash and sniff in one thread hop (each hop costs a loop wake-up)."""
        if ref.sha256 is not None:
            # A declared hash names the content before we have it: a hit skips the fetch too,
            # but not the rules on where media may come from.
            check_allowed(ref, self._policy)
            for params in (image, video):
                key, hit = self._lookup(ref.sha256, params)
                if hit is not None:
                    return _Acquired(None, ref.sha256, key, hit, 0.0, 0.0)
        t0 = time.perf_counter()
        data = fetch_bytes(ref, self._policy, handle)
        sha = hashlib.sha256(data).hexdigest()
        t1 = time.perf_counter()
        params = image if sniff(data).kind == "image" else video
        key, hit = self._lookup(sha, params)
        return _Acquired(data, sha, key, hit, t1 - t0, time.perf_counter() - t1)

    def _lookup(
        self, sha: str, params: ImageParams | VideoParams
    ) -> tuple[str, PreparedImage | PreparedVideo | None]:
        """The entry for these params; else, when a token budget is part of the key, the entry
        prepared without one, if it fits the budget: fitting leaves what fits unchanged, so it is
        exactly what fitting would produce. Without this, jobs that differ only in `max_tokens`
        or prompt length (a budget that may bind) would miss each other's features."""
        key = make_key(sha, params)
        hit = self._get(key, params)
        if hit is not None or params.max_tokens is None:
            return key, hit
        plain = dataclasses.replace(params, max_tokens=None)
        plain_key = make_key(sha, plain)
        if plain_key == key:
            return key, None
        plain_hit = self._get(plain_key, plain)
        if plain_hit is not None and _visual_tokens(plain_hit) <= params.max_tokens:
            return plain_key, plain_hit
        return key, None

    def _worth_caching(self, prepared: PreparedImage | PreparedVideo) -> bool:
        """Small images decode faster than a cache entry is written and read back."""
        if self._pending_bytes + _nbytes(prepared) > MAX_PENDING_WRITE_BYTES:
            return False
        if isinstance(prepared, PreparedVideo):
            return True
        width, height = prepared.original_size
        return width * height >= self._min_image_pixels

    def _get(
        self, key: str, params: ImageParams | VideoParams
    ) -> PreparedImage | PreparedVideo | None:
        pending = self._pending.get(key)
        if pending is not None:
            return pending
        if isinstance(params, ImageParams):
            return self._cache.get_image(key)
        return self._cache.get_video(key)

    def _put(self, key: str, prepared: PreparedImage | PreparedVideo) -> None:
        try:
            if isinstance(prepared, PreparedImage):
                self._cache.put_image(key, prepared)
            else:
                self._cache.put_video(key, prepared)
        finally:
            with self._pending_lock:
                if self._pending.pop(key, None) is not None:
                    self._pending_bytes -= _nbytes(prepared)


def _visual_tokens(prepared: PreparedImage | PreparedVideo) -> int:
    if isinstance(prepared, PreparedImage):
        return image_tokens(prepared.pixels.shape[0], prepared.pixels.shape[1])
    return video_tokens(*prepared.frames.shape[:3])


def _nbytes(prepared: PreparedImage | PreparedVideo) -> int:
    array = prepared.pixels if isinstance(prepared, PreparedImage) else prepared.frames
    return int(array.nbytes)


def lower_thread_priority() -> None:
    """Thread initializer: nice 19 for the calling thread only (Linux treats a TID as a process)."""
    if hasattr(os, "setpriority") and sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError as exc:
            log.debug("could not lower the cache writer's priority: %s", exc)


@dataclass(frozen=True, slots=True)
class _Acquired:
    data: bytes | None
    sha256: str
    key: str
    cached: PreparedImage | PreparedVideo | None
    fetch_s: float
    lookup_s: float
