"""A job whose reply topic is allowed but missing on the broker, beside ordinary jobs: real
`mmworker run`, real engine, real broker.

The missing job is dead-lettered as `unknown_reply_topic` and the topic is not created; the other
jobs are answered and every input offset is committed. Before, the worker's producer asked for the
topic's metadata on the first send: the test broker (like Kafka with auto.create.topics.enable)
created it and the result went there, and a broker that creates nothing blocked the publishing
thread for `kafka.max_block_ms` a try, retried for good (that half is
tests/unit/test_publish_topics.py's, with a producer that does not create topics).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from kafka import KafkaAdminClient
from mmworker_schemas import GenerationParams, Job, MediaRef

from mmworker.devkit.broker import EmbeddedBroker
from mmworker.devkit.samples import sample_image
from tests.integration.workerkit import (
    Collector,
    Posted,
    WorkerProcess,
    make_topics,
    post,
    wait_committed,
)

pytestmark = pytest.mark.integration

START_S = 240  # engine start on 2 shared CPU cores, first jobs included


def _job(job_id: str, seed: int, reply_topic: str | None = None) -> tuple[str, bytes]:
    job = Job(
        job_id=job_id, media=[MediaRef(data=sample_image(160, 120, seed=seed))],
        generation=GenerationParams(max_tokens=4), reply_topic=reply_topic,
    )  # fmt: skip
    return job_id, job.model_dump_json().encode()


@pytest.mark.timeout(420)
def test_a_missing_reply_topic_is_dead_lettered_and_the_others_are_answered(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    topics = make_topics(broker.bootstrap, "replytopic")
    missing = f"replytopic-{uuid.uuid4().hex[:6]}.missing"
    group = f"replytopic-{uuid.uuid4().hex[:6]}"
    extra = {"kafka.reply_topics": [topics["replies"], missing]}
    worker = WorkerProcess(broker.bootstrap, tmp_path, topics, group, extra)
    # Topics are made above; --create-topics would create the missing one too.
    at = worker.cmd.index("--create-topics")
    del worker.cmd[at : at + 2]

    jobs = [_job(f"missing-{i}", i, missing) for i in range(2)]
    jobs += [_job(f"plain-{i}", 10 + i) for i in range(6)]
    jobs += [_job(f"reply-{i}", 20 + i, topics["replies"]) for i in range(2)]
    posted = Posted()
    post(broker.bootstrap, topics["input"], jobs, posted)
    collector = Collector(broker.bootstrap, [topics["output"], topics["dlq"], topics["replies"]])
    with worker:
        try:
            collector.wait_for({job_id for job_id, _ in jobs}, START_S, worker)
            got = wait_committed(broker.bootstrap, group, topics["input"], posted.ends())
        finally:
            collector.close()
        log = worker.log()

    for i in range(2):
        topic, failure = collector.one(f"missing-{i}")
        assert topic == topics["dlq"], (topic, failure)
        assert failure["code"] == "unknown_reply_topic" and failure["retryable"] is False
        assert missing in failure["message"]
        assert collector.one(f"reply-{i}")[0] == topics["replies"]
    for i in range(6):
        assert collector.one(f"plain-{i}")[0] == topics["output"]
    assert all(got[p] == end for p, end in posted.ends().items()), (got, posted.ends(), log)
    admin = KafkaAdminClient(bootstrap_servers=[broker.bootstrap])
    try:
        assert missing not in admin.list_topics()  # the worker did not create it
    finally:
        admin.close()
