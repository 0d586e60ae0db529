"""Decode scheduling: which packets must be decoded for the chosen frames, and on which decoder.

Kept apart from the decoding itself so the choice of work (and its knobs, which the benchmark's
ablations and the speed-up tests turn off) can be read and changed without the PyAV details.
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from mmworker_preprocess.video.timeline import Timeline

#: Decoders working on one video at once: a second one, in its own container, takes the later
#: half of the decode stretches. Frames of a GOP form a reference chain, so FFmpeg's frame
#: threads gain nothing once non-reference frames are skipped (measured); separate GOPs are
#: independent. Two, not one per core: the worker's process pool already spreads jobs over the
#: cores, so this only fills a core left idle when fewer jobs than cores are in flight.
DECODE_THREADS = 2
#: Packets the later half must hold before a second decoder is worth its container and seek.
PARALLEL_MIN_PACKETS = 256


@dataclass(slots=True)
class Run:
    start: int  # decode index of the key frame decoding starts at
    end: int  # decode index of the last packet needed
    wanted: list[int] = field(default_factory=list)  # presentation indices, ascending


def decode_runs(timeline: Timeline, wanted: Sequence[int]) -> list[Run]:
    """Group the wanted frames into decode stretches, each starting at a key frame."""
    packets = timeline.packets
    keys = timeline.key_decode_idx
    runs: list[Run] = []
    for w in wanted:
        d = timeline.shown[w]
        start = 0
        if timeline.timed and keys:
            k = bisect.bisect_right(keys, d) - 1
            # An open-GOP leading picture is shown before its key frame but references the
            # GOP before it, so decoding has to start one key frame earlier.
            while k > 0 and packets[keys[k]].pts > packets[d].pts:
                k -= 1
            start = keys[k] if k >= 0 else 0
        if runs and start <= runs[-1].end + 1:
            runs[-1].end = max(runs[-1].end, d)
            runs[-1].wanted.append(w)
        else:
            runs.append(Run(start, d, [w]))
    for run in runs:
        run.wanted.sort()
    return runs


def split(runs: list[Run]) -> tuple[list[Run], list[Run]]:
    """Cut the runs where about half the packets to decode lie on each side."""
    if len(runs) < 2 or DECODE_THREADS < 2 or usable_cores() < 2:
        return runs, []
    prefix = list(itertools.accumulate(run.end - run.start + 1 for run in runs))
    k = min(range(1, len(runs)), key=lambda i: abs(2 * prefix[i - 1] - prefix[-1]))
    if prefix[-1] - prefix[k - 1] < PARALLEL_MIN_PACKETS:
        return runs, []
    return runs[:k], runs[k:]


def usable_cores() -> int:
    """Cores this process may run on (a container's CPU set, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
