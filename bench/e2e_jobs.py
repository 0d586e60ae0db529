"""The job records every Kafka-fed peer reads, their topics, and how they are posted.

One definition, so the worker passes and the naive loop are given byte-identical jobs.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

PARTITIONS = 4


def make_topics(bootstrap: str, name: str) -> dict[str, str]:
    from mmworker.config import KafkaConfig
    from mmworker.kafka_io import ensure_topics

    tag = uuid.uuid4().hex[:6]
    topics = {k: f"e2e-{tag}.{name}.{k}" for k in ("input", "output", "dlq")}
    cfg = KafkaConfig(bootstrap_servers=bootstrap)
    ensure_topics(
        cfg, {topics["input"]: PARTITIONS, topics["output"]: PARTITIONS, topics["dlq"]: 1}
    )
    return topics


def image_job(job_id: str, path: Path, max_tokens: int, ignore_eos: bool) -> bytes:
    from mmworker_schemas import GenerationParams, Job, MediaRef

    job = Job(
        job_id=job_id,
        media=[MediaRef(data=path.read_bytes())],
        generation=GenerationParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
    )
    return job.model_dump_json().encode()


def video_job(job_id: str, path: Path, max_tokens: int, ignore_eos: bool) -> bytes:
    from mmworker_schemas import GenerationParams, Job, MediaRef

    job = Job(
        job_id=job_id,
        media=[MediaRef(uri=path.resolve().as_uri())],
        generation=GenerationParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
    )
    return job.model_dump_json().encode()


def post(bootstrap: str, topic: str, jobs: list[tuple[str, bytes]]) -> float:
    """Produce and wait for every acknowledgement; returns the seconds it took."""
    from kafka import KafkaProducer

    t0 = time.perf_counter()
    producer = KafkaProducer(
        bootstrap_servers=[bootstrap], acks="all", linger_ms=5, max_request_size=16 << 20
    )
    futures = [producer.send(topic, key=k.encode(), value=v) for k, v in jobs]
    producer.flush()
    for f in futures:
        f.get(timeout=60)
    producer.close()
    return time.perf_counter() - t0
