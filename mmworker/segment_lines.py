"""How a segment-mode result reads in `mmworker tail`: one line per segment with its times, then
the summary (kept out of tools.py so that module stays about records in general)."""

from __future__ import annotations

import json

#: Characters of a caption, summary or JSON answer shown per line.
WIDTH = 100


def segment_lines(doc: dict[str, object]) -> list[str]:
    """Indented lines under the record's own line; none for a result without segments."""
    segments = doc.get("segments")
    if not isinstance(segments, list):
        return []
    lines = []
    for seg in segments:
        if not isinstance(seg, dict):
            continue
        when = f"{_seconds(seg.get('start_s'))}-{_seconds(seg.get('end_s'))}"
        error = seg.get("error")
        if isinstance(error, dict):
            body = f"FAILED {error.get('code')}: {error.get('message')}"
        elif seg.get("json") is not None:
            body = json.dumps(seg["json"], separators=(",", ":"), ensure_ascii=False)
        else:
            body = repr(str(seg.get("text", "")))
        lines.append(f"  {when} {_cut(body)}")
    if doc.get("summary"):
        lines.append(f"  summary: {_cut(repr(str(doc['summary'])))}")
    if doc.get("segments_cut"):
        lines.append(f"  cut: {doc['segments_cut']}")
    return lines


def _seconds(value: object) -> str:
    """mm:ss.s, so a long video's times read as times."""
    if not isinstance(value, (int, float)):
        return "?"
    minutes, seconds = divmod(float(value), 60.0)
    return f"{int(minutes):02d}:{seconds:04.1f}"


def _cut(text: str) -> str:
    return text if len(text) <= WIDTH else text[: WIDTH - 1] + "…"
