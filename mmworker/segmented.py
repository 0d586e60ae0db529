"""Segment mode of a job: a video captioned as timed segments, then optionally summarised.

The video is fetched once and its bytes kept for the job; each segment is one decode call in the
process pool (`preprocess.video.segments.prepare_segment`: seek, decode forward, cut), and goes
to the engine as soon as it is back, while the next one decodes. At most `SEGMENTS_IN_FLIGHT`
segments of a job are prepared or inside the engine at once: that bounds a job's memory (their
frames) and its share of the engine, so a two-hour video occupies a few of the batch's places,
not all of them, and live jobs beside it keep theirs. Each prepared segment is a feature-cache
entry of its own (`MediaStage.decode_segment`): a video captioned again (another prompt, a
retried job, a successor after a crash) decodes nothing; the result's `cache_hit` says whether
every segment came from the cache.

Failures stay in their place: a segment that cannot be decoded or generated becomes an entry
with its error code and the others are kept; a decode failure ends the video there (where the
next segment starts is unknown). Only when no segment has a caption is the job a failure, with
the first segment's error (retried as a whole when that error is retryable). An engine death is
the job's, as for any job.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from mmworker_preprocess.errors import NoFrames, UnsupportedMedia
from mmworker_preprocess.params import VideoParams
from mmworker_preprocess.tokens import video_tokens
from mmworker_preprocess.video.segments import PreparedSegment, SegmentRule
from mmworker_schemas import (
    GenerationParams,
    Job,
    MediaFacts,
    Result,
    SegmentError,
    SegmentResult,
    SegmentSpec,
    Timings,
    Usage,
)
from mmworker_schemas.errors import CodedError

from mmworker.cache import make_key
from mmworker.engine import EngineItem, EngineOutput
from mmworker.engine.guidance import Checked, parse_answer
from mmworker.errors import EngineFatal, PreprocessPoolDead
from mmworker.media import MediaStage
from mmworker.records import Context
from mmworker.tasks import Plan

log = logging.getLogger(__name__)

#: Segments of one job prepared or in the engine at once (see the module's docstring).
SEGMENTS_IN_FLIGHT = 4
#: Tries of one segment's request when it fails with a retryable code.
SEGMENT_ATTEMPTS = 2
DEFAULT_SUMMARY_PROMPT = (
    "Below are captions of consecutive segments of one video, with their times in seconds. "
    "Summarise what happens in the whole video in a few sentences."
)

#: (instruction, items, generation, checked) → the engine's answer; the job runner's gate,
#: preemption and request bookkeeping stay the runner's.
Generate = Callable[
    [str, list[EngineItem], GenerationParams, Checked | None], Awaitable[EngineOutput]
]


@dataclass(slots=True)
class _Slot:
    start_s: float
    end_s: float
    result: SegmentResult | None = None
    error: CodedError | None = None
    prompt_tokens: int = 0
    visual: int = 0
    frames: int = 0
    size: tuple[tuple[int, int], tuple[int, int]] | None = None
    cached: bool = False


class EngineSpans:
    """The wall time in which at least one of a job's requests was in the engine.

    Up to `SEGMENTS_IN_FLIGHT` segment requests run at once, so the sum of their engine times
    overstates the job's: it came out above `total_s`. Each request's span ends when its answer
    arrives and is as long as the engine says it took."""

    def __init__(self) -> None:
        self._spans: list[tuple[float, float]] = []

    def timed(self, generate: Generate) -> Generate:
        async def timed(
            instruction: str, items: list[EngineItem], generation: GenerationParams,
            checked: Checked | None,
        ) -> EngineOutput:  # fmt: skip
            out = await generate(instruction, items, generation, checked)
            end = time.perf_counter()
            self._spans.append((end - out.engine_s, end))
            return out

        return timed

    @property
    def seconds(self) -> float:
        total, reach = 0.0, -math.inf
        for start, end in sorted(self._spans):
            if end > reach:
                total += end - max(start, reach)
                reach = end
        return total


def rule_of(spec: SegmentSpec) -> SegmentRule:
    return SegmentRule(
        mode=spec.mode,
        every_s=spec.every_s or 0.0,
        threshold=spec.threshold,
        min_s=spec.min_s,
        max_s=spec.max_s,
    )


def segment_instruction(spec: SegmentSpec, plan: Plan, start_s: float, end_s: float) -> str:
    """The segment's own prompt, carrying its time range (the model sees only the segment)."""
    if spec.prompt is not None:
        return spec.prompt.replace("{start}", f"{start_s:.1f}").replace("{end}", f"{end_s:.1f}")
    return (
        f"This clip is the part of a longer video from {start_s:.1f}s to {end_s:.1f}s. "
        + plan.instruction(("video",))
    )


