"""The work counters both passes fill in, apart from either so that both can import them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class DecodeStats:
    """How much work one call did; filled in when passed to `prepare_video`.

    Lets tests prove that sparse sampling does not decode the whole video, and lets the worker
    export decode cost as a metric without timing internals.
    """

    packets: int = 0  # video packets in the stream (first pass)
    decoded: int = 0  # packets sent to the decoder
    seeks: int = 0
    runs: int = 0  # contiguous decode stretches, each starting at a key frame
