"""The worker's exception tree: one root, each error carrying its dead-letter code."""

from __future__ import annotations

from mmworker_schemas.codes import ErrorCode
from mmworker_schemas.errors import CodedError


class WorkerError(CodedError):
    """Root of every error the mmworker package raises."""

    code = ErrorCode.INTERNAL_ERROR


class ConfigError(WorkerError):
    """The configuration is inconsistent; raised at start-up, never per job."""


class EngineFatal(WorkerError):
    """The engine is dead: its jobs wait for a new engine core (`mmworker.recovery`), or, past
    the restart budget, the worker stops, commits nothing further and exits non-zero."""

    code = ErrorCode.ENGINE_ERROR

    def __init__(self, message: str, *, epoch: int = 0) -> None:
        super().__init__(message)
        #: The engine core (`Engine.epoch`) that died: a job that saw an older core's death
        #: after a new one started is run again, not counted as a further death.
        self.epoch = epoch


class PreprocessPoolDead(WorkerError):
    """The preprocessing processes die even with no media to decode (they cannot start, or are
    killed at once): rebuilding their pool does not help, and refusing every job's media for it
    would dead-letter the stream. Like an unexpected error, it stops the worker uncommitted
    (exit 5) for its orchestrator to restart it."""


class EngineCrash(WorkerError):
    """The job was inside the engine at `limits.max_engine_deaths` deaths: a query of death.
    Running it again would kill the engine of whichever worker takes its partition next."""

    code = ErrorCode.ENGINE_CRASH


class RequestFailed(WorkerError):
    """One request failed inside the engine; the job is retried, then dead-lettered."""

    code = ErrorCode.ENGINE_ERROR


class TooManyMedia(WorkerError):
    code = ErrorCode.TOO_MANY_MEDIA


class VisualBudgetExceeded(WorkerError):
    code = ErrorCode.TOO_MANY_VISUAL_TOKENS


class JobTimeout(WorkerError):
    code = ErrorCode.JOB_TIMEOUT


class ForbiddenReplyTopic(WorkerError):
    """A job names a reply topic outside `kafka.reply_topics`: producers may not pick any topic
    (internal ones, other teams', or missing ones that would block the producer on metadata)."""

    code = ErrorCode.FORBIDDEN_REPLY_TOPIC


class PublishRefused(WorkerError):
    """The broker (or the producer) refused this one record for good: it is too large, or
    it put a new producer in its fatal state too. Retrying forever would pin the partition's
    commit, so the job is dead-lettered."""

    code = ErrorCode.PUBLISH_FAILED


class UnknownReplyTopic(PublishRefused):
    """The job's reply topic is allowed (`kafka.reply_topics`) but missing on the broker.

    kafka-python blocks a send to a topic it finds no metadata for up to `kafka.max_block_ms`,
    then fails, and the worker retries until acknowledged: one such job pinned its partition's
    commit for good and held the publishing thread a few seconds a try. Nor is the topic
    created by sending to it where the broker would: a typo in a job must not become a topic."""

    code = ErrorCode.UNKNOWN_REPLY_TOPIC


class TopicRefused(WorkerError):
    """A topic refuses every record (authorization, invalid name): dead-lettering the whole
    stream would be wrong, so the worker stops, uncommitted, for the operator to fix it."""

    code = ErrorCode.PUBLISH_FAILED


class UnknownTask(WorkerError):
    """The job names a task this worker's config does not have: running it with a default
    prompt would answer a question nobody asked."""

    code = ErrorCode.UNKNOWN_TASK


class InvalidResponseFormat(WorkerError):
    """The response_format cannot be run as asked (limits, grammar compilation, a setting that
    would cut the answer). Refused before the engine, so a bad schema costs no fetch, no decode
    and no engine time, and never reaches the engine's grammar compiler."""

    code = ErrorCode.INVALID_RESPONSE_FORMAT


class IncompleteOutput(WorkerError):
    """A guided answer stopped before its grammar completed (at `max_tokens`): publishing it
    would break the promise that `json` validates against the schema."""

    code = ErrorCode.INCOMPLETE_OUTPUT
