"""Errors raised while turning raw bytes into a `Job`.

They carry an `ErrorCode` so the worker can write the dead-letter record without a lookup table.
"""

from __future__ import annotations

from mmworker.schemas.codes import ErrorCode


class SchemaError(Exception):
    """Root of every error this package raises."""

    code: ErrorCode = ErrorCode.INVALID_SCHEMA
    #: A malformed message stays malformed: never worth retrying.
    retryable = False

    def __init__(self, message: str, *, job_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.job_id = job_id


class InvalidJson(SchemaError):
    code = ErrorCode.INVALID_JSON


class InvalidSchema(SchemaError):
    code = ErrorCode.INVALID_SCHEMA


class UnsupportedVersion(SchemaError):
    code = ErrorCode.UNSUPPORTED_VERSION
