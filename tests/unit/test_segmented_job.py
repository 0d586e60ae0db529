"""`run_segments` with real segment decoding (PyAV, in this process) and a fake engine: failed
segments keep their place, a job with no caption at all fails with the first segment's error,
and a job never has more than SEGMENTS_IN_FLIGHT segments prepared or in the engine."""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import Callable

import pytest
from media_scenes import scene_video
from mmworker_preprocess.errors import UndecodableVideo
from mmworker_preprocess.params import VideoParams
from mmworker_preprocess.sniff import sniff
from mmworker_preprocess.video.segments import PreparedSegment, SegmentRule, prepare_segment
from mmworker_schemas import ErrorCode, GenerationParams, Job, MediaRef, SourceCoords

from mmworker.engine import EngineItem, EngineOutput
from mmworker.engine.guidance import Checked
from mmworker.errors import RequestFailed
from mmworker.records import Context
from mmworker.segmented import SEGMENT_ATTEMPTS, SEGMENTS_IN_FLIGHT, run_segments
from mmworker.tasks import plan_job

CLIP = scene_video([], 60.0)
CTX = Context(SourceCoords(topic="in", partition=0, offset=7), None, "w", "tiny", None)
PARAMS = VideoParams(fps=0.5, max_frames=4, min_pixels=64 * 28 * 28)


class _Media:
    """The two MediaStage calls segment mode makes, decoding for real in this process."""

    def __init__(self, fail_from_s: float | None = None) -> None:
        self.fail_from_s = fail_from_s
        self.decoded = 0

    async def fetch(self, ref: MediaRef) -> tuple[bytes, str, float]:
        return CLIP, hashlib.sha256(CLIP).hexdigest(), 0.0

    async def kind(self, data: bytes, sha: str) -> str:
        return sniff(data).kind

    async def decode_segment(
        self, data: bytes, sha: str, params: VideoParams, rule: SegmentRule, start_s: float
    ) -> tuple[PreparedSegment, bool]:
        if self.fail_from_s is not None and start_s >= self.fail_from_s:
            raise UndecodableVideo(f"corrupt video data at {start_s}s")
        self.decoded += 1
        return prepare_segment(data, params, rule, start_s), False


def _job(**segments: object) -> Job:
    spec = {"mode": "fixed", "every_s": 10.0, **segments}
    return Job(job_id="long", media=[MediaRef(data=b"x")], segments=spec)  # type: ignore[arg-type]


async def _run(
    job: Job, media: _Media, generate: object, retried: Callable[[], None] | None = None
) -> object:
    job, plan = plan_job(job, {})
    return await run_segments(
        job=job, plan=plan, checked=None, media=media, params=PARAMS,  # type: ignore[arg-type]
        generate=generate, ctx=CTX, queue_wait_s=0.0, t0=0.0,  # type: ignore[arg-type]
        retried=retried,
    )  # fmt: skip


def _answer(text: str) -> EngineOutput:
    return EngineOutput(text, "stop", 10, 2, 0.01)


async def _echo(
    instruction: str, items: list[EngineItem], generation: GenerationParams, checked: Checked | None
) -> EngineOutput:
    if not items:
        return _answer("summary of " + str(instruction.count("\n[")))
    if "from 20.0s" in instruction:
        raise RequestFailed("engine request failed: boom")
    found = re.search(r"from ([\d.]+s to [\d.]+s)", instruction)
    assert found is not None, instruction
    return _answer(found.group(1))


def test_a_failed_segment_keeps_its_place_and_the_summary_uses_the_rest() -> None:
    result = asyncio.run(_run(_job(summary={}), _Media(), _echo))
    segs = result.segments  # type: ignore[attr-defined]
    assert [s.start_s for s in segs] == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    assert segs[2].error is not None
    assert segs[2].error.code is ErrorCode.ENGINE_ERROR
    assert segs[2].text == ""
    assert segs[0].text == "0.0s to 10.0s"
    assert all(s.error is None and s.text for i, s in enumerate(segs) if i != 2)
    # Five captions went into the summary, the failed one did not.
    assert result.summary == "summary of 5"  # type: ignore[attr-defined]


def test_a_decode_failure_ends_the_video_there_in_place() -> None:
    result = asyncio.run(_run(_job(), _Media(fail_from_s=30.0), _echo))
    segs = result.segments  # type: ignore[attr-defined]
    assert [(s.start_s, s.error.code if s.error else None) for s in segs] == [
        (0.0, None), (10.0, None), (20.0, ErrorCode.ENGINE_ERROR),
        (30.0, ErrorCode.UNDECODABLE_VIDEO),
    ]  # fmt: skip


