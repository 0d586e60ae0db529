"""The naive peer: what a first implementation writes, one job at a time start to finish.

The worker has to beat it by a wide margin to justify its concurrency; it uses the worker's own
fetch, preprocessing and engine inputs, so only the scheduling differs.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

from bench.common import PeerStats


def naive_loop(
    llm: Any,
    tokenizer: Any,
    cfg: Any,
    bootstrap: str,
    topics: dict[str, str],
    sampling: Any,
    limit: int,
) -> dict[str, Any]:
    """What a first implementation writes: one job at a time, synchronously, start to finish."""
    from kafka import KafkaConsumer, KafkaProducer
    from mmworker_preprocess.fetch import fetch_bytes
    from mmworker_preprocess.prepare import prepare_media
    from mmworker_schemas import parse_job

    from mmworker.engine import EngineItem, _mm_data

    consumer = KafkaConsumer(
        topics["input"],
        bootstrap_servers=[bootstrap],
        group_id=f"naive-{uuid.uuid4().hex[:6]}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=1,
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
        fetch_max_bytes=64 << 20,
        max_partition_fetch_bytes=16 << 20,
    )
    producer = KafkaProducer(bootstrap_servers=[bootstrap], acks="all")
    policy = cfg.preprocess.fetch_policy()
    latencies: list[float] = []
    generate_s = 0.0
    tokens = 0
    done = 0
    first = last = None
    kind = "image"
    deadline = time.monotonic() + 3600
    while done < limit and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=1000, max_records=1).values():
            for record in records:
                t0 = time.perf_counter()
                first = first or t0
                job = parse_job(record.value)
                data = fetch_bytes(job.media[0], policy)
                item = prepare_media(
                    data,
                    cfg.preprocess.image_params(job.image.min_pixels, job.image.max_pixels),
                    cfg.preprocess.video_params(
                        job.video.strategy,
                        job.video.fps,
                        job.video.interval_s,
                        job.video.max_frames,
                        job.video.max_pixels,
                    ),
                )
                kind = EngineItem(item, "").kind
                content = [{"type": kind}, {"type": "text", "text": job.instruction([kind])}]
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": content}],
                    tokenize=False,
                    add_generation_prompt=True,
                )
                prompt = {
                    "prompt": text,
                    "multi_modal_data": _mm_data([EngineItem(item, "")], raw_pixels=False),
                }
                g0 = time.perf_counter()
                out = llm.generate([prompt], sampling, use_tqdm=False)[0]
                generate_s += time.perf_counter() - g0
                n = len(out.outputs[0].token_ids)
                tokens += n
                result = {
                    "job_id": job.job_id,
                    "text": out.outputs[0].text,
                    "usage": {"output_tokens": n},
                }
                producer.send(
                    topics["output"], key=job.job_id.encode(), value=json.dumps(result).encode()
                ).get(timeout=30)
                consumer.commit()
                last = time.perf_counter()
                latencies.append(last - t0)
                done += 1
    consumer.close()
    producer.close()
    wall = (last - first) if first is not None and last is not None else 0.0
    stats = PeerStats(
        peer="naive",
        kind=kind,
        jobs=done,
        wall_s=wall,
        output_tokens=tokens,
        latencies_s=latencies,
        busy_s=generate_s,
    )
    print(f"naive {kind}: {stats.jobs_per_s:.2f} jobs/s", flush=True)
    return {**stats.to_json(), "loadavg_1m_at_end": round(os.getloadavg()[0], 2)}
