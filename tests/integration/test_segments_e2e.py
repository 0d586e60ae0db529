"""Segment mode end to end: real broker, the session's real `mmworker run`, real vLLM engine (tiny
model). A generated 10-minute clip (64x64, 4 fps) changes colour at known times; the worker
finds every change, cuts fixed segments where asked, captions every segment, summarises them and,
for a structured task, returns JSON valid against the task's schema for every segment; the same
clip posted again is captioned from cached segments only, with the same captions.
"""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
from mmworker_schemas import Job, MediaRef

from tests.integration.conftest import Service
from tests.integration.structured_tasks import SCENE
from tests.integration.workerkit import Collector, Posted, metric_sum, post
from tests.media_scenes import scene_video

pytestmark = pytest.mark.integration

START_S = 600  # engine start on 2 busy CPU cores, then ~30 segment requests and two summaries
DURATION_S = 600.0
#: Scene changes (s). Every scene is shorter than MAX_S, so every boundary is a scene change.
CUTS = [37.5, 95.0, 160.0, 230.25, 300.0, 345.0, 410.0, 480.5, 540.0]
MAX_S = 90.0
#: Few, small frames per segment: the tiny model's context is 4096 tokens.
VIDEO = {"fps": 0.25, "max_frames": 4}


def _jobs(clip: bytes) -> list[tuple[str, bytes]]:
    media = [MediaRef(data=clip)]
    jobs = [
        Job(
            job_id="seg-scenes", media=media, video=VIDEO,
            generation={"max_tokens": 12},
            segments={"mode": "scenes", "min_s": 5.0, "max_s": MAX_S,
                      "summary": {"max_tokens": 16}},
        ),
        Job(
            job_id="seg-fixed", media=media, video=VIDEO, generation={"max_tokens": 8},
            segments={"mode": "fixed", "every_s": 60.0, "summary": {}},
        ),
        Job(
            job_id="seg-structured", task="scene", media=media, video=VIDEO,
            segments={"mode": "fixed", "every_s": 120.0},
        ),
        Job(
            job_id="seg-capped", media=media, video=VIDEO, generation={"max_tokens": 4},
            segments={"mode": "fixed", "every_s": 60.0, "max_segments": 3},
        ),
    ]  # type: ignore[arg-type]  # fmt: skip
    return [(j.job_id, j.model_dump_json(exclude_defaults=True).encode()) for j in jobs]


def _wait_for_cache_writes(port: int) -> None:
    """Segments are written to the feature cache by one low-priority thread after they are
    captioned, not awaited by the job: on two busy cores the last writes can trail the answers.
    Settled = the cache's size unchanged for 2 s."""
    deadline = time.monotonic() + 120
    last, still_since = metric_sum(port, "mmworker_feature_cache_bytes"), time.monotonic()
    while time.monotonic() - still_since < 2.0:
        assert time.monotonic() < deadline, "the feature cache kept growing for 120 s"
        time.sleep(0.25)
        now = metric_sum(port, "mmworker_feature_cache_bytes")
        if now != last:
            last, still_since = now, time.monotonic()


@pytest.mark.timeout(START_S + 600)  # the shared worker may start inside it (up to 300 s)
def test_ten_minute_clip_in_scene_and_fixed_segments(service: Service) -> None:
    clip = scene_video(CUTS, DURATION_S)
    jobs = _jobs(clip)
    topics, worker = service.topics, service.worker
    collector = Collector(
        service.broker.bootstrap, [topics["output"], topics["dlq"]], from_now=True
    )
    try:
        post(service.broker.bootstrap, topics["input"], jobs, Posted())
        collector.wait_for({job_id for job_id, _ in jobs}, START_S, worker)
        answers = {job_id: collector.one(job_id) for job_id, _ in jobs}
    finally:
        collector.close()
    for job_id, (topic, doc) in answers.items():
        assert topic == topics["output"], (job_id, doc)
        for seg in doc["segments"]:
            assert seg["error"] is None, (job_id, seg)
            assert seg["text"], (job_id, seg)  # every segment has a caption
            assert seg["frames"] >= 2
        # Its segment requests overlap in the engine; they count once.
        assert 0 < doc["timings"]["engine_s"] <= doc["timings"]["total_s"], doc["timings"]

    scenes = answers["seg-scenes"][1]
    bounds = [s["start_s"] for s in scenes["segments"][1:]]
    assert len(bounds) == len(CUTS), bounds
    for found, cut in zip(bounds, CUTS, strict=True):
        assert abs(found - cut) <= 1.0, (bounds, CUTS)
    assert scenes["segments"][0]["start_s"] == 0.0
    assert scenes["segments"][-1]["end_s"] == pytest.approx(DURATION_S, abs=0.5)
    assert scenes["summary"], scenes
    assert scenes["text"] == scenes["summary"]

    fixed = answers["seg-fixed"][1]
    assert [(s["start_s"], s["end_s"]) for s in fixed["segments"]] == [
        (pytest.approx(60.0 * k), pytest.approx(60.0 * (k + 1))) for k in range(10)
    ]
    assert fixed["summary"]
    assert fixed["segments_cut"] is None

    structured = answers["seg-structured"][1]
    assert len(structured["segments"]) == 5
    for seg in structured["segments"]:
        jsonschema.validate(seg["json"], SCENE)

    capped = answers["seg-capped"][1]
    assert len(capped["segments"]) == 3
    assert "max_segments (3)" in capped["segments_cut"]
    assert "180.0s" in capped["segments_cut"]
    assert capped["summary"] is None

    # The same video again: every segment comes from the feature cache (nothing is decoded), the
    # captions are the same.
    again = [
        (f"{job_id}-again", json.dumps({**json.loads(value), "job_id": f"{job_id}-again"}).encode())
        for job_id, value in jobs
        if job_id in ("seg-scenes", "seg-fixed")
    ]
    _wait_for_cache_writes(service.port)
    collector = Collector(
        service.broker.bootstrap, [topics["output"], topics["dlq"]], from_now=True
    )
    try:
        post(service.broker.bootstrap, topics["input"], again, Posted())
        collector.wait_for({job_id for job_id, _ in again}, START_S, worker)
        repeats = {job_id: collector.one(job_id) for job_id, _ in again}
    finally:
        collector.close()
    for job_id, (topic, doc) in repeats.items():
        first = answers[job_id.removesuffix("-again")][1]
        assert topic == topics["output"], (job_id, doc)
        assert doc["cache_hit"] is True and doc["media"][0]["cache_hit"] is True, doc
        assert [(s["start_s"], s["end_s"], s["text"]) for s in doc["segments"]] == [
            (s["start_s"], s["end_s"], s["text"]) for s in first["segments"]
        ]
