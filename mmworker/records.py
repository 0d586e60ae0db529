"""Building the output and dead-letter records from what a job produced."""

from __future__ import annotations

from dataclasses import dataclass

from mmworker_preprocess.params import PreparedImage
from mmworker_preprocess.tokens import image_tokens, video_tokens
from mmworker_schemas import Failure, Job, MediaFacts, Result, SourceCoords, Timings, Usage
from mmworker_schemas.codes import ErrorCode
from pydantic import JsonValue

from mmworker.engine import EngineOutput
from mmworker.media import PreparedMedia

#: A dead-letter message longer than this is cut: it is for people, and the record must stay
#: well under the broker's message size limit whatever an exception says.
MAX_MESSAGE_CHARS = 4096


def visual_tokens(media: PreparedMedia) -> int:
    p = media.prepared
    if isinstance(p, PreparedImage):
        return image_tokens(p.pixels.shape[0], p.pixels.shape[1])
    return video_tokens(p.frames.shape[0], p.frames.shape[1], p.frames.shape[2])


def media_facts(media: PreparedMedia) -> MediaFacts:
    p = media.prepared
    common = {
        "sha256": media.sha256,
        "original_size": p.original_size,
        "resized_size": p.resized_size,
        "visual_tokens": visual_tokens(media),
        "cache_hit": media.cache_hit,
    }
    if isinstance(p, PreparedImage):
        return MediaFacts(kind="image", **common)
    return MediaFacts(
        kind="video",
        frames=int(p.frames.shape[0]),
        frame_timestamps=[round(t, 3) for t in p.timestamps],
        duration_s=p.full_duration_s if p.partial and p.full_duration_s else p.duration_s,
        partial=p.partial,
        decoded_duration_s=p.duration_s if p.partial else None,
        sample_fps=round(p.sample_fps, 4),
        **common,
    )


@dataclass(frozen=True, slots=True)
class Context:
    """Facts about the record and the worker that every outgoing message carries."""

    source: SourceCoords
    #: The input record's key: names a dead-letter record when the job_id could not be parsed.
    record_key: str | None
    worker_id: str
    model: str
    model_revision: str | None


def build_result(
    *,
    job: Job,
    media: list[PreparedMedia],
    out: EngineOutput,
    ctx: Context,
    queue_wait_s: float,
    total_s: float,
    parsed: JsonValue = None,
) -> Result:
    return Result(
        job_id=job.job_id,
        text=out.text,
        task=job.task,
        json_=parsed,
        finish_reason=out.finish_reason,
        model=ctx.model,
        model_revision=ctx.model_revision,
        usage=Usage(
            prompt_tokens=out.prompt_tokens,
            visual_tokens=sum(visual_tokens(m) for m in media),
            output_tokens=out.output_tokens,
        ),
        media=[media_facts(m) for m in media],
        timings=Timings(
            queue_wait_s=max(0.0, queue_wait_s),
            fetch_s=max((m.fetch_s for m in media), default=0.0),
            preprocess_s=max((m.preprocess_s for m in media), default=0.0),
            engine_s=out.engine_s,
            total_s=total_s,
        ),
        cache_hit=all(m.cache_hit for m in media),
        source=ctx.source,
        worker_id=ctx.worker_id,
        metadata=job.metadata,
    )


def build_failure(
    *,
    code: ErrorCode,
    message: str,
    retryable: bool,
    attempts: int,
    raw: bytes | None,
    ctx: Context,
    job: Job | None,
    job_id: str | None,
) -> Failure:
    payload, truncated = Failure.bounded_payload(raw or b"")
    return Failure(
        job_id=job.job_id if job else job_id,
        code=code,
        message=message[:MAX_MESSAGE_CHARS],
        retryable=retryable,
        attempts=attempts,
        source=ctx.source,
        worker_id=ctx.worker_id,
        payload=payload,
        payload_truncated=truncated,
        metadata=job.metadata if job else {},
    )