def test_no_caption_at_all_is_the_jobs_failure() -> None:
    async def broken(*_: object) -> EngineOutput:
        raise RequestFailed("engine request failed: down")

    with pytest.raises(RequestFailed):
        asyncio.run(_run(_job(), _Media(), broken))
    with pytest.raises(UndecodableVideo):
        asyncio.run(_run(_job(), _Media(fail_from_s=0.0), _echo))


def test_at_most_segments_in_flight_are_prepared_or_in_the_engine() -> None:
    inside = 0
    peak = 0
    media = _Media()

    async def slow(
        instruction: str, items: list[EngineItem], generation: GenerationParams,
        checked: Checked | None,
    ) -> EngineOutput:  # fmt: skip
        nonlocal inside, peak
        inside += 1
        peak = max(peak, inside)
        # Decoded but not yet answered: bounded by the same count.
        assert media.decoded - done <= SEGMENTS_IN_FLIGHT
        await asyncio.sleep(0.05)
        inside -= 1
        return _answer("ok")

    done = 0

    async def counted(*args: object) -> EngineOutput:
        nonlocal done
        out = await slow(*args)  # type: ignore[arg-type]
        done += 1
        return out

    result = asyncio.run(_run(_job(every_s=2.0), media, counted))
    assert len(result.segments) == 30  # type: ignore[attr-defined]
    assert peak == SEGMENTS_IN_FLIGHT


def test_a_retryable_segment_failure_is_tried_once_more_and_a_permanent_one_is_not() -> None:
    calls: dict[str, int] = {}

    async def flaky(
        instruction: str, items: list[EngineItem], generation: GenerationParams,
        checked: Checked | None,
    ) -> EngineOutput:  # fmt: skip
        calls[instruction] = calls.get(instruction, 0) + 1
        if "from 10.0s" in instruction and calls[instruction] == 1:
            raise RequestFailed("engine request failed: busy")  # retryable
        if "from 30.0s" in instruction:
            raise RequestFailed("engine rejected the request: bad", retryable=False)
        return _answer("ok")

    retries: list[None] = []
    result = asyncio.run(_run(_job(), _Media(), flaky, lambda: retries.append(None)))
    segs = result.segments  # type: ignore[attr-defined]
    assert len(retries) == SEGMENT_ATTEMPTS - 1  # the worker's retries metric hears of it
    assert segs[1].error is None
    assert segs[1].text == "ok"
    assert segs[3].error is not None
    tries = {k.split(" from ")[1][:5]: v for k, v in calls.items()}
    assert tries["10.0s"] == SEGMENT_ATTEMPTS
    assert tries["30.0s"] == 1
    assert tries["0.0s "] == 1


def test_an_engine_death_under_one_segment_stops_the_job_sending_more() -> None:
    """Every segment was decoded and sent after the engine had died under the first: they
    waited for the dead engine, then ran on the new one beside innocent jobs, this job being a
    suspect. Now the death ends the job at the next segment it would start."""
    from mmworker.errors import EngineFatal

    calls = 0

    async def dies(*_: object) -> EngineOutput:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise EngineFatal("engine died: test")
        await asyncio.sleep(0.05)
        return _answer("ok")

    media = _Media()
    with pytest.raises(EngineFatal):
        asyncio.run(_run(_job(every_s=2.0), media, dies))
    assert calls <= SEGMENTS_IN_FLIGHT, calls  # of 30 segments
    assert media.decoded <= SEGMENTS_IN_FLIGHT + 1, media.decoded


class _CountingEngine:
    """Counts a prompt's text tokens as its characters / 4 (the budget's only question)."""

    def prompt_tokens(self, instruction: str, kinds: tuple[str, ...]) -> int:
        return len(instruction) // 4


def test_a_segments_frames_get_what_its_own_prompt_leaves_of_the_context() -> None:
    """A job's `segments.prompt` replaced the instruction the budget was counted on (a fixed
    48-token margin for the time range): a long one overflowed the context, and each segment
    failed in the engine. One that leaves no room is refused before any segment is sent."""
    from mmworker.errors import VisualBudgetExceeded
    from mmworker.jobs import JobRunner
    from mmworker.metrics import Metrics
    from tests.unit.loopkit import config

    cfg = config().model_copy(
        update={"engine": config().engine.model_copy(update={"max_model_len": 4096})}
    )
    runner = JobRunner(cfg, engine=_CountingEngine(), media=None, metrics=Metrics())  # type: ignore[arg-type]

    def budget(prompt: str | None, max_tokens: int = 64) -> int | None:
        spec = {"mode": "fixed", "every_s": 10.0, "prompt": prompt}
        job = Job(
            job_id="long",
            media=[MediaRef(data=b"x")],
            segments=spec,  # type: ignore[arg-type]
            generation=GenerationParams(max_tokens=max_tokens),
        )
        job, plan = plan_job(job, {})
        return runner._segment_budget(job, plan)

    short, long = budget(None), budget("Describe this part of the video in detail. " * 60)
    assert short is not None and long is not None
    assert long < short - 500  # the custom prompt's ~640 tokens come off the frames
    with pytest.raises(VisualBudgetExceeded, match="leaves no room for its frames"):
        budget("x" * 16000, max_tokens=200)


