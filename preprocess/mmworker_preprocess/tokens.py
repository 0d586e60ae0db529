"""Visual-token accounting from resized sizes, and fitting sizes and shares to a token budget.

vLLM fails a whole request when one item exceeds its encoder cache ("item exceeds the
pre-allocated encoder cache size", vLLM #34040); counting here turns that into a typed error,
and fitting (see `fit_pixels`, `fair_shares`) turns most such refusals into smaller inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmworker_preprocess.errors import TooManyVisualTokens
from mmworker_preprocess.params import FRAME_FACTOR, IMAGE_FACTOR, TOKEN_PIXELS
from mmworker_preprocess.resize import settle, smart_resize


def image_tokens(height: int, width: int) -> int:
    """Tokens of one resized image: one per 28×28 block (14-pixel patches merged 2×2)."""
    return (height // IMAGE_FACTOR) * (width // IMAGE_FACTOR)


def video_tokens(frames: int, height: int, width: int) -> int:
    """Tokens of a resized video: frames are merged in pairs (temporal patch 2)."""
    return (frames // FRAME_FACTOR) * image_tokens(height, width)


def check_budget(tokens: int, limit: int, what: str) -> None:
    if tokens > limit:
        raise TooManyVisualTokens(f"{what} needs {tokens} visual tokens; the limit is {limit}")


def resized(
    height: int, width: int, *, min_pixels: int, max_pixels: int, max_ratio: float, video: bool
) -> tuple[int, int]:
    """(height, width) the model gets for a source of this size: smart_resize, then settled."""
    return settle(
        *smart_resize(
            height,
            width,
            factor=IMAGE_FACTOR,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            max_ratio=max_ratio,
        ),
        video=video,
    )


def fit_pixels(
    height: int,
    width: int,
    *,
    tokens: int,
    start: int,
    floor: int,
    min_pixels: int,
    max_ratio: float,
    video: bool,
) -> int | None:
    """A pixel cap in [floor, start] at which one picture (or frame) of this source takes at most
    `tokens` tokens, the highest one found going down from `start`; None when `floor` is over.

    A cap of `tokens` × 28² almost always fits at once (smart_resize shrinks to at most the
    cap); rounding and settle's bounds on thin sources may overshoot, and the cap then shrinks
    in proportion to the overshoot, at least one token's pixels per step.
    """
    cap = max(floor, min(start, tokens * TOKEN_PIXELS))
    while True:
        h, w = resized(
            height, width, min_pixels=min_pixels, max_pixels=cap, max_ratio=max_ratio, video=video
        )
        need = image_tokens(h, w)
        if need <= tokens:
            return cap
        if cap <= floor:
            return None
        cap = max(floor, min(cap - TOKEN_PIXELS, cap * tokens // need))


def fair_shares(needs: Sequence[int], capacity: int) -> list[int]:
    """Split `capacity` tokens among items needing `needs`: max-min fair (water-filling).

    Items needing no more than an equal share of what is left keep what they need, smallest
    first; the rest split the remainder equally (the first of them get the odd tokens). So a
    job that fits is untouched, a small image beside a long video keeps its size, and only the
    items above the common level are fitted down to it.
    """
    shares = list(needs)
    if sum(needs) <= capacity:
        return shares
    order = sorted(range(len(needs)), key=lambda i: needs[i])
    left = max(capacity, 0)
    for pos, i in enumerate(order):
        count = len(order) - pos
        if needs[i] * count <= left:
            left -= needs[i]
            continue
        level, extra = divmod(left, count)
        for rank, j in enumerate(order[pos:]):
            shares[j] = level + (1 if rank < extra else 0)
        break
    return shares
