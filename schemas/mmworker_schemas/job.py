"""The input message: one captioning job as a producer posts it."""

from __future__ import annotations

import json
from typing import Annotated, Literal, TypeAlias

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    model_validator,
)

from mmworker_schemas.segments import SegmentSpec
from mmworker_schemas.version import SCHEMA_VERSION, VERSION_PATTERN

MediaKind = Literal["image", "video"]
VideoStrategy = Literal["fps", "interval", "keyframes"]

#: Metadata is echoed into every result and failure; bounding it keeps one producer from
#: inflating every downstream record.
MAX_METADATA_BYTES = 16 * 1024
MAX_MEDIA_PER_JOB = 16

DEFAULT_PROMPTS: dict[str, str] = {
    "image": "Describe this image in one or two sentences.",
    "video": "Describe what happens in this video in one or two sentences.",
    "mixed": "Describe these images and videos in a few sentences.",
}

Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$", to_lower=True)]
JOB_ID_MAX_LENGTH = 256
JobId = Annotated[
    str,
    StringConstraints(min_length=1, max_length=JOB_ID_MAX_LENGTH, pattern=r"^[^\x00-\x1f]+$"),
]


def _bounded_metadata(value: dict[str, JsonValue]) -> dict[str, JsonValue]:
    size = len(json.dumps(value, separators=(",", ":")).encode())
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is {size} bytes serialised; the limit is {MAX_METADATA_BYTES}")
    return value


class _Frozen(BaseModel):
    # extra="ignore": fields from a newer minor version are dropped, not rejected.
    # bytes travel as base64 in JSON and stay raw bytes in Python.
    model_config = ConfigDict(
        frozen=True, extra="ignore", ser_json_bytes="base64", val_json_bytes="base64"
    )


