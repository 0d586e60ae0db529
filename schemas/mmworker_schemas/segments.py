"""Segment mode (added in 1.5): a long video captioned as timed segments, plus a summary.

One caption from a few dozen frames spread over an hour says nothing about *when* anything
happens; captioning each stretch of the video as its own engine request does, and continuous
batching runs those requests side by side. Kept in a module of its own so the job and the result
share these shapes without importing each other.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StringConstraints, model_validator

from mmworker_schemas.codes import ErrorCode

SegmentMode = Literal["fixed", "scenes"]
#: Default cap on segments per job: keeps one result record far under the broker's message limit
#: (a segment with a 128-token caption is well under 1 KiB of JSON).
DEFAULT_MAX_SEGMENTS = 120
MAX_SEGMENTS_LIMIT = 1000

Prompt = Annotated[str, StringConstraints(min_length=1, max_length=16384)]


class _In(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class SummarySpec(_In):
    """A text-only request over the segment captions, once every segment is answered."""

    prompt: Prompt | None = Field(
        default=None,
        description="Instruction put before the timed captions; default: a request for a short "
        "summary of the whole video",
    )
    max_tokens: int = Field(default=256, ge=1, le=8192)


class SegmentSpec(_In):
    """How a video is cut into segments, each captioned as its own request."""

    mode: SegmentMode = Field(
        description="'fixed': every `every_s` seconds; 'scenes': where the picture changes"
    )
    every_s: float | None = Field(
        default=None, gt=0.0, le=3600.0, description="Segment length for mode 'fixed'"
    )
    threshold: float = Field(
        default=0.15,
        gt=0.0,
        le=1.0,
        description="Mode 'scenes': a cut where the mean absolute difference between two "
        "consecutive frames (downscaled to 32x32 RGB, 0..1) is at least this",
    )
    min_s: float = Field(
        default=2.0, ge=0.0, le=3600.0, description="Mode 'scenes': no segment is shorter"
    )
    max_s: float = Field(
        default=60.0,
        gt=0.0,
        le=3600.0,
        description="Mode 'scenes': a segment is cut here even without a scene change",
    )
    max_segments: int = Field(
        default=DEFAULT_MAX_SEGMENTS,
        ge=1,
        le=MAX_SEGMENTS_LIMIT,
        description="Segments captioned at most; the rest of the video is left out and the "
        "result's `segments_cut` says where and why",
    )
    prompt: Prompt | None = Field(
        default=None,
        description="Instruction for each segment; '{start}' and '{end}' become its time range "
        "in seconds. Default: the job's (or task's) prompt with the range before it",
    )
    summary: SummarySpec | None = Field(
        default=None, description="Ask for a summary of the whole video from the captions"
    )

    @model_validator(mode="after")
    def _mode_fields(self) -> SegmentSpec:
        if self.mode == "fixed" and self.every_s is None:
            raise ValueError("segments mode 'fixed' needs every_s")
        if self.min_s > self.max_s:
            raise ValueError("segments min_s is larger than max_s")
        return self


class SegmentError(_In):
    code: ErrorCode
    message: str


class SegmentResult(BaseModel):
    """One segment's answer, in video order; a segment that failed keeps its place."""

    model_config = ConfigDict(
        frozen=True, extra="ignore", validate_by_name=True, validate_by_alias=True,
        serialize_by_alias=True,
    )  # fmt: skip

    start_s: float = Field(ge=0.0)
    end_s: float = Field(ge=0.0)
    text: str = Field(default="", description="The caption; empty when `error` is set")
    json_: JsonValue = Field(
        default=None,
        alias="json",
        description="The answer parsed, when a json_schema response_format applies",
    )
    frames: int = Field(default=0, ge=0, description="Frames the segment was captioned from")
    frame_timestamps: list[float] = Field(default_factory=list)
    finish_reason: str | None = None
    output_tokens: int = Field(default=0, ge=0)
    visual_tokens: int = Field(default=0, ge=0)
    error: SegmentError | None = Field(
        default=None, description="Why this segment has no caption (its decode or generation)"
    )
