"""Typed preprocessing errors, one subclass per dead-letter `ErrorCode`."""

from __future__ import annotations

from schemas.codes import RETRYABLE_CODES, ErrorCode


class PreprocessError(Exception):
    """Root of every error this package raises; `code` is what the dead-letter record carries."""

    code: ErrorCode = ErrorCode.INTERNAL_ERROR

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE_CODES


class ForbiddenUri(PreprocessError):
    code = ErrorCode.FORBIDDEN_URI


class FetchFailed(PreprocessError):
    code = ErrorCode.FETCH_FAILED


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