class MediaRef(_Frozen):
    """Where one image or video comes from: a URI or the bytes themselves."""

    uri: Annotated[str, StringConstraints(min_length=1, max_length=4096)] | None = Field(
        default=None, description="file:// (under the worker's allowed roots) or http(s)://"
    )
    data: bytes | None = Field(default=None, description="Inline media bytes, base64")
    kind: MediaKind | None = Field(
        default=None, description="Declared kind; the real kind is sniffed from the bytes"
    )
    sha256: Sha256Hex | None = Field(
        default=None, description="Expected sha256 of the bytes; a mismatch fails the job"
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> MediaRef:
        if (self.uri is None) == (self.data is None):
            raise ValueError("a media ref needs exactly one of 'uri' or 'data'")
        if self.uri is not None and not self.uri.startswith(("file://", "http://", "https://")):
            raise ValueError("uri must start with file://, http:// or https://")
        return self


class GenerationParams(_Frozen):
    max_tokens: int = Field(default=128, ge=1, le=8192)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: list[Annotated[str, StringConstraints(min_length=1, max_length=64)]] = Field(
        default_factory=list, max_length=8
    )
    ignore_eos: bool = Field(
        default=False,
        description=(
            "Do not stop at the model's end-of-sequence token, so the output is exactly "
            "max_tokens tokens (benchmarks, fixed-length outputs); 'stop' strings still end it. "
            "vLLM's SamplingParams.ignore_eos. Since 1.1; a 1.0 worker ignores it."
        ),
    )


#: Largest pixel count a job may ask for (a gigapixel): far above any image Qwen2.5-VL is
#: given, and small enough that the resize arithmetic in floats cannot overflow (10**400 did).
MAX_PIXELS_OPTION = 1 << 30


class ImageOptions(_Frozen):
    """Overrides of the worker's image defaults; None keeps the worker's value."""

    min_pixels: int | None = Field(default=None, ge=28 * 28, le=MAX_PIXELS_OPTION)
    max_pixels: int | None = Field(default=None, ge=28 * 28, le=MAX_PIXELS_OPTION)


class VideoOptions(_Frozen):
    """Overrides of the worker's video sampling defaults; None keeps the worker's value."""

    strategy: VideoStrategy | None = None
    fps: float | None = Field(default=None, gt=0.0, le=30.0, description="For strategy 'fps'")
    interval_s: float | None = Field(
        # From 10 ms (fps's 30 is 33 ms): 1e-320 made the frame count infinite (OverflowError)
        default=None,
        ge=0.01,
        le=3600.0,
        description="For strategy 'interval'",
    )
    max_frames: int | None = Field(default=None, ge=2, le=768)
    max_pixels: int | None = Field(
        default=None, ge=28 * 28, le=MAX_PIXELS_OPTION, description="Per frame"
    )


TASK_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
TaskName = Annotated[str, StringConstraints(pattern=TASK_NAME_PATTERN)]


class JsonSchemaFormat(_Frozen):
    """The answer is one JSON document valid against `schema`; the result carries it parsed."""

    # "schema" is a BaseModel attribute: the field is `schema_` in Python, "schema" on the wire.
    model_config = ConfigDict(
        validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    type: Literal["json_schema"]
    schema_: dict[str, JsonValue] = Field(
        alias="schema",
        description="JSON Schema of the answer (the subset the grammar backend, xgrammar, "
        "compiles; bounded by the worker's structured_output limits)",
    )


class RegexFormat(_Frozen):
    """The answer is one string matching `regex` (xgrammar's regex dialect: no lookaround)."""

    type: Literal["regex"]
    regex: Annotated[str, StringConstraints(min_length=1, max_length=16384)]


class ChoiceFormat(_Frozen):
    """The answer is exactly one of `choices`."""

    type: Literal["choice"]
    choices: list[Annotated[str, StringConstraints(min_length=1, max_length=1024)]] = Field(
        min_length=1, max_length=1024
    )


#: Since 1.4. What the engine may produce, enforced token by token (vLLM structured outputs).
ResponseFormat: TypeAlias = Annotated[
    JsonSchemaFormat | RegexFormat | ChoiceFormat, Field(discriminator="type")
]


class Job(_Frozen):
    schema_version: Annotated[str, StringConstraints(pattern=VERSION_PATTERN)] = SCHEMA_VERSION
    job_id: JobId = Field(description="Producer-chosen idempotency key; results are keyed by it")
    prompt: Annotated[str, StringConstraints(max_length=16384)] | None = Field(
        default=None,
        description="Instruction text; when absent, the task's prompt, else a default per media "
        "kind",
    )
    task: TaskName | None = Field(
        default=None,
        description="A named task of the worker's config (prompt template and response_format), "
        "e.g. caption, tags, summary, objects, ocr, safety; unknown: unknown_task. Since 1.4",
    )
    response_format: ResponseFormat | None = Field(
        default=None,
        description="Constrain the answer (replaces the task's): a JSON Schema, a regex or a "
        "choice list; the result's `json` holds a JSON answer parsed. Since 1.4",
    )
    media: list[MediaRef] = Field(min_length=1, max_length=MAX_MEDIA_PER_JOB)
    generation: GenerationParams = Field(default_factory=GenerationParams)
    image: ImageOptions = Field(default_factory=ImageOptions)
    video: VideoOptions = Field(default_factory=VideoOptions)
    metadata: Annotated[dict[str, JsonValue], AfterValidator(_bounded_metadata)] = Field(
        default_factory=dict, description="Passed through to the result unchanged"
    )
    reply_topic: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._-]{1,249}$")] | None = (
        Field(default=None, description="Publish the result here instead of the output topic")
    )
    #: Added in 1.5.
    segments: SegmentSpec | None = Field(
        default=None,
        description="Caption a video as timed segments (and optionally summarise them) instead "
        "of once; the job's one media item must be a video. Since 1.5",
    )

    @model_validator(mode="after")
    def _one_video_for_segments(self) -> Job:
        if self.segments is not None and len(self.media) != 1:
            raise ValueError("a job with segments takes exactly one media item (a video)")
        return self

    def instruction(self, kinds: list[str]) -> str:
        """The prompt to use once the media kinds are known (sniffed, not declared), for a job
        without a task (the worker applies a task's prompt itself)."""
        if self.prompt:
            return self.prompt
        distinct = set(kinds)
        return DEFAULT_PROMPTS[distinct.pop() if len(distinct) == 1 else "mixed"]
