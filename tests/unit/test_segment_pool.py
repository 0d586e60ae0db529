"""A segment's decode when a preprocessing process dies, for real: SIGKILLed while it decodes a
segment (the segment is decoded again alone and arrives), or killed by the media every time
(the segment is refused as undecodable_video, which segment mode reports in its place).

MediaStage.decode_segment on a real spawn ProcessPoolExecutor (through `DecodePool`); the decode
function is swapped for `_hooked_segment` (defined here so that the spawned children import it):
armed, the child announces its pid and waits to be SIGKILLed; data ending in `_KILLER` make it
SIGSEGV itself, every time.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import os
import signal
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from media_scenes import scene_video
from mmworker_preprocess.errors import UndecodableVideo
from mmworker_preprocess.params import VideoParams
from mmworker_preprocess.video.segments import SegmentRule, prepare_segment

from mmworker import media as media_module
from mmworker.cache import NullFeatureCache
from mmworker.config import PreprocessConfig
from mmworker.media import DecodePool, MediaStage

_HOOK_DIR = "MMWORKER_TEST_SEGMENT_HOOK_DIR"
_KILLER = b"KILL-THE-DECODER"
PARAMS = VideoParams(fps=0.5, max_frames=4, min_pixels=64 * 28 * 28)
RULE = SegmentRule("fixed", every_s=10.0)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _hooked_segment(data: bytes, params: Any, rule: Any, start_s: float, *rest: Any) -> Any:
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
    return prepare_segment(data, params, rule, start_s, *rest)


def _factory(workers: int) -> Executor:
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


@pytest.fixture
def hooks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(_HOOK_DIR, str(tmp_path))  # before any pool exists: children inherit it
    monkeypatch.setattr(media_module, "prepare_segment", _hooked_segment)
    return tmp_path


async def _wait_for(path: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} did not appear in {timeout_s}s")
        await asyncio.sleep(0.02)


def test_a_segment_decode_survives_its_process_being_killed_and_killer_media_is_refused(
    hooks: Path,
) -> None:
    clip = scene_video([5.0], 30.0)
    sha = _sha(clip)
    pool = DecodePool(_factory, workers=1)
    io = ThreadPoolExecutor(2)
    stage = MediaStage(PreprocessConfig(), NullFeatureCache(), pool, io, writer=io)
    try:

        async def scenario() -> None:
            warm, _ = await stage.decode_segment(clip, sha, PARAMS, RULE, 0.0)  # spawn + imports
            assert warm.end_s == pytest.approx(10.0)
            (hooks / "arm").touch()
            running = asyncio.ensure_future(stage.decode_segment(clip, sha, PARAMS, RULE, 10.0))
            await _wait_for(hooks / "running")
            os.kill(int((hooks / "running").read_text()), signal.SIGKILL)
            seg, _ = await asyncio.wait_for(running, 180)
            assert (seg.start_s, seg.end_s) == (pytest.approx(10.0), pytest.approx(20.0))
            assert seg.video.frames.shape[0] == 4
            assert pool.rebuilds == 1
            with pytest.raises(UndecodableVideo, match="also alone"):
                killer = clip + _KILLER
                await asyncio.wait_for(
                    stage.decode_segment(killer, _sha(killer), PARAMS, RULE, 0.0), 180
                )
            after, _ = await stage.decode_segment(clip, sha, PARAMS, RULE, 20.0)  # works again
            assert after.last

        asyncio.run(scenario())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        io.shutdown()
