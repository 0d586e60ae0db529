"""Fitting media to the context instead of refusing them (#13).

A video whose plan needs more visual tokens than its budget gets smaller frames first (down to
Qwen's video floor), then fewer frames still spread over the whole video; only a video that does
not fit even as two frames at the floor is refused. Images shrink the same way. Jobs with several
items share the context max-min fairly. Every video here is generated (tests/media_videos.py);
frames carry their source index as bar codes, so the test reads which frames were taken.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import media_videos as mv
from mmworker_preprocess.errors import TooManyVisualTokens
from mmworker_preprocess.image import prepare_image
from mmworker_preprocess.params import (
    FRAME_FACTOR,
    ImageParams,
    PreparedVideo,
    VideoParams,
    frame_max_pixels,
    image_token_ceiling,
    video_pixel_floor,
    video_token_ceiling,
)
from mmworker_preprocess.resize import smart_resize
from mmworker_preprocess.tokens import fair_shares, image_tokens, resized, video_tokens
from mmworker_preprocess.video import prepare_video
from mmworker_schemas import Failure, Job, MediaRef, Result, SourceCoords

from mmworker.cache import DiskFeatureCache, make_key
from mmworker.config import PreprocessConfig
from mmworker.devkit.samples import sample_image
from mmworker.engine import EngineOutput
from mmworker.jobs import JobRunner
from mmworker.media import MediaStage, PreparedMedia
from mmworker.metrics import Metrics
from mmworker.records import Context, media_facts
from tests.unit.loopkit import config

#: A minute of 480×360 video at 5 fps, a key frame a second: Qwen's 2 fps rule plans 120 frames
#: of 221 tokens a pair, 13,260 visual tokens in all.
WIDTH, HEIGHT, FPS, SECONDS = 480, 360, 5, 60


@cache
def long_clip() -> bytes:
    return mv.encode_video(
        "libx264", width=WIDTH, height=HEIGHT, n_frames=FPS * SECONDS, fps=FPS, gop=FPS
    )


@cache
def prepared(params: VideoParams) -> PreparedVideo:
    return prepare_video(long_clip(), params)


def indices(video: PreparedVideo) -> list[int]:
    # Bar codes hold 8 bits: a minute at 5 fps counts past 255, so unwrap the rising sequence
    # (frames are in time order, and no gap between two spans 256 frames).
    out: list[int] = []
    for frame in video.frames:
        i = mv.read_index(frame)
        while out and i < out[-1]:
            i += 256
        out.append(i)
    return out


def tokens(video: PreparedVideo) -> int:
    return video_tokens(*video.frames.shape[:3])


def floor_pair_tokens(params: VideoParams) -> int:
    """Tokens of two frames of the clip at the video floor."""
    h, w = resized(
        HEIGHT, WIDTH, min_pixels=params.min_pixels, max_pixels=video_pixel_floor(params),
        max_ratio=params.max_ratio, video=True,
    )  # fmt: skip
    return image_tokens(h, w)


# --- the planner --------------------------------------------------------------------------------


def test_unfitted_plan_is_what_the_budgets_are_measured_against() -> None:
    whole = prepared(VideoParams())
    assert whole.frames.shape[0] == 2 * SECONDS
    assert tokens(whole) == 13_260
    assert whole.sample_fps == pytest.approx(2.0)


def test_a_budget_the_video_fits_changes_nothing() -> None:
    whole = prepared(VideoParams())
    roomy = prepared(VideoParams(max_tokens=tokens(whole)))
    assert np.array_equal(roomy.frames, whole.frames)
    assert roomy.timestamps == whole.timestamps


def test_an_overlong_video_gets_smaller_frames_first() -> None:
    whole = prepared(VideoParams())
    budget = 9_000
    fitted = prepared(VideoParams(max_tokens=budget))
    # Same frames, same sampling rate: only the size went down, and not below the floor.
    assert indices(fitted) == indices(whole)
    assert fitted.timestamps == whole.timestamps
    assert fitted.sample_fps == whole.sample_fps
    w, h = fitted.resized_size
    assert w * h < whole.resized_size[0] * whole.resized_size[1]
    assert w * h >= VideoParams().min_pixels
    assert tokens(fitted) <= budget
    # The size smart_resize gives for the tokens a pair of frames may take.
    pair = budget // (whole.frames.shape[0] // FRAME_FACTOR)
    assert (h, w) == resized(
        HEIGHT, WIDTH, min_pixels=VideoParams().min_pixels, max_pixels=pair * 28 * 28,
        max_ratio=VideoParams().max_ratio, video=True,
    )  # fmt: skip
    assert abs(w / h - WIDTH / HEIGHT) < 0.1  # shrunk, not squeezed
    # Said so: the media stage files an unfitted video under the key without a budget, where
    # any later job finds it. The shrunk frames were filed there (the plan was shrunk in place),
    # and a job with no budget got them from the cache, under the same vLLM uuid.
    assert fitted.fitted and not whole.fitted


def test_then_fewer_frames_spread_over_the_whole_video() -> None:
    params = VideoParams()
    whole = prepared(params)
    per_pair = floor_pair_tokens(params)
    budget = 3_000
    assert whole.frames.shape[0] // FRAME_FACTOR * per_pair > budget  # the floor alone fails
    fitted = prepared(VideoParams(max_tokens=budget))
    n = fitted.frames.shape[0]
    assert n % FRAME_FACTOR == 0
    assert n == FRAME_FACTOR * (budget // per_pair)  # as many frames as fit at the floor
    assert tokens(fitted) <= budget
    picked = indices(fitted)
    # Still the first and the last frame, evenly spaced in between (the fps rule's linspace).
    assert picked[0] == 0 and picked[-1] == FPS * SECONDS - 1
    gaps = np.diff(picked)
    assert gaps.max() - gaps.min() <= 1
    assert fitted.sample_fps == pytest.approx(n / SECONDS)
    assert fitted.timestamps[-1] == pytest.approx(SECONDS - 1 / FPS)


@pytest.mark.parametrize(
    ("strategy", "extra"),
    [("interval", {"interval_s": 0.5}), ("keyframes", {})],
)
def test_other_strategies_keep_their_spread_when_fitted(strategy: str, extra: Any) -> None:
    params = VideoParams(strategy=strategy, **extra)  # type: ignore[arg-type]
    whole = prepared(params)
    budget = 10 * floor_pair_tokens(params)
    assert tokens(whole) > budget
    fitted = prepared(VideoParams(strategy=strategy, max_tokens=budget, **extra))  # type: ignore[arg-type]
    assert fitted.frames.shape[0] == 20 and tokens(fitted) <= budget
    picked, planned = indices(fitted), indices(whole)
    if strategy == "keyframes":
        assert set(picked) <= set(planned)  # key frames still
    assert picked[0] == planned[0]
    # As far as the plan reached, or further: a capped interval plan spans to the last frame.
    assert picked[-1] >= planned[-1]
    gaps = np.diff(picked)
    assert gaps.max() - gaps.min() <= FPS  # evenly spread: within one key-frame interval


def test_a_video_that_cannot_fit_even_at_the_floor_is_refused_clearly() -> None:
    params = VideoParams()
    per_pair = floor_pair_tokens(params)
    with pytest.raises(TooManyVisualTokens) as refused:
        prepare_video(long_clip(), VideoParams(max_tokens=per_pair - 1))
    message = refused.value.message
    assert f"budget of {per_pair - 1} visual tokens" in message
    assert "even 2 frames" in message and f"need {per_pair}" in message
    # Exactly the floor's two frames do fit.
    two = prepare_video(long_clip(), VideoParams(max_tokens=per_pair))
    assert two.frames.shape[0] == 2 and tokens(two) == per_pair
    assert two.timestamps == pytest.approx((0.0, SECONDS - 1 / FPS))  # first and last frame


def test_a_budget_never_raises_a_frame_above_the_total_pixel_cap() -> None:
    data = mv.encode_video("libx264", width=640, height=480, n_frames=40, fps=2)
    tight = VideoParams(total_pixels=300_000, max_tokens=10_000)
    video = prepare_video(data, tight)
    n = video.frames.shape[0]
    h, w = smart_resize(
        480, 640, min_pixels=tight.min_pixels, max_pixels=frame_max_pixels(tight, n)
    )
    assert video.resized_size == (w, h)


# --- images -------------------------------------------------------------------------------------


def test_an_image_over_its_budget_is_downscaled_then_refused_below_the_floor() -> None:
    data = sample_image(4000, 3000, seed=3)
    params = ImageParams(max_pixels=1280 * 28 * 28)
    whole = prepare_image(data, params)
    assert image_tokens(*whole.pixels.shape[:2]) > 500
    fitted = prepare_image(data, params.with_budget(500))
    assert image_tokens(*fitted.pixels.shape[:2]) <= 500
    assert fitted.pixels.shape[:2] == resized(
        3000, 4000, min_pixels=params.min_pixels, max_pixels=500 * 28 * 28,
        max_ratio=params.max_ratio, video=False,
    )  # fmt: skip
    assert fitted.original_size == whole.original_size
    with pytest.raises(TooManyVisualTokens, match="smallest size"):
        prepare_image(data, params.with_budget(3))


# --- cache keys and the ceiling -----------------------------------------------------------------


def test_a_budget_that_cannot_bind_leaves_the_cache_key_alone() -> None:
    params = VideoParams(max_frames=64, max_pixels=448 * 448, total_pixels=8192 * 2 * 784)
    ceiling = video_token_ceiling(params)
    assert ceiling < 16_384 - 200  # the default context leaves more: default jobs keep their keys
    sha = "ab" * 32
    assert "max_tokens" not in params.cache_key_fields()
    assert make_key(sha, params.with_budget(ceiling)) == make_key(sha, params)
    assert params.with_budget(ceiling).budget is None
    assert make_key(sha, params.with_budget(ceiling - 1)) != make_key(sha, params)
    assert make_key(sha, params.with_budget(500)) != make_key(sha, params.with_budget(501))
    image = ImageParams(max_pixels=1280 * 28 * 28)
    assert make_key(sha, image.with_budget(image_token_ceiling(image))) == make_key(sha, image)
    assert make_key(sha, image.with_budget(100)) != make_key(sha, image)


def test_the_ceiling_bounds_every_source_size() -> None:
    """Leaving a budget out of the key is only right if no source can need more than it."""
    rng = random.Random(13)
    for params in (
        VideoParams(max_frames=64, max_pixels=448 * 448, total_pixels=8192 * 2 * 784),
        VideoParams(max_frames=16, min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64),
    ):
        ceiling = video_token_ceiling(params)
        for _ in range(3000):
            short = rng.choice([rng.randint(1, 64), rng.randint(1, 4000)])
            long = min(math.floor(short * rng.uniform(1, params.max_ratio)), 30_000)
            h, w = (short, long) if rng.random() < 0.5 else (round(long), short)
            n = rng.randrange(FRAME_FACTOR, params.max_frames + 1, FRAME_FACTOR)
            size = resized(
                h, w, min_pixels=params.min_pixels, max_pixels=frame_max_pixels(params, n),
                max_ratio=params.max_ratio, video=True,
            )  # fmt: skip
            assert video_tokens(n, *size) <= ceiling, (h, w, n, size)
    image = ImageParams(min_pixels=28 * 28 * 64, max_pixels=28 * 28 * 256)
    ceiling = image_token_ceiling(image)
    for _ in range(3000):
        short = rng.randint(1, 3000)
        long = min(math.floor(short * rng.uniform(1, image.max_ratio)), 30_000)
        size = resized(
            short, long, min_pixels=image.min_pixels, max_pixels=image.max_pixels,
            max_ratio=image.max_ratio, video=False,
        )  # fmt: skip
        assert image_tokens(*size) <= ceiling


def test_fair_shares() -> None:
    assert fair_shares([100, 200], 1000) == [100, 200]  # fits: untouched
    assert fair_shares([100, 5000], 1000) == [100, 900]  # the small one keeps its size
    assert fair_shares([3000, 5000, 100], 1000) == [450, 450, 100]
    assert fair_shares([3000, 5000], 1001) == [501, 500]
    assert sum(fair_shares([7, 9000, 9000, 250], 4321)) == 4321


def test_fitted_facts_report_frames_rate_and_size() -> None:
    fitted = prepared(VideoParams(max_tokens=3_000))
    facts = media_facts(PreparedMedia(fitted, "cd" * 32, "key", False, 0.0, 0.0))
    assert facts.frames == fitted.frames.shape[0]
    assert facts.sample_fps == pytest.approx(fitted.frames.shape[0] / SECONDS, abs=1e-4)
    assert facts.resized_size == fitted.resized_size
    assert facts.visual_tokens == tokens(fitted) <= 3_000


# --- through the job runner, without an engine --------------------------------------------------


class _TextOnlyEngine:
    """Counts prompt text like the real engine's interface (one token a word, plus a fixed chat
    template and one placeholder an item) and answers without a model."""

    epoch = 0

    def alive(self) -> bool:
        return True

    TEMPLATE = 20

    def __init__(self) -> None:
        self.seen: list[list[Any]] = []

    def prompt_tokens(self, instruction: str, kinds: tuple[str, ...]) -> int:
        return self.TEMPLATE + len(instruction.split()) + 3 * len(kinds)

    async def generate(
        self,
        request_id: str,
        instruction: str,
        items: list[Any],
        params: Any,
        guide: Any = None,
        background: bool = False,
    ) -> EngineOutput:
        self.seen.append(items)
        kinds = tuple(item.kind for item in items)
        visual = sum(
            video_tokens(*i.prepared.frames.shape[:3]) if i.kind == "video"
            else image_tokens(*i.prepared.pixels.shape[:2])
            for i in items
        )  # fmt: skip
        return EngineOutput("ok", "stop", self.prompt_tokens(instruction, kinds) + visual, 1, 0.0)


CTX = Context(SourceCoords(topic="jobs", partition=0, offset=1), None, "w", "tiny", None)


def _run(job: Job, tmp_path: Path, max_model_len: int) -> tuple[Result | Failure, Metrics]:
    cfg = config()
    cfg = cfg.model_copy(
        update={"engine": cfg.engine.model_copy(update={"max_model_len": max_model_len})}
    )
    pool = ThreadPoolExecutor(2)
    cache_ = DiskFeatureCache(tmp_path / "cache", max_bytes=256 * 1024 * 1024)
    stage = MediaStage(PreprocessConfig(), cache_, cpu_pool=pool, io_pool=pool, writer=pool)
    metrics = Metrics()
    runner = JobRunner(cfg, engine=_TextOnlyEngine(), media=stage, metrics=metrics)  # type: ignore[arg-type]
    try:
        outcome = asyncio.run(runner.run(job.model_dump_json().encode(), CTX, 0))
    finally:
        pool.shutdown(wait=True)
    return outcome.record, metrics


def _decodes(metrics: Metrics) -> float:
    return sum(
        sample.value
        for family in metrics.cache.collect()
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels.get("result") == "miss"
    )


def test_a_job_whose_video_overflows_the_context_is_fitted_in_one_decode(tmp_path: Path) -> None:
    job = Job(job_id="long", media=[MediaRef(data=long_clip())], generation={"max_tokens": 200})
    record, metrics = _run(job, tmp_path, max_model_len=4096)
    assert isinstance(record, Result), record
    (facts,) = record.media
    text = _TextOnlyEngine().prompt_tokens(job.instruction(["video"]), ("video",))
    room = 4096 - text - 200
    assert facts.visual_tokens <= room
    assert record.usage.visual_tokens == facts.visual_tokens
    assert facts.frames is not None and facts.frames < 2 * SECONDS
    assert facts.frame_timestamps is not None and facts.frame_timestamps[-1] > SECONDS - 1
    assert facts.sample_fps == pytest.approx(facts.frames / SECONDS, abs=1e-3)
    assert _decodes(metrics) == 1
    # Fitted to the exact room: what the planner makes of that budget, nothing lost to slack.
    params = PreprocessConfig().video_params(None, None, None, None, None).with_budget(room)
    assert facts.visual_tokens == tokens(prepared(params))


def test_a_job_over_the_context_with_several_items_shares_it_fairly(tmp_path: Path) -> None:
    image = sample_image(640, 480, seed=4)
    job = Job(
        job_id="mixed",
        prompt="Describe both.",
        media=[MediaRef(data=image), MediaRef(data=long_clip())],
        generation={"max_tokens": 100},
    )
    record, _ = _run(job, tmp_path, max_model_len=4096)
    assert isinstance(record, Result), record
    still, video = record.media
    assert still.kind == "image" and video.kind == "video"
    # The image needs less than half: it keeps its own size; the video takes the rest.
    assert (
        still.resized_size
        == prepare_image(image, PreprocessConfig().image_params(None, None)).resized_size
    )
    text = _TextOnlyEngine().prompt_tokens("Describe both.", ("image", "video"))
    assert still.visual_tokens + video.visual_tokens <= 4096 - text - 100
    assert video.frames is not None and video.frames < 64


def test_a_job_whose_video_cannot_fit_is_refused_with_the_reason(tmp_path: Path) -> None:
    job = Job(job_id="tiny", media=[MediaRef(data=long_clip())], generation={"max_tokens": 180})
    record, _ = _run(job, tmp_path, max_model_len=256)
    assert isinstance(record, Failure)
    assert record.code == "too_many_visual_tokens"
    assert "even 2 frames" in record.message
