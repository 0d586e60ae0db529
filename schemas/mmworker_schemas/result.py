"""The output message: a caption and everything needed to trust and account for it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from mmworker_schemas.job import MediaKind
from mmworker_schemas.segments import SegmentResult
from mmworker_schemas.version import SCHEMA_VERSION


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


def _now() -> datetime:
    return datetime.now(UTC)


class SourceCoords(_Out):
    """Where the job was read from, so any record can be traced back and replayed."""

    topic: str
    partition: int
    offset: int


class Usage(_Out):
    prompt_tokens: int = Field(ge=0, description="All prompt tokens, visual ones included")
    visual_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)


class MediaFacts(_Out):
    kind: MediaKind
    sha256: str
    original_size: tuple[int, int] = Field(description="(width, height) as decoded")
    resized_size: tuple[int, int] = Field(description="(width, height) handed to the model")
    visual_tokens: int = Field(ge=0)
    frames: int | None = Field(
        default=None, description="Frames used (video only), after fitting to the context"
    )
    frame_timestamps: list[float] | None = Field(
        default=None, description="Presentation time in seconds of each frame used"
    )
    duration_s: float | None = Field(
        default=None,
        description="Length of the video in seconds (video only); when partial, the length it "
        "declares rather than the part that decoded",
    )
    #: Added in 1.3.
    partial: bool = Field(
        default=False,
        description="Only part of the video decoded (a cut or damaged file): the frames come "
        "from its first decoded_duration_s seconds",
    )
    #: Added in 1.3.
    decoded_duration_s: float | None = Field(
        default=None,
        description="Seconds of the video that decoded, from its start; set when partial",
    )
    #: Added in 1.3.
    sample_fps: float | None = Field(
        default=None,
        description="Rate the frames were sampled at (video only), frames per second, after "
        "fitting to the context; 1 / sample_fps is the interval between them, and the model's "
        "temporal positions follow it",
    )
    cache_hit: bool = Field(description="Prepared features came from the feature cache")


class Timings(_Out):
    """Seconds spent in each stage; queue_wait is from the broker timestamp to the worker."""

    queue_wait_s: float = Field(ge=0.0)
    fetch_s: float = Field(ge=0.0)
    preprocess_s: float = Field(ge=0.0)
    engine_s: float = Field(
        ge=0.0,
        description="Wall time with at least one of the job's requests in the engine; a "
        "segmented job's overlapping segment requests count once",
    )
    total_s: float = Field(ge=0.0)


class Result(_Out):
    # "json" is a BaseModel attribute: the field is `json_` in Python, "json" on the wire.
    model_config = ConfigDict(
        validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    schema_version: str = SCHEMA_VERSION
    job_id: str
    text: str
    #: Added in 1.4.
    task: str | None = Field(default=None, description="The task the job named, if any")
    #: Added in 1.4.
    json_: JsonValue = Field(
        default=None,
        alias="json",
        description="The answer parsed, when the job or its task asked for a json_schema "
        "response_format: it validates against that schema. null otherwise (free text, regex, "
        "choice: the answer is `text`)",
    )
    finish_reason: Literal["stop", "length", "abort"] | str
    model: str
    model_revision: str | None = None
    usage: Usage
    media: list[MediaFacts]
    timings: Timings
    cache_hit: bool = Field(description="Every media item came from the feature cache")
    source: SourceCoords
    worker_id: str
    metadata: dict[str, JsonValue] = Field(default_factory=dict)
    created_at: datetime = Field(default_factory=_now)
    #: Added in 1.5.
    segments: list[SegmentResult] | None = Field(
        default=None,
        description="Segment mode: one entry per segment, in video order; `text` is then the "
        "summary when one was asked for, else the timed captions one per line",
    )
    #: Added in 1.5.
    summary: str | None = Field(default=None, description="Segment mode: the summary, if asked")
    #: Added in 1.5.
    segments_cut: str | None = Field(
        default=None,
        description="Segment mode: why the video's end has no segments (max_segments reached), "
        "with the time it stops at",
    )
