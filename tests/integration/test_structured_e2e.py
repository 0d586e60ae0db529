"""Structured results end to end: real broker, real `mmworker run`, real vLLM engine (tiny model).

The tiny model's weights are random, so left alone it writes noise: every answer that validates
against its schema here does so only because the engine's guided decoding allowed nothing else.
Three configured tasks cover a nested object, an array of enums and a regex; a job brings its own
choice list; a job with a schema xgrammar cannot compile gets the typed failure instead of
reaching the engine. The tasks and their schemas are in structured_tasks.py: the worker is the
session's shared one (the `service` fixture), started with them.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from mmworker_schemas import ErrorCode, Job, MediaRef

from mmworker.devkit.samples import sample_image
from mmworker.tools import summarise
from tests.integration.conftest import Service
from tests.integration.structured_tasks import CODE, LABELS, MAX_TOKENS, SCENE
from tests.integration.workerkit import Collector, Posted, post

pytestmark = pytest.mark.integration

START_S = 240  # engine start on 2 CPU cores, first jobs included

SCHEMAS = {"scene": SCENE, "labels": LABELS}
#: A reference to nothing: xgrammar cannot compile it.
UNCOMPILABLE = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
CHOICES = ["yes", "no", "maybe"]


def _jobs() -> list[tuple[str, bytes]]:
    jobs = []
    images = [sample_image(224, 168, seed=s) for s in range(5)]
    for i in range(50):
        task = ("scene", "labels", "code")[i % 3]
        # Greedy and sampled answers both: sampling explores far more of each grammar.
        generation = {"temperature": 1.0, "seed": i} if i % 2 else {"temperature": 0.0}
        job = Job(
            job_id=f"{task}-{i}", task=task, media=[MediaRef(data=images[i % 5])],
            generation=generation, metadata={"source": f"img-{i % 5}.jpg"},
        )  # type: ignore[arg-type]  # fmt: skip
        jobs.append((job.job_id, job.model_dump_json(exclude_defaults=True).encode()))
    extra: list[dict[str, Any]] = [
        {"job_id": "bad-schema", "response_format": {"type": "json_schema",
         "schema": UNCOMPILABLE}},
        {"job_id": "choice", "prompt": "Is it a cat?", "generation": {"max_tokens": 8,
         "temperature": 1.0, "seed": 3}, "response_format": {"type": "choice",
         "choices": CHOICES}},
        {"job_id": "no-such-task", "task": "poetry"},
    ]  # fmt: skip
    for doc in extra:
        job = Job(media=[MediaRef(data=images[0])], **doc)
        jobs.append((job.job_id, job.model_dump_json().encode()))
    return jobs


def test_fifty_guided_jobs_over_three_tasks_all_validate(service: Service) -> None:
    topics, worker = service.topics, service.worker
    jobs = _jobs()
    collector = Collector(
        service.broker.bootstrap, [topics["output"], topics["dlq"]], from_now=True
    )
    try:
        post(service.broker.bootstrap, topics["input"], jobs, Posted())
        collector.wait_for({job_id for job_id, _ in jobs}, START_S, worker)
        answers = {job_id: collector.one(job_id) for job_id, _ in jobs}
    finally:
        collector.close()
    # The whole log: the configured tasks are compiled at start-up, long before these jobs. No
    # other test on this worker sends a response format.
    full_log = worker.log_path.read_text(errors="replace")
    log = worker.log()

    for job_id, (topic, doc) in answers.items():
        task = job_id.split("-")[0]
        if task not in ("scene", "labels", "code"):
            continue
        assert topic == topics["output"], (job_id, doc, log)
        assert doc["task"] == task and doc["finish_reason"] == "stop", doc
        if task == "code":
            assert re.fullmatch(CODE, doc["text"]), doc["text"]
            assert doc["json"] is None
        else:
            jsonschema.validate(doc["json"], SCHEMAS[task])
            assert json.loads(doc["text"], strict=False) == doc["json"]
        assert doc["usage"]["output_tokens"] <= MAX_TOKENS
        # `mmworker tail` shows the parsed fields, not the raw text.
        line = summarise(topic, doc)
        assert f"img-{int(job_id.split('-')[1]) % 5}.jpg" in line and task in line
        if task == "scene":
            assert "place=" in line and "light={" in line

    topic, bad = answers["bad-schema"]
    assert topic == topics["dlq"] and bad["code"] == ErrorCode.INVALID_RESPONSE_FORMAT, bad
    assert "missing" in bad["message"] and bad["retryable"] is False and bad["attempts"] == 1
    topic, choice = answers["choice"]
    assert topic == topics["output"] and choice["text"] in CHOICES and choice["json"] is None
    topic, unknown = answers["no-such-task"]
    assert topic == topics["dlq"] and unknown["code"] == ErrorCode.UNKNOWN_TASK, unknown
    # Each distinct format was compiled once by the worker, not once per job.
    compiled = re.findall(r"response_format \((\w+), \d+ bytes\) (\w+) in", full_log)
    assert sorted(compiled) == [
        ("choice", "compiled"), ("json", "compiled"), ("json", "compiled"), ("json", "refused"),
        ("regex", "compiled"),
    ], log  # fmt: skip
