"""The media stage of a job: fetch → hash → feature cache → decode/resize in a process pool.

Fetching is I/O and runs in threads; decoding and resizing hold the GIL and run in processes, so
neither stalls the event loop that keeps the engine fed. A job whose media all hit the cache costs
one hash and one zstd decode per item.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from concurrent.futures import Executor
from dataclasses import dataclass

from mmworker.cache import FeatureCache, make_key
from mmworker.config import PreprocessConfig
from preprocess.fetch import fetch_bytes
from preprocess.params import ImageParams, PreparedImage, PreparedVideo, VideoParams
from preprocess.prepare import prepare_media
from preprocess.sniff import sniff
from schemas import Job, MediaRef


@dataclass(frozen=True, slots=True)
class PreparedMedia:
    prepared: PreparedImage | PreparedVideo
    sha256: str
    cache_hit: bool
    fetch_s: float
    preprocess_s: float

    @property
    def kind(self) -> str:
        return "image" if isinstance(self.prepared, PreparedImage) else "video"


class MediaStage:
    def __init__(
        self,
        cfg: PreprocessConfig,
        cache: FeatureCache,
        cpu_pool: Executor,
        io_pool: Executor,
    ) -> None:
        self._cfg = cfg
        self._policy = cfg.fetch_policy()
        self._cache = cache
        self._cpu_pool = cpu_pool
        self._io_pool = io_pool

    async def prepare(self, job: Job) -> list[PreparedMedia]:
        image = self._cfg.image_params(job.image.min_pixels, job.image.max_pixels)
        video = self._cfg.video_params(
            job.video.strategy,
            job.video.fps,
            job.video.interval_s,
            job.video.max_frames,
            job.video.max_pixels,
        )
        return list(await asyncio.gather(*(self._one(ref, image, video) for ref in job.media)))

    async def _one(self, ref: MediaRef, image: ImageParams, video: VideoParams) -> PreparedMedia:
        loop = asyncio.get_running_loop()
        if ref.sha256 is not None:
            # A declared hash names the content before we have it: a hit skips the fetch too.
            hit = await loop.run_in_executor(self._io_pool, self._lookup, ref.sha256, image, video)
            if hit is not None:
                return PreparedMedia(hit, ref.sha256, True, 0.0, 0.0)
        t0 = time.perf_counter()
        data = await loop.run_in_executor(self._io_pool, fetch_bytes, ref, self._policy)
        sha = await loop.run_in_executor(self._io_pool, _sha256, data)
        fetch_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        kind = sniff(data).kind
        params: ImageParams | VideoParams = image if kind == "image" else video
        key = make_key(sha, params)
        cached = await loop.run_in_executor(self._io_pool, self._get, key, kind)
        if cached is not None:
            return PreparedMedia(cached, sha, True, fetch_s, time.perf_counter() - t1)
        prepared = await loop.run_in_executor(self._cpu_pool, prepare_media, data, image, video)
        preprocess_s = time.perf_counter() - t1
        await loop.run_in_executor(self._io_pool, self._put, key, prepared)
        return PreparedMedia(prepared, sha, False, fetch_s, preprocess_s)

    def _lookup(
        self, sha: str, image: ImageParams, video: VideoParams
    ) -> PreparedImage | PreparedVideo | None:
        return self._get(make_key(sha, image), "image") or self._get(make_key(sha, video), "video")

    def _get(self, key: str, kind: str) -> PreparedImage | PreparedVideo | None:
        if kind == "image":
            return self._cache.get_image(key)
        return self._cache.get_video(key)

    def _put(self, key: str, prepared: PreparedImage | PreparedVideo) -> None:
        if isinstance(prepared, PreparedImage):
            self._cache.put_image(key, prepared)
        else:
            self._cache.put_video(key, prepared)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
