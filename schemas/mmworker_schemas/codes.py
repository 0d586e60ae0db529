"""The closed set of failure codes shared by every layer.

One enum, owned by the wire contract, so that a dead-letter consumer can switch on a code without
importing the worker, and so that every typed exception in `preprocess` and `mmworker` maps onto
exactly one value here.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    INVALID_JSON = "invalid_json"
    INVALID_SCHEMA = "invalid_schema"
    UNSUPPORTED_VERSION = "unsupported_version"
    FORBIDDEN_URI = "forbidden_uri"
    FETCH_FAILED = "fetch_failed"
    FETCH_TIMEOUT = "fetch_timeout"
    TOO_LARGE = "too_large"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    UNSUPPORTED_MEDIA = "unsupported_media"
    UNDECODABLE_IMAGE = "undecodable_image"
    UNDECODABLE_VIDEO = "undecodable_video"
    NO_FRAMES = "no_frames"
    BAD_ASPECT_RATIO = "bad_aspect_ratio"
    TOO_MANY_VISUAL_TOKENS = "too_many_visual_tokens"
    TOO_MANY_MEDIA = "too_many_media"
    ENGINE_ERROR = "engine_error"
    JOB_TIMEOUT = "job_timeout"
    INTERNAL_ERROR = "internal_error"
    #: Added in 1.2.
    FORBIDDEN_REPLY_TOPIC = "forbidden_reply_topic"
    PUBLISH_FAILED = "publish_failed"
    #: Added in 1.3: the job was inside the engine at `limits.max_engine_deaths` engine deaths
    #: (a "query of death"); it is not run again.
    ENGINE_CRASH = "engine_crash"
    #: Added in 1.4: the job names a task this worker does not have (`tasks` in its config).
    UNKNOWN_TASK = "unknown_task"
    #: Added in 1.4: the response_format is one the worker will not run: over its size or depth
    #: limits, not compilable by the grammar backend, or combined with `stop`/`ignore_eos`.
    INVALID_RESPONSE_FORMAT = "invalid_response_format"
    #: Added in 1.4: a guided answer did not complete its response_format within `max_tokens`.
    INCOMPLETE_OUTPUT = "incomplete_output"
    #: Added in 1.5: the job's reply_topic is one `kafka.reply_topics` allows, but the broker has
    #: no such topic (the worker does not create it by writing to it).
    UNKNOWN_REPLY_TOPIC = "unknown_reply_topic"


#: Codes whose cause may go away on its own (network, broker, a busy engine); the worker retries
#: these with backoff before dead-lettering. Everything else is a property of the message itself.
RETRYABLE_CODES: frozenset[ErrorCode] = frozenset(
    {
        ErrorCode.FETCH_FAILED,
        ErrorCode.FETCH_TIMEOUT,
        ErrorCode.ENGINE_ERROR,
        ErrorCode.JOB_TIMEOUT,
    }
)
