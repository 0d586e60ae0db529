"""Visual-token accounting from resized sizes, so oversized items are refused before the engine.

vLLM fails a whole request when one item exceeds its encoder cache ("item exceeds the
pre-allocated encoder cache size", vLLM #34040); counting here turns that into a typed error.
"""

from __future__ import annotations

from preprocess.errors import TooManyVisualTokens
from preprocess.params import FRAME_FACTOR, IMAGE_FACTOR


def image_tokens(height: int, width: int) -> int:
    """Tokens of one resized image: one per 28×28 block (14-pixel patches merged 2×2)."""
    return (height // IMAGE_FACTOR) * (width // IMAGE_FACTOR)


def video_tokens(frames: int, height: int, width: int) -> int:
    """Tokens of a resized video: frames are merged in pairs (temporal patch 2)."""
    return (frames // FRAME_FACTOR) * image_tokens(height, width)


def check_budget(tokens: int, limit: int, what: str) -> None:
    if tokens > limit:
        raise TooManyVisualTokens(f"{what} needs {tokens} visual tokens; the limit is {limit}")
