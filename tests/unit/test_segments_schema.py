"""Segment mode on the wire (1.5): what a job may ask for, what a result carries, task defaults."""

from __future__ import annotations

import json

import pytest
from mmworker_schemas import InvalidSchema, Result, SegmentResult, parse_job
from mmworker_schemas.codes import ErrorCode

from mmworker.config import TaskConfig
from mmworker.tasks import plan_job

VIDEO = {"uri": "file:///data/a.mp4"}


def _job(**over: object) -> bytes:
    doc: dict[str, object] = {"job_id": "j", "media": [VIDEO], **over}
    return json.dumps(doc).encode()


def test_fixed_and_scenes_specs_parse_with_defaults() -> None:
    fixed = parse_job(_job(segments={"mode": "fixed", "every_s": 30}))
    assert fixed.segments is not None
    assert fixed.segments.every_s == 30.0
    assert fixed.segments.summary is None
    scenes = parse_job(_job(segments={"mode": "scenes", "summary": {}}))
    assert scenes.segments is not None
    assert (scenes.segments.min_s, scenes.segments.max_s) == (2.0, 60.0)
    assert scenes.segments.summary is not None
    assert scenes.segments.summary.max_tokens == 256


@pytest.mark.parametrize(
    "segments",
    [
        {"mode": "fixed"},  # no every_s
        {"mode": "scenes", "min_s": 10, "max_s": 5},
        {"mode": "scenes", "max_segments": 0},
        {"mode": "scenes", "threshold": 0},
        {"mode": "chapters"},
    ],
)
def test_bad_specs_are_invalid_schema(segments: dict[str, object]) -> None:
    with pytest.raises(InvalidSchema):
        parse_job(_job(segments=segments))


def test_segments_take_exactly_one_media_item() -> None:
    with pytest.raises(InvalidSchema, match="exactly one media item"):
        parse_job(_job(media=[VIDEO, VIDEO], segments={"mode": "fixed", "every_s": 5}))


def test_a_1_4_job_without_segments_is_unchanged() -> None:
    job = parse_job(_job(schema_version="1.4"))
    assert job.segments is None


def test_result_segments_round_trip_with_json_alias_and_error_code() -> None:
    seg_ok = SegmentResult(start_s=0.0, end_s=5.0, text="red", json_={"colour": "red"}, frames=4)
    seg_bad = SegmentResult.model_validate(
        {"start_s": 5.0, "end_s": 9.0, "error": {"code": "undecodable_video", "message": "x"}}
    )
    wire = seg_ok.model_dump(mode="json")
    assert wire["json"] == {"colour": "red"}
    assert seg_bad.error is not None
    assert seg_bad.error.code is ErrorCode.UNDECODABLE_VIDEO
    fields = Result.model_fields
    assert {"segments", "summary", "segments_cut"} <= set(fields)


def test_task_segments_apply_unless_the_job_sets_its_own() -> None:
    tasks = {
        "chapters": TaskConfig(
            prompt="Describe this {media}.", segments={"mode": "fixed", "every_s": 60}
        )
    }
    job, _ = plan_job(parse_job(_job(task="chapters")), tasks)
    assert job.segments is not None
    assert job.segments.every_s == 60.0
    own = parse_job(_job(task="chapters", segments={"mode": "scenes"}))
    job, _ = plan_job(own, tasks)
    assert job.segments is not None
    assert job.segments.mode == "scenes"
    # A job of several items cannot be segmented (segment mode reads the first alone, and the
    # others were dropped without a word): it runs as one request, every item in it.
    several = parse_job(_job(task="chapters", media=[VIDEO, {"uri": "file:///data/b.mp4"}]))
    job, _ = plan_job(several, tasks)
    assert job.segments is None and len(job.media) == 2
