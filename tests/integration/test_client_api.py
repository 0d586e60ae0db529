"""The Python client (`mmworker.client.Client`) against the real broker and the real worker, and
`submit` built on it (issue #35 items 6 and 7): a service posts jobs and reads typed answers
by job id; `submit` passes --task and --response-format into the job and, off a terminal,
draws no progress bar."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from mmworker_schemas import ChoiceFormat, ErrorCode, Failure, Job, MediaRef, Result

from mmworker.client import Ack, Client
from mmworker.config import KafkaConfig, WorkerConfig
from mmworker.devkit.broker import EmbeddedBroker
from mmworker.devkit.samples import sample_image
from mmworker.kafka_io import ensure_topics
from tests.integration.conftest import Service

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]


def _submit(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMWORKER_")}
    return subprocess.run(
        [sys.executable, "-m", "mmworker", "submit", *args], capture_output=True, text=True,
        timeout=120, env=env, cwd=ROOT, check=False,
    )  # fmt: skip


def test_submit_sends_task_and_response_format_and_draws_no_bar_off_a_terminal(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    topic = f"submit-{uuid.uuid4().hex[:6]}"
    ensure_topics(KafkaConfig(bootstrap_servers=broker.bootstrap), {topic: 1})
    files = []
    for i in range(3):
        path = tmp_path / f"p{i}.jpg"
        path.write_bytes(sample_image(seed=i, width=64, height=48))
        files.append(str(path))
    choice = '{"type": "choice", "choices": ["indoor", "outdoor"]}'
    common = ["--bootstrap-servers", broker.bootstrap, "--topic", topic, "--task", "tags"]

    many = _submit(*files, *common, "--response-format", choice)
    assert many.returncode == 0, many.stderr
    # stderr is a pipe here: no bar redrawn with carriage returns, the summary last (after
    # the one-line warning that no worker consumes this group, which is true here).
    assert "\r" not in many.stderr and "submitting" not in many.stderr, many.stderr
    assert many.stderr.splitlines()[-1] == f"sent 3 jobs to {topic}"
    one = _submit(files[0], *common)
    assert one.returncode == 0, one.stderr
    assert "\r" not in one.stderr and "submitting" not in one.stderr, one.stderr
    assert one.stderr.splitlines()[-1] == f"sent 1 job to {topic}"

    ids = [line.split("\t")[0] for line in (many.stdout + one.stdout).splitlines()]
    cfg = WorkerConfig(kafka=KafkaConfig(bootstrap_servers=broker.bootstrap))
    with Client(cfg) as client:
        jobs = [
            Job.model_validate_json(r.value) for r in client.records([topic], idle_timeout_s=10)
        ]
    assert [j.job_id for j in jobs] == ids
    assert all(j.task == "tags" for j in jobs)
    expected = ChoiceFormat(type="choice", choices=["indoor", "outdoor"])
    assert [j.response_format for j in jobs] == [expected, expected, expected, None]


def test_a_service_posts_jobs_and_reads_typed_answers_by_job_id(service: Service) -> None:
    topics = service.topics
    cfg = WorkerConfig(
        kafka=KafkaConfig(
            bootstrap_servers=service.broker.bootstrap, input_topic=topics["input"],
            output_topic=topics["output"], dead_letter_topic=topics["dlq"],
        )
    )  # fmt: skip
    tag = uuid.uuid4().hex[:6]
    good = Job(job_id=f"client-ok-{tag}", media=[MediaRef(data=sample_image(seed=7))],
               metadata={"from": "client"})  # fmt: skip
    bad = Job(job_id=f"client-bad-{tag}", media=[MediaRef(uri="file:///etc/passwd")])
    with Client(cfg) as client:
        acks = [client.post(job).result(timeout=30) for job in (good, bad)]
        assert all(isinstance(a, Ack) and a.topic == topics["input"] for a in acks)
        assert [a.job_id for a in acks] == [good.job_id, bad.job_id]
        answers = {a.job_id: a for a in client.results({good.job_id, bad.job_id}, timeout=180)}
    result, failure = answers[good.job_id], answers[bad.job_id]
    assert isinstance(result, Result) and result.text and result.metadata == {"from": "client"}
    assert result.media[0].kind == "image"
    assert isinstance(failure, Failure) and failure.code == ErrorCode.FORBIDDEN_URI
    assert not failure.retryable


def test_results_stop_at_the_timeout_when_an_answer_never_comes(broker: EmbeddedBroker) -> None:
    out, dlq = f"out-{uuid.uuid4().hex[:6]}", f"dlq-{uuid.uuid4().hex[:6]}"
    ensure_topics(KafkaConfig(bootstrap_servers=broker.bootstrap), {out: 1, dlq: 1})
    cfg = WorkerConfig(kafka=KafkaConfig(bootstrap_servers=broker.bootstrap, output_topic=out,
                                         dead_letter_topic=dlq))  # fmt: skip
    with Client(cfg) as client:
        assert list(client.results({"never-posted"}, timeout=1.0)) == []
