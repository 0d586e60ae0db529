"""Segment mode's reuse of work: each prepared segment is a feature-cache entry of its own (a
repeated video decodes nothing and gets the same frames), and a pool process demuxes a video's
timeline once for all its fixed-length segments, not once per segment.

Real decoding (PyAV) and a real disk cache; the pool is a thread pool (the process pool's death
handling is tests/unit/test_segment_pool.py's)."""

from __future__ import annotations

import asyncio
import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from media_scenes import scene_video
from mmworker_preprocess.params import VideoParams
from mmworker_preprocess.video import segments as segments_module
from mmworker_preprocess.video.segments import PreparedSegment, SegmentRule, prepare_segment
from mmworker_schemas import GenerationParams, Job, MediaRef, SourceCoords

from mmworker import media as media_module
from mmworker.cache import DiskFeatureCache, segment_key
from mmworker.config import PreprocessConfig
from mmworker.engine import EngineItem, EngineOutput
from mmworker.engine.guidance import Checked
from mmworker.media import DecodePool, MediaStage
from mmworker.records import Context
from mmworker.segmented import run_segments
from mmworker.tasks import plan_job

CLIP = scene_video([12.0, 31.0], 60.0)
SHA = hashlib.sha256(CLIP).hexdigest()
PARAMS = VideoParams(fps=0.5, max_frames=4, min_pixels=64 * 28 * 28)
FIXED = SegmentRule("fixed", every_s=10.0)
SCENES = SegmentRule("scenes", min_s=2.0, max_s=20.0)
CTX = Context(SourceCoords(topic="in", partition=0, offset=7), None, "w", "tiny", None)


def _same(a: PreparedSegment, b: PreparedSegment) -> None:
    assert (a.start_s, a.end_s, a.last, a.scene_cut) == (b.start_s, b.end_s, b.last, b.scene_cut)
    assert np.array_equal(a.video.frames, b.video.frames)
    assert a.video.timestamps == b.video.timestamps
    assert a.video.original_size == b.video.original_size
    assert a.video.total_num_frames == b.video.total_num_frames


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the demux passes segment decoding makes (the real `scan` still runs)."""
    calls: list[int] = []
    real = segments_module.scan

    def counted(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(segments_module, "scan", counted)
    monkeypatch.setattr(segments_module, "_timelines", type(segments_module._timelines)())
    return calls


def test_a_video_is_demuxed_once_for_all_its_fixed_segments(scans: list[int]) -> None:
    keyed = [prepare_segment(CLIP, PARAMS, FIXED, 10.0 * k, None, SHA) for k in range(6)]
    assert len(scans) == 1
    assert keyed[-1].last
    plain = [prepare_segment(CLIP, PARAMS, FIXED, 10.0 * k) for k in range(6)]
    assert len(scans) == 7  # without the content key, every call demuxes: the old behaviour
    for a, b in zip(keyed, plain, strict=True):
        _same(a, b)


def test_a_timeline_above_the_cache_bound_is_not_kept(
    scans: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(segments_module, "TIMELINE_CACHE_PACKETS", 10)
    for k in range(3):
        prepare_segment(CLIP, PARAMS, FIXED, 10.0 * k, None, SHA)
    assert len(scans) == 3
    assert not segments_module._timelines


def test_segment_keys_change_with_everything_that_changes_the_segment() -> None:
    base = segment_key(SHA, PARAMS, FIXED.cache_key_fields(), 10.0)
    assert base == segment_key(SHA, PARAMS, FIXED.cache_key_fields(), 10.0)
    others = {
        segment_key(hashlib.sha256(b"other").hexdigest(), PARAMS, FIXED.cache_key_fields(), 10.0),
        segment_key(SHA, VideoParams(fps=1.0, max_frames=4), FIXED.cache_key_fields(), 10.0),
        segment_key(SHA, PARAMS, SegmentRule("fixed", every_s=20.0).cache_key_fields(), 10.0),
        segment_key(SHA, PARAMS, SCENES.cache_key_fields(), 10.0),
        segment_key(SHA, PARAMS, FIXED.cache_key_fields(), 20.0),
        segment_key(SHA, PARAMS, {**FIXED.cache_key_fields(), "v": -1}, 10.0),
    }
    assert base not in others and len(others) == 6
    # Fixed segments do not depend on the scene settings.
    assert base == segment_key(
        SHA, PARAMS, SegmentRule("fixed", every_s=10.0, threshold=0.5).cache_key_fields(), 10.0
    )


def test_a_segment_comes_back_from_the_disk_cache_whole(tmp_path: Path) -> None:
    cache = DiskFeatureCache(tmp_path, max_bytes=64 << 20)
    seg = prepare_segment(CLIP, PARAMS, SCENES, 0.0)
    assert seg.scene_cut and not seg.last
    key = segment_key(SHA, PARAMS, SCENES.cache_key_fields(), 0.0)
    assert cache.get_segment(key) is None
    cache.put_segment(key, seg)
    got = cache.get_segment(key)
    assert got is not None
    _same(got, seg)
    assert cache.get_video(key) is not None  # stored as a video entry with its bounds beside


class _Stage:
    """A MediaStage on a real disk cache, its decodes counted."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decoded: list[float] = []

        def counted(data: bytes, params: Any, rule: Any, start_s: float, *rest: Any) -> Any:
            self.decoded.append(start_s)
            return prepare_segment(data, params, rule, start_s, *rest)

        monkeypatch.setattr(media_module, "prepare_segment", counted)
        self.cache = DiskFeatureCache(tmp_path / "cache", max_bytes=64 << 20)
        self.cpu = ThreadPoolExecutor(1)
        self.io = ThreadPoolExecutor(2)
        self.writer = ThreadPoolExecutor(1)
        self.stage = MediaStage(
            PreprocessConfig(), self.cache, DecodePool.fixed(self.cpu), self.io, writer=self.writer
        )

    def written(self) -> None:
        """Waits for the background cache writes queued so far."""
        self.writer.submit(lambda: None).result(timeout=60)

    def close(self) -> None:
        for pool in (self.cpu, self.io, self.writer):
            pool.shutdown(wait=True)