def _words(text: str) -> int:
    """A stand-in tokenizer: a token per word."""
    return len(text.split())


def test_a_summary_too_long_for_the_context_is_sent_over_shortened_captions() -> None:
    """Sent whole, the captions of a long video overflowed the context and the summary was null
    (the reason only in a log line). Each caption is now cut alike until the prompt fits."""
    sent: list[str] = []
    caption = " ".join(["word"] * 40)

    async def wordy(
        instruction: str, items: list[EngineItem], generation: GenerationParams,
        checked: Checked | None,
    ) -> EngineOutput:  # fmt: skip
        if items:
            return _answer(caption)
        sent.append(instruction)
        return _answer("the summary")

    async def run(max_model_len: int) -> object:
        job, plan = plan_job(_job(summary={"max_tokens": 16}), {})
        return await run_segments(
            job=job, plan=plan, checked=None, media=_Media(), params=PARAMS,  # type: ignore[arg-type]
            generate=wordy, ctx=CTX, queue_wait_s=0.0, t0=0.0, count_tokens=_words,
            max_model_len=max_model_len,
        )  # fmt: skip

    roomy = asyncio.run(run(10_000))
    assert roomy.summary == "the summary" and _words(sent[-1]) > 6 * 40  # type: ignore[attr-defined]
    tight = asyncio.run(run(200))  # six captions of 40 words in 184 tokens
    assert tight.summary == "the summary"  # type: ignore[attr-defined]
    assert _words(sent[-1]) <= 200 - 16 and sent[-1].count("\n[") == 6, sent[-1]
    assert "…" in sent[-1]
    hopeless = asyncio.run(run(30))  # not even the time stamps fit
    assert hopeless.summary is None and len(sent) == 2  # type: ignore[attr-defined]
    assert len(hopeless.segments) == 6  # type: ignore[attr-defined]


def test_each_segment_reaches_the_cache_and_preprocess_metrics() -> None:
    """The worker's feature-cache hit rate and preprocess times saw no segment at all."""
    from mmworker.jobs import JobRunner
    from mmworker.metrics import Metrics
    from tests.unit.loopkit import config

    seen: list[tuple[bool, float]] = []

    async def run() -> object:
        job, plan = plan_job(_job(), {})
        return await run_segments(
            job=job, plan=plan, checked=None, media=_Media(), params=PARAMS,  # type: ignore[arg-type]
            generate=_echo, ctx=CTX, queue_wait_s=0.0, t0=0.0,
            observe=lambda cached, s: seen.append((cached, s)),
        )  # fmt: skip

    asyncio.run(run())
    assert [cached for cached, _ in seen] == [False] * 6 and all(s > 0 for _, s in seen)
    metrics = Metrics()
    runner = JobRunner(config(), engine=None, media=None, metrics=metrics)  # type: ignore[arg-type]
    runner._observe_segment(True, 0.01)
    runner._observe_segment(False, 0.2)
    assert metrics.cache.labels("hit")._value.get() == 1
    assert metrics.cache.labels("miss")._value.get() == 1


def test_engine_time_counts_overlapping_segment_requests_once() -> None:
    """Segment requests overlap (up to SEGMENTS_IN_FLIGHT at once): their summed engine times
    came out above the job's `total_s`."""
    calls = 0

    async def engine(
        instruction: str, items: list[EngineItem], generation: GenerationParams,
        checked: Checked | None,
    ) -> EngineOutput:  # fmt: skip
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.2)
        return EngineOutput("ok", "stop", 10, 2, 0.2)

    async def run() -> object:
        job, plan = plan_job(_job(summary={}), {})
        return await run_segments(
            job=job, plan=plan, checked=None, media=_Media(), params=PARAMS,  # type: ignore[arg-type]
            generate=engine, ctx=CTX, queue_wait_s=0.0, t0=time.perf_counter(),
        )  # fmt: skip

    timings = asyncio.run(run()).timings  # type: ignore[attr-defined]
    assert calls == 7  # six segments and the summary: 1.4 s of engine time summed
    assert timings.engine_s <= timings.total_s
    # The summary follows every segment, so at least two spans never overlap.
    assert 0.39 <= timings.engine_s < 1.2