async def run_segments(
    *,
    job: Job,
    plan: Plan,
    checked: Checked | None,
    media: MediaStage,
    params: VideoParams,
    generate: Generate,
    ctx: Context,
    queue_wait_s: float,
    t0: float,
    count_tokens: Callable[[str], int] | None = None,
    max_model_len: int | None = None,
    observe: Callable[[bool, float], None] | None = None,
    retried: Callable[[], None] | None = None,
) -> Result:
    """`count_tokens` (a text-only prompt's tokens) and `max_model_len`: the summary's prompt
    is fitted to the context (`fit_summary`); without them it is sent as it is. `observe`:
    called with (from the feature cache, seconds) for each segment decoded or found, for the
    worker's cache and preprocess metrics, which otherwise saw no segment at all; `retried`,
    for each segment request tried again."""
    spec = job.segments
    assert spec is not None
    spans = EngineSpans()
    generate = spans.timed(generate)
    retrying = _retrying(generate, retried)
    data, sha, fetch_s = await media.fetch(job.media[0])
    if await media.kind(data, sha) != "video":
        raise UnsupportedMedia("segments need a video; the media is an image")
    rule = rule_of(spec)
    room = asyncio.Semaphore(SEGMENTS_IN_FLIGHT)
    slots: list[_Slot] = []
    tasks: list[asyncio.Task[None]] = []
    decode_s = 0.0
    cut: str | None = None
    start = 0.0
    try:
        while True:
            if len(slots) >= spec.max_segments:
                cut = (
                    f"max_segments ({spec.max_segments}) reached: the video from {start:.1f}s "
                    "on has no segments"
                )
                break
            await room.acquire()
            if (failed := _fatal(tasks)) is not None:
                # The engine died under an earlier segment (its slot came back with the error):
                # no further segment is decoded or sent, or they would queue for the dead engine
                # and then run on its successor beside innocent jobs, this job being a suspect.
                room.release()
                raise failed
            t1 = time.perf_counter()
            try:
                seg, cached = await media.decode_segment(data, sha, params, rule, start)
            except (EngineFatal, PreprocessPoolDead):
                raise
            except CodedError as exc:
                room.release()
                if isinstance(exc, NoFrames) and slots:
                    break  # nothing decodes after the last cut: the video ended there
                slots.append(_Slot(start, start, error=exc))
                log.warning("job %s: segment at %.1fs does not decode: %s", job.job_id, start,
                            exc.message)  # fmt: skip
                break
            finally:
                decode_s += time.perf_counter() - t1
            if observe is not None:
                observe(cached, time.perf_counter() - t1)
            slot = _Slot(seg.start_s, seg.end_s, cached=cached)
            slots.append(slot)
            tasks.append(
                asyncio.create_task(
                    _caption(job, spec, plan, checked, retrying, seg, slot, sha, params, room)
                )
            )
            if seg.last:
                break
            start = seg.end_s
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    done = [s for s in slots if s.result is not None and s.result.error is None]
    if not done:
        first = next(s.error for s in slots if s.error is not None)
        raise first
    fit = None if count_tokens is None or max_model_len is None else (count_tokens, max_model_len)
    summary, summary_out = await _summarise(job, spec, slots, generate, fit)
    return _result(job, ctx, slots, sha, summary, summary_out, cut, fetch_s, decode_s,
                   spans.seconds, queue_wait_s, time.perf_counter() - t0)  # fmt: skip