@pytest.fixture
def stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    made = _Stage(tmp_path, monkeypatch)
    yield made
    made.close()


def test_decode_segment_decodes_once_then_serves_the_cache(stage: _Stage) -> None:
    async def scenario() -> None:
        first, hit = await stage.stage.decode_segment(CLIP, SHA, PARAMS, SCENES, 0.0)
        assert not hit and stage.decoded == [0.0]
        stage.written()
        again, hit = await stage.stage.decode_segment(CLIP, SHA, PARAMS, SCENES, 0.0)
        assert hit and stage.decoded == [0.0]
        _same(again, first)
        # Another rule is another segment: decoded.
        _, hit = await stage.stage.decode_segment(CLIP, SHA, PARAMS, FIXED, 0.0)
        assert not hit and stage.decoded == [0.0, 0.0]

    asyncio.run(scenario())


def _job(job_id: str) -> Job:
    return Job(
        job_id=job_id,
        media=[MediaRef(data=CLIP)],
        segments={"mode": "scenes", "min_s": 2.0, "max_s": 20.0},
    )  # type: ignore[arg-type]


async def _caption(
    instruction: str, items: list[EngineItem], generation: GenerationParams, checked: Checked | None
) -> EngineOutput:
    """A fake engine whose caption is a digest of the frames it was given."""
    frames = items[0].prepared.frames  # type: ignore[union-attr]
    return EngineOutput(hashlib.sha256(frames.tobytes()).hexdigest()[:12], "stop", 10, 2, 0.01)


def test_a_repeated_video_is_captioned_from_cached_segments_only(stage: _Stage) -> None:
    async def run(job_id: str) -> Any:
        job, plan = plan_job(_job(job_id), {})
        return await run_segments(
            job=job, plan=plan, checked=None, media=stage.stage, params=PARAMS,
            generate=_caption, ctx=CTX, queue_wait_s=0.0, t0=0.0,
        )  # fmt: skip

    first = asyncio.run(run("first"))
    decoded = len(stage.decoded)
    assert decoded == len(first.segments) >= 4  # two scene cuts, segments of at most 20 s
    assert not first.cache_hit
    stage.written()
    second = asyncio.run(run("second"))
    assert second.cache_hit and second.media[0].cache_hit
    assert len(stage.decoded) == decoded  # nothing decoded again
    assert [(s.start_s, s.end_s, s.text) for s in second.segments] == [
        (s.start_s, s.end_s, s.text) for s in first.segments
    ]
