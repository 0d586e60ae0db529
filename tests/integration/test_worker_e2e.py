"""End to end: real broker, real `mmworker run` process, real vLLM engine on the tiny model."""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
from mmworker_schemas import GenerationParams, Job, MediaRef

from mmworker.devkit.broker import free_port
from mmworker.devkit.samples import sample_image, sample_video
from tests.conftest import GROUP_SETTINGS
from tests.integration.conftest import SERVICE_MAX_BYTES, Service
from tests.integration.workerkit import Collector, Posted, post, wait_committed

pytestmark = pytest.mark.integration

START_S = 240  # engine start on 2 CPU cores, first job included


def _job(job_id: str, ref: MediaRef, **kw: object) -> tuple[str, bytes]:
    job = Job(job_id=job_id, media=[ref], generation=GenerationParams(max_tokens=8), **kw)  # type: ignore[arg-type]
    return job_id, job.model_dump_json().encode()


@pytest.fixture(scope="module")
def env(service: Service) -> Iterator[dict]:  # type: ignore[type-arg]
    """The session's shared worker (conftest.py `service`: its size limit, private networks
    allowed, the reply topic), read from where its topics are when this module begins."""
    workdir = service.workdir
    (workdir / "clip.mp4").write_bytes(sample_video(seconds=3))
    (workdir / "huge.bin").write_bytes(b"\0" * (SERVICE_MAX_BYTES + 1))
    topics = service.topics
    collector = Collector(
        service.broker.bootstrap, [topics["output"], topics["dlq"], topics["replies"]],
        from_now=True,
    )  # fmt: skip
    yield {
        "broker": service.broker, "dir": workdir, "topics": topics, "group": service.group,
        "worker": service.worker, "collector": collector, "metrics_port": service.port,
    }  # fmt: skip
    collector.close()


