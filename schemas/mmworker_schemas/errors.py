"""Errors raised while turning raw bytes into a `Job`, and the coded-error root of every layer.

They carry an `ErrorCode` so the worker can write the dead-letter record without a lookup table.
`CodedError` lives here, in the lowest layer, so that `preprocess` and `mmworker` can derive their
roots from it without importing each other: the worker then reads a code, a message and whether
to retry from any of them the same way.
"""

from __future__ import annotations

from typing import ClassVar

from mmworker_schemas.codes import RETRYABLE_CODES, ErrorCode


class CodedError(Exception):
    """An error that is one dead-letter `ErrorCode`: the class says which (`code`).

    Whether it is worth retrying follows the code (`RETRYABLE_CODES`) unless the raiser knows
    better for this one instance (`retryable=`): a server that broke HTTP once will break it
    again, though a failed fetch is usually transient.
    """

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL_ERROR

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: None follows the code.
        self._retryable = retryable

    @property
    def retryable(self) -> bool:
        if self._retryable is not None:
            return self._retryable
        return self.code in RETRYABLE_CODES


class SchemaError(CodedError):
    """Root of every error this package raises.

    Never retryable: a malformed message stays malformed, and none of these codes is in
    `RETRYABLE_CODES`.
    """

    code = ErrorCode.INVALID_SCHEMA

    def __init__(self, message: str, *, job_id: str | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id


class InvalidJson(SchemaError):
    code = ErrorCode.INVALID_JSON


class InvalidSchema(SchemaError):
    code = ErrorCode.INVALID_SCHEMA


class UnsupportedVersion(SchemaError):
    code = ErrorCode.UNSUPPORTED_VERSION
