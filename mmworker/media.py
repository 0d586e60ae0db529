"""The media stage of a job: fetch → hash → feature cache → decode/resize in a process pool.

Fetching is I/O and runs in threads; decoding and resizing hold the GIL and run in processes, so
neither stalls the event loop that keeps the engine fed. A job whose media all hit the cache costs
one hash and one zstd decode per item. A decoder process that dies (a segfault in a decoder, the
kernel's OOM killer) costs the pool one rebuild, not the worker its decoding: see `DecodePool`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import BrokenExecutor, Executor, Future
from dataclasses import dataclass
from typing import TypeVar

from mmworker_preprocess.errors import UndecodableImage, UndecodableVideo
from mmworker_preprocess.fetch import FetchHandle, check_allowed, fetch_bytes
from mmworker_preprocess.params import (
    FetchPolicy,
    ImageParams,
    PreparedImage,
    PreparedVideo,
    VideoParams,
)
from mmworker_preprocess.prepare import prepare_media, warm_up
from mmworker_preprocess.sniff import sniff, sniff_signature
from mmworker_preprocess.tokens import image_tokens, video_tokens
from mmworker_preprocess.video.partial import judge_cached
from mmworker_preprocess.video.segments import PreparedSegment, SegmentRule, prepare_segment
from mmworker_schemas import Job, MediaRef

from mmworker.cache import FeatureCache, make_key, segment_key
from mmworker.config import PreprocessConfig
from mmworker.errors import PreprocessPoolDead
from mmworker.lanes import PrioritySlots

log = logging.getLogger(__name__)

#: Prepared media waiting for the cache writer; beyond this, new items are not cached.
MAX_PENDING_WRITE_BYTES = 1 << 30
#: Feature keys whose decode killed a process on its own, remembered so that a repeat of one is
#: decoded alone at once rather than breaking the shared pool (and its other decodes) again.
MAX_REMEMBERED_CRASHES = 1024

_T = TypeVar("_T")


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
    #: Its last waiter left and cancelled it: a task stays not-`cancelled()` until it has run
    #: once more, and a job joining it meanwhile would be cancelled with it.
    abandoned: bool = False


class DecodePool:
    """The processes media is decoded in, and what is done when one of them dies.

    A process killed while it decodes (a decoder segfault, the kernel's OOM killer, an operator's
    `kill`) breaks a `ProcessPoolExecutor` for good: every call in it fails with
    `BrokenProcessPool`, and so would every later one, while the worker looked healthy. Here the
    pool is replaced by `factory(workers)` as soon as a call sees the break, and each decode caught
    in it is run again alone (`run_alone`: one process, one call at a time), so that an innocent
    one still gets its result and only one that kills a process on its own is refused. At most
    `workers + 1` calls are in the pool at once (what its processes and call queue hold anyway):
    a break can catch no more than those, and the rest wait here, unsubmitted, for the new pool.

    `DecodePool.fixed(executor)` wraps a pool it cannot rebuild (thread pools in tests): calls go
    straight through and a break is the caller's error, as with a bare executor.
    """

    def __init__(self, factory: Callable[[int], Executor] | None, workers: int, *,
                 executor: Executor | None = None, recycle_after: int | None = None,
                 ) -> None:  # fmt: skip
        self._factory = factory
        self.workers = workers
        #: Calls after which the shared pool is replaced by a fresh one (see `_recycle`).
        self._recycle_after = recycle_after
        self._calls = 0
        self.recycles = 0
        self.executor = executor if executor is not None else self._make(workers)
        #: The one-process pool suspects are decoded in, started at the first break.
        self._alone: Executor | None = None
        #: (loop, places in the shared pool, the place in the alone pool): see `_slots`.
        self._limits: tuple[asyncio.AbstractEventLoop, PrioritySlots, asyncio.Semaphore] | None
        self._limits = None
        #: Pools replaced since start: each is a process that died under a decode or between.
        self.rebuilds = 0

    @classmethod
    def fixed(cls, executor: Executor) -> DecodePool:
        return cls(None, 0, executor=executor)

    @property
    def rebuildable(self) -> bool:
        return self._factory is not None

    def _make(self, workers: int) -> Executor:
        assert self._factory is not None
        return self._factory(workers)

    def _slots(self) -> tuple[PrioritySlots, asyncio.Semaphore]:
        """(calls the shared pool may hold, live jobs' first; calls the alone pool may hold), for
        the running loop (a semaphore is bound to the loop it first waits in; tests run several
        loops)."""
        loop = asyncio.get_running_loop()
        if self._limits is None or self._limits[0] is not loop:
            self._limits = (loop, PrioritySlots(self.workers + 1), asyncio.Semaphore(1))
        return self._limits[1], self._limits[2]

    async def run(self, fn: Callable[..., _T], *args: object) -> _T:
        """`fn(*args)` in the shared pool. Raises `BrokenExecutor` if the pool broke under it
        (the pool is replaced by then: the caller decides whether to run it again alone)."""
        loop = asyncio.get_running_loop()
        if not self.rebuildable:
            return await loop.run_in_executor(self.executor, fn, *args)
        slots, _ = self._slots()
        await slots.acquire()
        try:
            self._recycle()
            executor = self.executor
            try:
                call = executor.submit(fn, *args)
            except BrokenExecutor:
                # It broke between calls (a process killed while idle): nothing of this one ran.
                self.replace(executor)
                executor = self.executor
                call = executor.submit(fn, *args)
        except BaseException:
            slots.release()
            raise
        _when_done(call, loop, slots.release)
        try:
            return await asyncio.wrap_future(call)
        except BrokenExecutor:
            self.replace(executor)
            raise

    async def run_alone(self, fn: Callable[..., _T], *args: object) -> _T:
        """`fn(*args)` alone in a one-process pool: one call at a time, each until its process
        is done with it (also when its caller gave up), so a break there is this call's doing.
        Raises `BrokenExecutor` if its process died."""
        loop = asyncio.get_running_loop()
        _, slot = self._slots()
        await slot.acquire()
        try:
            executor = self._alone or self._make(1)
            try:
                call = executor.submit(fn, *args)
            except BrokenExecutor:  # its process was killed while idle: nothing of this ran
                executor.shutdown(wait=False, cancel_futures=True)
                executor = self._make(1)
                call = executor.submit(fn, *args)
            self._alone = executor
        except BaseException:
            slot.release()
            raise
        _when_done(call, loop, slot.release)
        try:
            return await asyncio.wrap_future(call)
        except BrokenExecutor:
            if self._alone is executor:
                self._alone = None
            executor.shutdown(wait=False, cancel_futures=True)
            raise

    async def healthy(self) -> bool:
        """Whether a fresh process can run a trivial call (the imports decoding needs)."""
        try:
            await self.run_alone(warm_up)
        except BrokenExecutor:
            return False
        return True

    def _recycle(self) -> None:
        """Every `recycle_after` calls, new calls go to a fresh pool and the old one exits once
        the calls already in it are done: decoder libraries' memory grows slowly with the media
        they have seen, and a fresh process starts from nothing (bench/soak.py). `warm_up` is
        sent ahead so that no job waits for the new processes' imports."""
        if self._recycle_after is None:
            return
        self._calls += 1
        if self._calls <= self._recycle_after:
            return
        self._calls = 1
        old, self.executor = self.executor, self._make(self.workers)
        for _ in range(self.workers):
            self.executor.submit(warm_up)
        old.shutdown(wait=False)
        self.recycles += 1
        log.info("preprocessing processes replaced by fresh ones after %d decodes (%d time(s))",
                 self._recycle_after, self.recycles)  # fmt: skip

    def replace(self, broken: Executor) -> None:
        """A new shared pool for `broken`, once: every call caught in one break reports it."""
        if self.executor is not broken:
            return
        self.executor = self._make(self.workers)
        self.rebuilds += 1
        broken.shutdown(wait=False, cancel_futures=True)
        log.error(
            "a preprocessing process died; its pool is replaced (%d time(s) since start) and "
            "the decodes it held run again one at a time",
            self.rebuilds,
        )

    def shutdown(self, *, wait: bool = True, cancel_futures: bool = False) -> None:
        for executor in (self.executor, self._alone):
            if executor is not None:
                executor.shutdown(wait=wait, cancel_futures=cancel_futures)


def _when_done(
    call: Future[_T], loop: asyncio.AbstractEventLoop, then: Callable[[], object]
) -> None:
    """`then()` in `loop` once `call` is done in its pool (not when its awaiter is cancelled:
    a call already running goes on, and still holds its place)."""

    def done(_: Future[_T]) -> None:
        # A closed loop (the worker stopped) has nobody waiting for the place any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(then)

    call.add_done_callback(done)


class MediaStage:
    def __init__(
        self,
        cfg: PreprocessConfig,
        cache: FeatureCache,
        cpu_pool: Executor | DecodePool,
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
        #: (a 2-core host: cold videos 0.87× → see bench/HISTORY.md); past the backlog budget an
        #: item is simply not cached rather than held in memory.
        self._writer = writer or io_pool
        self._policy = cfg.fetch_policy()
        self._cache = cache
        self._decoder = cpu_pool if isinstance(cpu_pool, DecodePool) else DecodePool.fixed(cpu_pool)
        self._io_pool = io_pool
        #: Keys that killed a process decoding alone (`_decode_alone`), oldest first.
        self._crashed: OrderedDict[str, None] = OrderedDict()

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

    def video_params(self, job: Job) -> VideoParams:
        """The job's video sampling settings over the worker's defaults."""
        v = job.video
        return self._cfg.video_params(v.strategy, v.fps, v.interval_s, v.max_frames, v.max_pixels)

    async def fetch(self, ref: MediaRef) -> tuple[bytes, str, float]:
        """(bytes, sha256, seconds) without the feature cache: segment mode keeps the bytes for
        one decode call per segment (`mmworker.segmented`), and caches per segment."""
        loop = asyncio.get_running_loop()
        handle = FetchHandle()
        t0 = time.perf_counter()
        try:
            data, sha = await loop.run_in_executor(self._io_pool, _fetch_hashed, ref, self._policy,
                                                   handle)  # fmt: skip
        except asyncio.CancelledError:
            handle.abort()  # see `_one`
            raise
        return data, sha, time.perf_counter() - t0

    async def kind(self, data: bytes, sha: str) -> str:
        """`sniff(data).kind`, with FFmpeg's probe, where needed, in the decoding pool: a blob
        that crashes the probe takes down a pool process, and is then refused, instead of
        killing the worker (and again at each redelivery: the partition would stop there).
        As for decodes (`_decode_once`), media that killed its process alone is probed alone
        from then on, and a pool that cannot run at all is `PreprocessPoolDead`."""
        found = sniff_signature(data)
        if found is not None:
            return found.kind
        key = f"probe:{sha}"
        if key not in self._crashed:
            try:
                return (await self._decoder.run(sniff, data)).kind
            except BrokenExecutor:
                if not self._decoder.rebuildable:
                    raise
        try:  # a pool process died meanwhile, maybe under another job's media: alone
            return (await self._decoder.run_alone(sniff, data)).kind
        except BrokenExecutor as exc:
            died = exc
        await self._convict(key, died)
        raise UndecodableVideo(
            "the video decoder's process died reading this media's container, also alone in a "
            "process of its own"
        ) from died

    async def decode_segment(
        self, data: bytes, sha: str, params: VideoParams, rule: SegmentRule, start_s: float
    ) -> tuple[PreparedSegment, bool]:
        """(the segment, whether it came from the feature cache). Each segment is an entry of its
        own (`segment_key`), so a repeated long video decodes nothing, and the entries are as
        small as one segment's frames. A decode runs in the process pool; if a process of the
        pool died meanwhile, once more alone, and if it dies there too, `UndecodableVideo` (as
        for `_decode_alone`)."""
        loop = asyncio.get_running_loop()
        key = segment_key(sha, params, rule.cache_key_fields(), start_s)
        hit = await loop.run_in_executor(self._io_pool, self._cache.get_segment, key)
        if hit is not None:
            return hit, True
        try:
            seg = await self._decoder.run(prepare_segment, data, params, rule, start_s, None, sha)
        except BrokenExecutor:
            if not self._decoder.rebuildable:
                raise
            try:
                seg = await self._decoder.run_alone(prepare_segment, data, params, rule, start_s)
            except BrokenExecutor as exc:
                raise UndecodableVideo(
                    f"the video decoder's process died decoding the segment at {start_s:.3f}s, "
                    "also alone in a process of its own"
                ) from exc
        nbytes = int(seg.video.frames.nbytes)
        with self._pending_lock:
            # The writer's backlog holds the frames until written: bounded as for whole media.
            worth = self._pending_bytes + nbytes <= MAX_PENDING_WRITE_BYTES
            if worth:
                self._pending_bytes += nbytes
        if worth:
            self._writer.submit(self._put_segment, key, seg, nbytes)
        return seg, False

    def _put_segment(self, key: str, seg: PreparedSegment, nbytes: int) -> None:
        try:
            self._cache.put_segment(key, seg)
        finally:
            with self._pending_lock:
                self._pending_bytes -= nbytes

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
        joined = shared is not None and not (shared.abandoned or shared.future.cancelled())
        if shared is None or not joined:
            future = asyncio.ensure_future(self._decode_once(key, data, image, video))
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
            if shared.waiters == 0 and not shared.future.done():
                shared.abandoned = True
                shared.future.cancel()

    async def _decode_once(
        self, key: str, data: bytes, image: ImageParams, video: VideoParams
    ) -> PreparedImage | PreparedVideo:
        """The decode, in the shared pool; if a process of it died meanwhile, alone."""
        if key not in self._crashed:
            try:
                return await self._decoder.run(prepare_media, data, image, video)
            except BrokenExecutor:
                if not self._decoder.rebuildable:
                    raise
                log.warning(
                    "a preprocessing process died while this decode was in its pool (key %s): "
                    "decoding it again alone",
                    key[:16],
                )
        return await self._decode_alone(key, data, image, video)

    async def _decode_alone(
        self, key: str, data: bytes, image: ImageParams, video: VideoParams
    ) -> PreparedImage | PreparedVideo:
        """A suspect's decode in a process of its own: its result if it was innocent; if the
        process dies again with only this decode in it, the media is what kills it, and is
        refused like other media that cannot be decoded (not retryable: it would kill again)."""
        try:
            return await self._decoder.run_alone(prepare_media, data, image, video)
        except BrokenExecutor as exc:
            died = exc
        await self._convict(key, died)
        kind = _signature_kind(data)  # not FFmpeg's probe: this media kills processes
        refused = UndecodableImage if kind == "image" else UndecodableVideo
        log.error(
            "media (key %s) killed the %s decoder's process on its own: refused", key[:16], kind
        )
        raise refused(
            f"the {kind} decoder's process died decoding this media, also alone in a process "
            "of its own (a crash in the decoder, or memory exhaustion); not retried, as it "
            "would die again"
        ) from died

    async def _convict(self, key: str, died: BrokenExecutor) -> None:
        """Remember that what `key` names killed its process alone, unless no process lives at
        all (`PreprocessPoolDead`): its repeats then skip the shared pool."""
        if not await self._decoder.healthy():
            raise PreprocessPoolDead(
                "preprocessing processes die even without media to decode (they cannot start, "
                f"or are killed at once): {died}"
            ) from died
        self._crashed[key] = None
        self._crashed.move_to_end(key)
        while len(self._crashed) > MAX_REMEMBERED_CRASHES:
            self._crashed.popitem(last=False)

    def _acquire(
        self, ref: MediaRef, image: ImageParams, video: VideoParams, handle: FetchHandle
    ) -> _Acquired:
        """Cache lookup, fetch, hash and sniff in one thread hop (each hop costs a loop wake-up)."""
        if ref.sha256 is not None and ref.data is None:
            # A declared hash names the content before we have it: a hit skips the fetch too,
            # but not the rules on where media may come from. Inline bytes are here already:
            # they are hashed, so a wrong hash beside them is checksum_mismatch, never another
            # media's features.
            check_allowed(ref, self._policy, handle)
            for params in (image, video):
                key, hit = self._lookup(ref.sha256, params)
                if hit is not None:
                    return _Acquired(None, ref.sha256, key, hit, 0.0, 0.0)
        t0 = time.perf_counter()
        data = fetch_bytes(ref, self._policy, handle)
        sha = hashlib.sha256(data).hexdigest()
        t1 = time.perf_counter()
        # What FFmpeg's probe would say (a video, or a refusal) is left to the decoding process.
        params = image if _signature_kind(data) == "image" else video
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
        video = self._cache.get_video(key)
        if video is not None:
            judge_cached(video, params)
        return video

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


def _fetch_hashed(ref: MediaRef, policy: FetchPolicy, handle: FetchHandle) -> tuple[bytes, str]:
    data = fetch_bytes(ref, policy, handle)
    return data, hashlib.sha256(data).hexdigest()


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


def _signature_kind(data: bytes) -> str:
    """The kind by the bytes' signature alone (`sniff_signature`, which refuses what is plainly
    not media), without FFmpeg: whatever only FFmpeg could tell is a video or nothing, and the
    decoding process finds out which."""
    found = sniff_signature(data)
    return found.kind if found is not None else "video"