def test_image_and_video_jobs_produce_results(env: dict) -> None:  # type: ignore[type-arg]
    posted = Posted()
    clip = env["dir"] / "clip.mp4"
    jobs = [_job("img-1", MediaRef(data=sample_image(seed=1))),
            _job("vid-1", MediaRef(uri=clip.as_uri()), metadata={"trace": "abc"})]  # fmt: skip
    post(env["broker"].bootstrap, env["topics"]["input"], jobs, posted)
    env["collector"].wait_for({"img-1", "vid-1"}, START_S, env["worker"])

    topic, image = env["collector"].one("img-1")
    assert topic == env["topics"]["output"], image
    (facts,) = image["media"]
    w, h = facts["resized_size"]
    assert w % 28 == 0 and h % 28 == 0
    assert image["usage"]["visual_tokens"] == (w // 28) * (h // 28) == facts["visual_tokens"]
    assert image["usage"]["prompt_tokens"] > image["usage"]["visual_tokens"]
    assert 1 <= image["usage"]["output_tokens"] <= 8
    assert isinstance(image["text"], str)
    assert (
        image["timings"]["engine_s"] > 0
        and image["timings"]["total_s"] >= image["timings"]["engine_s"]
    )

    topic, video = env["collector"].one("vid-1")
    assert topic == env["topics"]["output"], video
    (vf,) = video["media"]
    assert vf["kind"] == "video" and vf["frames"] % 2 == 0 and vf["frames"] >= 4
    stamps = vf["frame_timestamps"]
    assert len(stamps) == vf["frames"] and stamps == sorted(stamps) and stamps[-1] <= 3.0
    assert video["metadata"] == {"trace": "abc"}
    assert video["source"]["topic"] == env["topics"]["input"]


def test_same_image_at_two_sizes_gets_two_sets_of_features(env: dict) -> None:  # type: ignore[type-arg]
    """vLLM caches processed inputs by `multi_modal_uuids`: the content hash alone would hand the
    second job the first job's features (and prompt length) at the first job's size."""
    posted = Posted()
    data = sample_image(seed=11)  # 640×480
    small = {"max_pixels": 64 * 28 * 28}
    jobs = [_job("size-big", MediaRef(data=data)),
            _job("size-small", MediaRef(data=data), image=small)]  # fmt: skip
    for job in jobs:  # one after the other: the second must meet the first in vLLM's caches
        post(env["broker"].bootstrap, env["topics"]["input"], [job], posted)
        env["collector"].wait_for({job[0]}, START_S, env["worker"])
    (_, big), (_, small) = env["collector"].one("size-big"), env["collector"].one("size-small")
    assert big["media"][0]["sha256"] == small["media"][0]["sha256"]
    assert big["usage"]["visual_tokens"] > small["usage"]["visual_tokens"] > 0
    # Text tokens are the same prompt in both, so the engine saw each job's own visual tokens.
    text = {r["usage"]["prompt_tokens"] - r["usage"]["visual_tokens"] for r in (big, small)}
    assert len(text) == 1, (big["usage"], small["usage"])


def test_sixty_mixed_jobs_with_six_bad_ones(env: dict) -> None:  # type: ignore[type-arg]
    clip = env["dir"] / "clip.mp4"
    good = []
    for i in range(54):
        ref = MediaRef(uri=clip.as_uri()) if i % 9 == 0 else MediaRef(data=sample_image(
            width=160 + 16 * (i % 7), height=120 + 8 * (i % 5), seed=i))  # fmt: skip
        good.append(_job(f"mix-{i}", ref))
    truncated = sample_image(seed=99)[:700]
    bad = [
        ("bad-json", b'{"job_id": "bad-json", "media": [}'),
        (
            "bad-schema",
            json.dumps({"job_id": "bad-schema", "media": [{"uri": "gopher://x"}]}).encode(),
        ),
        _job("bad-image", MediaRef(data=truncated)),
        _job("bad-forbidden", MediaRef(uri="file:///etc/passwd")),
        _job("bad-unreachable", MediaRef(uri=f"http://127.0.0.1:{free_port()}/a.jpg")),
        _job("bad-huge", MediaRef(uri=(env["dir"] / "huge.bin").as_uri())),
    ]
    jobs = good[:20] + bad[:3] + good[20:40] + bad[3:] + good[40:]
    posted = Posted()
    post(env["broker"].bootstrap, env["topics"]["input"], jobs, posted)
    ids = {key for key, _ in jobs}
    env["collector"].wait_for(ids, 300, env["worker"])

    expected = {"bad-json": "invalid_json", "bad-schema": "invalid_schema",
                "bad-image": "undecodable_image", "bad-forbidden": "forbidden_uri",
                "bad-unreachable": "fetch_failed", "bad-huge": "too_large"}  # fmt: skip
    for job_id in ids:
        topic, doc = env["collector"].one(job_id)  # exactly one record per job
        if job_id in expected:
            assert topic == env["topics"]["dlq"], doc
            assert doc["code"] == expected[job_id], doc
            assert doc["message"]
        else:
            assert topic == env["topics"]["output"], doc
    assert env["collector"].one("bad-unreachable")[1]["attempts"] == 2  # retried once
    assert env["collector"].one("bad-unreachable")[1]["retryable"] is True
    assert env["collector"].one("bad-forbidden")[1]["payload"]  # original kept for replay

    ends = posted.ends()
    got = wait_committed(env["broker"].bootstrap, env["group"], env["topics"]["input"], ends)
    for partition, end in ends.items():
        assert got[partition] is not None and got[partition] >= end, (got, ends)


def test_reply_topic_only_where_allowed(env: dict) -> None:  # type: ignore[type-arg]
    posted = Posted()
    replies = {"reply-ok": env["topics"]["replies"], "reply-internal": "__consumer_offsets",
               "reply-other": env["topics"]["input"]}  # fmt: skip
    jobs = [_job(job_id, MediaRef(data=sample_image(seed=i)), reply_topic=topic)
            for i, (job_id, topic) in enumerate(replies.items())]  # fmt: skip
    post(env["broker"].bootstrap, env["topics"]["input"], jobs, posted)
    env["collector"].wait_for({key for key, _ in jobs}, START_S, env["worker"])

    topic, doc = env["collector"].one("reply-ok")
    assert topic == env["topics"]["replies"] and doc["text"] is not None, doc
    for job_id in ("reply-internal", "reply-other"):
        topic, doc = env["collector"].one(job_id)
        assert topic == env["topics"]["dlq"], doc
        assert doc["code"] == "forbidden_reply_topic" and doc["retryable"] is False, doc
        assert "kafka.reply_topics" in doc["message"]
    ends = posted.ends()
    got = wait_committed(env["broker"].bootstrap, env["group"], env["topics"]["input"], ends)
    assert all(got[p] is not None and got[p] >= end for p, end in ends.items()), (got, ends)


def test_repeated_video_is_a_cache_hit_with_counters(env: dict) -> None:  # type: ignore[type-arg]
    clip = env["dir"] / "clip2.mp4"
    clip.write_bytes(sample_video(seconds=2, width=256, height=192))
    posted = Posted()
    post(
        env["broker"].bootstrap,
        env["topics"]["input"],
        [_job("rep-1", MediaRef(uri=clip.as_uri()))],
        posted,
    )
    env["collector"].wait_for({"rep-1"}, 120, env["worker"])
    post(
        env["broker"].bootstrap,
        env["topics"]["input"],
        [_job("rep-2", MediaRef(uri=clip.as_uri()))],
        posted,
    )
    env["collector"].wait_for({"rep-2"}, 120, env["worker"])
    first, second = env["collector"].one("rep-1")[1], env["collector"].one("rep-2")[1]
    assert first["cache_hit"] is False and second["cache_hit"] is True
    assert second["media"][0]["frame_timestamps"] == first["media"][0]["frame_timestamps"]
    assert second["timings"]["preprocess_s"] < first["timings"]["preprocess_s"]
    metrics = (
        urllib.request.urlopen(f"http://127.0.0.1:{env['metrics_port']}/metrics").read().decode()
    )
    hits = [
        ln
        for ln in metrics.splitlines()
        if ln.startswith('mmworker_feature_cache_total{result="hit"}')
    ]
    assert hits and float(hits[0].split()[-1]) >= 1


def test_interop_with_librdkafka_client(env: dict) -> None:  # type: ignore[type-arg]
    confluent_kafka = pytest.importorskip("confluent_kafka")
    bootstrap = env["broker"].bootstrap
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap})
    key, value = _job("rdkafka-1", MediaRef(data=sample_image(seed=5)))
    producer.produce(env["topics"]["input"], key=key.encode(), value=value)
    assert producer.flush(30) == 0
    # The test broker holds a group join about half the session timeout: librdkafka's default
    # 45 s session made this join alone take ~22 s. The test's usual 6 s session
    # (tests/conftest.py GROUP_SETTINGS) keeps it near 3 s; the consumer still joins a group.
    consumer = confluent_kafka.Consumer({
        "bootstrap.servers": bootstrap, "group.id": f"rd-{uuid.uuid4().hex[:6]}",
        "auto.offset.reset": "earliest", "enable.auto.commit": False,
        "session.timeout.ms": GROUP_SETTINGS["session_timeout_ms"],
        "heartbeat.interval.ms": GROUP_SETTINGS["heartbeat_interval_ms"],
    })  # fmt: skip
    consumer.subscribe([env["topics"]["output"]])
    found = None
    try:
        for _ in range(240):
            msg = consumer.poll(1.0)
            if msg is None or msg.error():
                continue
            if msg.key() == b"rdkafka-1":
                found = json.loads(msg.value())
                break
    finally:
        consumer.close()
    assert found is not None, env["worker"].log()
    assert found["job_id"] == "rdkafka-1" and found["usage"]["output_tokens"] >= 1
