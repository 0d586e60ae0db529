"""Typed preprocessing errors, one subclass per dead-letter `ErrorCode`."""

from __future__ import annotations

from mmworker_schemas.codes import ErrorCode
from mmworker_schemas.errors import CodedError


class PreprocessError(CodedError):
    """Root of every error this package raises; `code` is what the dead-letter record carries.

    `retryable=` is set where one instance of a usually-transient code is known to be permanent
    (a server that breaks HTTP will break it again on the retry).
    """

    code = ErrorCode.INTERNAL_ERROR


class ForbiddenUri(PreprocessError):
    code = ErrorCode.FORBIDDEN_URI


class MalformedUri(ForbiddenUri):
    """A URI (the job's, or a redirect's Location) that cannot name a server: never retried,
    since parsing it again gives the same answer."""


class FetchFailed(PreprocessError):
    code = ErrorCode.FETCH_FAILED


class BadResponse(FetchFailed):
    """The server broke HTTP/1.1 or went over one of the response limits.

    Not retryable by default: the same server answers the retry the same way, and each retry of a
    hostile server costs the worker another fetch deadline.
    """

    def __init__(self, message: str, *, retryable: bool | None = False) -> None:
        super().__init__(message, retryable=retryable)


class FetchAborted(FetchFailed):
    """The job that wanted the bytes gave up (timeout, cancellation) and stopped the fetch."""


class FetchTimeout(PreprocessError):
    code = ErrorCode.FETCH_TIMEOUT


class TooLarge(PreprocessError):
    code = ErrorCode.TOO_LARGE


class ChecksumMismatch(PreprocessError):
    code = ErrorCode.CHECKSUM_MISMATCH


class UnsupportedMedia(PreprocessError):
    code = ErrorCode.UNSUPPORTED_MEDIA


class UndecodableImage(PreprocessError):
    code = ErrorCode.UNDECODABLE_IMAGE


class UndecodableVideo(PreprocessError):
    code = ErrorCode.UNDECODABLE_VIDEO


class NoFrames(PreprocessError):
    code = ErrorCode.NO_FRAMES


class BadAspectRatio(PreprocessError):
    code = ErrorCode.BAD_ASPECT_RATIO


class TooManyVisualTokens(PreprocessError):
    code = ErrorCode.TOO_MANY_VISUAL_TOKENS