def _fatal(tasks: list[asyncio.Task[None]]) -> BaseException | None:
    """The error of a caption task that ended the job (an engine death; `_caption` keeps every
    per-segment failure in its slot), if one has."""
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            return task.exception()
    return None


async def _caption(
    job: Job, spec: SegmentSpec, plan: Plan, checked: Checked | None, generate: Generate,
    seg: PreparedSegment, slot: _Slot, sha: str, params: VideoParams, room: asyncio.Semaphore,
) -> None:  # fmt: skip
    video = seg.video
    n, height, width = (int(x) for x in video.frames.shape[:3])
    slot.frames, slot.visual = n, video_tokens(n, height, width)
    slot.size = (video.original_size, video.resized_size)
    stamps = [round(t, 3) for t in video.timestamps]
    uuid = f"{make_key(sha, params)}:{seg.start_s:.3f}-{seg.end_s:.3f}"
    instruction = segment_instruction(spec, plan, seg.start_s, seg.end_s)
    try:
        out = await generate(instruction, [EngineItem(video, uuid)], job.generation, checked)
        parsed = None
        if checked is not None:
            parsed = parse_answer(
                checked.guide, out.text, out.finish_reason, job.generation.max_tokens
            )
    except (EngineFatal, PreprocessPoolDead):
        raise
    except CodedError as exc:
        slot.error = exc
        slot.result = SegmentResult(
            start_s=round(seg.start_s, 3), end_s=round(seg.end_s, 3), frames=n,
            frame_timestamps=stamps, visual_tokens=slot.visual,
            error=SegmentError(code=exc.code, message=exc.message[:1024]),
        )  # fmt: skip
        return
    finally:
        del video, seg  # the frames go as soon as the engine has them
        room.release()
    slot.prompt_tokens = out.prompt_tokens
    slot.result = SegmentResult(
        start_s=round(slot.start_s, 3), end_s=round(slot.end_s, 3), text=out.text,
        json_=parsed, frames=n, frame_timestamps=stamps, finish_reason=out.finish_reason,
        output_tokens=out.output_tokens, visual_tokens=slot.visual,
    )  # fmt: skip
    # One line per segment: a long video's progress shows in the log while it runs.
    log.info("job %s: segment %.1f-%.1fs captioned", job.job_id, slot.start_s, slot.end_s)


def _retrying(generate: Generate, retried: Callable[[], None] | None) -> Generate:
    """A segment's request, tried again once after a retryable failure (a busy or restarting
    engine): retrying the whole job would run every segment again. `retried` is told of each
    retry (the worker's retries metric, which counts a job's own)."""

    async def retrying(
        instruction: str, items: list[EngineItem], generation: GenerationParams,
        checked: Checked | None,
    ) -> EngineOutput:  # fmt: skip
        attempt = 1
        while True:
            try:
                return await generate(instruction, items, generation, checked)
            except (EngineFatal, PreprocessPoolDead):
                raise
            except CodedError as exc:
                if not exc.retryable or attempt >= SEGMENT_ATTEMPTS:
                    raise
                attempt += 1
                if retried is not None:
                    retried()
                log.warning("segment request failed (%s); trying it again", exc.message)

    return retrying


async def _summarise(
    job: Job, spec: SegmentSpec, slots: list[_Slot], generate: Generate,
    fit: tuple[Callable[[str], int], int] | None,
) -> tuple[str | None, EngineOutput | None]:  # fmt: skip
    """The summary over the captions, text only; a failed summary leaves the captions standing
    (the result then has `summary` null)."""
    if spec.summary is None:
        return None, None
    lines = [
        (f"[{s.start_s:.1f}s-{s.end_s:.1f}s]", s.result.text.strip())
        for s in slots
        if s.result is not None and s.result.error is None
    ]
    head = spec.summary.prompt or DEFAULT_SUMMARY_PROMPT
    instruction = (
        summary_prompt(head, lines, 1.0)
        if fit is None
        else fit_summary(head, lines, fit[0], fit[1] - spec.summary.max_tokens)
    )
    if instruction is None:
        log.warning(
            "job %s: no summary: the captions of its %d segments do not fit the context "
            "(max_model_len %d) even shortened", job.job_id, len(lines), fit[1] if fit else 0,
        )  # fmt: skip
        return None, None
    generation = job.generation.model_copy(
        update={"max_tokens": spec.summary.max_tokens, "stop": [], "ignore_eos": False}
    )
    try:
        out = await generate(instruction, [], generation, None)
    except (EngineFatal, PreprocessPoolDead):
        raise
    except CodedError as exc:
        log.warning("job %s: summary failed: %s", job.job_id, exc.message)
        return None, None
    return out.text, out


