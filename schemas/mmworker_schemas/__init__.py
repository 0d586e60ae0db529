"""mmworker's wire contract: the messages on the input, output and dead-letter topics.

Only pydantic is imported here so producers and consumers can depend on this package alone.
"""

from mmworker_schemas.codes import RETRYABLE_CODES, ErrorCode
from mmworker_schemas.errors import InvalidJson, InvalidSchema, SchemaError, UnsupportedVersion
from mmworker_schemas.failure import MAX_PAYLOAD_BYTES, Failure
from mmworker_schemas.job import (
    DEFAULT_PROMPTS,
    MAX_MEDIA_PER_JOB,
    ChoiceFormat,
    GenerationParams,
    ImageOptions,
    Job,
    JsonSchemaFormat,
    MediaKind,
    MediaRef,
    RegexFormat,
    ResponseFormat,
    VideoOptions,
    VideoStrategy,
)
from mmworker_schemas.parse import parse_job
from mmworker_schemas.result import MediaFacts, Result, SourceCoords, Timings, Usage
from mmworker_schemas.segments import SegmentError, SegmentResult, SegmentSpec, SummarySpec
from mmworker_schemas.version import SCHEMA_MAJOR, SCHEMA_VERSION

__all__ = [
    "DEFAULT_PROMPTS",
    "MAX_MEDIA_PER_JOB",
    "MAX_PAYLOAD_BYTES",
    "RETRYABLE_CODES",
    "SCHEMA_MAJOR",
    "SCHEMA_VERSION",
    "ChoiceFormat",
    "ErrorCode",
    "Failure",
    "GenerationParams",
    "ImageOptions",
    "InvalidJson",
    "InvalidSchema",
    "Job",
    "JsonSchemaFormat",
    "MediaFacts",
    "MediaKind",
    "MediaRef",
    "RegexFormat",
    "ResponseFormat",
    "Result",
    "SchemaError",
    "SegmentError",
    "SegmentResult",
    "SegmentSpec",
    "SourceCoords",
    "SummarySpec",
    "Timings",
    "UnsupportedVersion",
    "Usage",
    "VideoOptions",
    "VideoStrategy",
    "parse_job",
]
