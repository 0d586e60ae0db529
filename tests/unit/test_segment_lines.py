"""`mmworker tail` on a segment-mode result: the record's line, then each segment with its times
(mm:ss), failed segments in place with their code, the summary and the cut."""

from __future__ import annotations

from mmworker.tools import summarise


def test_segments_are_shown_with_their_times_in_order() -> None:
    doc: dict[str, object] = {
        "job_id": "long",
        "text": "a summary",
        "media": [{"kind": "video"}],
        "segments": [
            {"start_s": 0.0, "end_s": 37.5, "text": "a red screen", "json": None, "error": None},
            {"start_s": 37.5, "end_s": 95.0, "text": "", "json": None,
             "error": {"code": "engine_error", "message": "boom"}},
            {"start_s": 95.0, "end_s": 3725.25, "text": "", "json": {"place": "space"},
             "error": None},
        ],
        "summary": "a summary",
        "segments_cut": "max_segments (3) reached: the video from 3725.2s on has no segments",
    }  # fmt: skip
    lines = summarise("out", doc).splitlines()
    assert lines[0] == "[out] long [video]: 3 segments"
    assert lines[1] == "  00:00.0-00:37.5 'a red screen'"
    assert lines[2] == "  00:37.5-01:35.0 FAILED engine_error: boom"
    assert lines[3] == '  01:35.0-62:05.2 {"place":"space"}'
    assert lines[4] == "  summary: 'a summary'"
    assert lines[5].startswith("  cut: max_segments (3)")


def test_a_result_without_segments_keeps_its_one_line() -> None:
    doc: dict[str, object] = {"job_id": "j", "text": "hi", "media": [{"kind": "image"}]}
    assert summarise("out", doc) == "[out] j [image]: 'hi'"