def summary_prompt(head: str, lines: list[tuple[str, str]], keep: float) -> str:
    """The summary's instruction with each caption cut to `keep` of its characters."""
    body = []
    for stamp, caption in lines:
        cut = len(caption) if keep >= 1.0 else max(8, int(len(caption) * keep))
        shown = caption if cut >= len(caption) else caption[:cut].rstrip() + "…"
        body.append(f"{stamp} {shown}")
    return head + "\n\n" + "\n".join(body)


def fit_summary(
    head: str, lines: list[tuple[str, str]], count: Callable[[str], int], room: int
) -> str | None:
    """The summary prompt within `room` tokens: every caption shortened alike, so the summary
    still covers the whole video; None if even that does not fit (the time stamps alone are
    too many). Sent whole, a long video's captions overflowed the context and its summary was
    null with the reason only in the log."""
    keep = 1.0
    for _ in range(4):
        text = summary_prompt(head, lines, keep)
        tokens = count(text)
        if tokens <= room:
            if keep < 1.0:
                log.info("summary over captions cut to %.0f%% to fit the context", keep * 100)
            return text
        keep *= max(0.0, room / tokens) * 0.9
        if keep <= 0.0:
            break
    return None


def _result(
    job: Job, ctx: Context, slots: list[_Slot], sha: str, summary: str | None,
    summary_out: EngineOutput | None, cut: str | None, fetch_s: float, decode_s: float,
    engine_s: float, queue_wait_s: float, total_s: float,
) -> Result:  # fmt: skip
    segments = [
        s.result
        if s.result is not None
        else SegmentResult(
            start_s=round(s.start_s, 3),
            end_s=round(s.end_s, 3),
            error=SegmentError(code=s.error.code, message=s.error.message[:1024])
            if s.error is not None
            else None,
        )
        for s in slots
    ]
    timed = "\n".join(
        f"[{s.start_s:.1f}-{s.end_s:.1f}s] {s.text}" for s in segments if s.error is None
    )
    extra = [summary_out] if summary_out is not None else []
    sized = next(s.size for s in slots if s.size is not None)
    visual = sum(s.visual for s in slots)
    end = max(s.end_s for s in slots)
    cached = all(s.cached for s in slots)
    return Result(
        job_id=job.job_id,
        text=summary if summary is not None else timed,
        task=job.task,
        finish_reason=summary_out.finish_reason if summary_out is not None else "stop",
        model=ctx.model,
        model_revision=ctx.model_revision,
        usage=Usage(
            prompt_tokens=sum(s.prompt_tokens for s in slots) + sum(o.prompt_tokens for o in extra),
            visual_tokens=visual,
            output_tokens=sum(s.output_tokens for s in segments)
            + sum(o.output_tokens for o in extra),
        ),
        media=[
            MediaFacts(
                kind="video",
                sha256=sha,
                original_size=sized[0],
                resized_size=sized[1],
                visual_tokens=visual,
                frames=sum(s.frames for s in slots),
                duration_s=end,
                cache_hit=cached,
            )
        ],
        timings=Timings(
            queue_wait_s=max(0.0, queue_wait_s),
            fetch_s=fetch_s,
            preprocess_s=decode_s,
            engine_s=engine_s,
            total_s=total_s,
        ),
        cache_hit=cached,
        source=ctx.source,
        worker_id=ctx.worker_id,
        metadata=job.metadata,
        segments=segments,
        summary=summary,
        segments_cut=cut,
    )
