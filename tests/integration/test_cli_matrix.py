"""The commands that need a broker, run as a person runs them (issue #12): `tail -f` until Ctrl-C,
`tail --from-now`, `submit` and `tail` on the worker's own configuration, what `submit` skips
and why, `mmworker broker` by hand, and a demo whose output is the worker's, not vLLM's."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import IO

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

from mmworker.config import KafkaConfig
from mmworker.devkit.broker import EmbeddedBroker, free_port
from mmworker.devkit.samples import sample_image
from mmworker.errors import ConfigError
from mmworker.kafka_io import check_brokers, ensure_topics

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMWORKER_")}
    return env | (extra or {})


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mmworker", *args], capture_output=True, text=True, timeout=120,
        env=_env(env), cwd=ROOT, check=False,
    )  # fmt: skip


class Running:
    """A command left running: its stdout lines arrive in a queue, it stops on a signal."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mmworker", *args], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=_env(env), cwd=ROOT,
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))

    def line(self, timeout: float = 60) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError(f"no output; stderr: {self.proc.communicate()[1]}") from None

    def stop(self, sig: signal.Signals = signal.SIGINT) -> tuple[int, str]:
        self.proc.send_signal(sig)
        assert self.proc.stderr is not None
        code = self.proc.wait(timeout=60)
        return code, self.proc.stderr.read()


def _topic(broker: EmbeddedBroker, prefix: str, partitions: int = 1) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    ensure_topics(KafkaConfig(bootstrap_servers=broker.bootstrap), {name: partitions})
    return name


def _post(broker: EmbeddedBroker, topic: str, *docs: dict[str, object]) -> None:
    producer = KafkaProducer(bootstrap_servers=[broker.bootstrap], acks="all")
    for doc in docs:
        producer.send(topic, key=str(doc["job_id"]).encode(), value=json.dumps(doc).encode())
    producer.flush()
    producer.close()


def _result(job_id: str, source: str | None = None) -> dict[str, object]:
    doc: dict[str, object] = {"job_id": job_id, "text": f"caption {job_id}",
                              "media": [{"kind": "image"}]}  # fmt: skip
    if source:
        doc["metadata"] = {"source": source}
    return doc


def _read_all(broker: EmbeddedBroker, topic: str) -> list[dict[str, object]]:
    consumer = KafkaConsumer(
        topic, bootstrap_servers=[broker.bootstrap], group_id=None, auto_offset_reset="earliest",
        enable_auto_commit=False, consumer_timeout_ms=3000,
    )  # fmt: skip
    try:
        return [json.loads(r.value) for r in consumer]
    finally:
        consumer.close()


def test_check_brokers_passes_a_real_broker_behind_a_dead_one(broker: EmbeddedBroker) -> None:
    dead = f"127.0.0.1:{free_port()}"
    check_brokers(KafkaConfig(bootstrap_servers=f"{dead},{broker.bootstrap}"), 5.0)
    with pytest.raises(ConfigError, match=r"^cannot reach the Kafka brokers"):
        check_brokers(KafkaConfig(bootstrap_servers=dead), 5.0)


def test_tail_follow_prints_records_then_stops_cleanly_on_ctrl_c(broker: EmbeddedBroker) -> None:
    topic = _topic(broker, "tail-f")
    _post(broker, topic, _result("first", "/data/a.jpg"))
    tail = Running("tail", "-f", "--topics", topic, "--bootstrap-servers", broker.bootstrap)
    assert tail.line() == f"[{topic}] /data/a.jpg (job first) [image]: 'caption first'"
    _post(broker, topic, _result("second"))
    assert tail.line() == f"[{topic}] second [image]: 'caption second'"
    code, err = tail.stop(signal.SIGINT)
    assert code == 0
    assert re.fullmatch(r"2 records in \d+\.\ds\n", err), err


def test_tail_from_now_skips_what_was_already_there(broker: EmbeddedBroker) -> None:
    topic = _topic(broker, "tail-now")
    _post(broker, topic, _result("old"))
    tail = Running("tail", "--follow", "--from-now", "--json", "--topics", topic,
                   "--bootstrap-servers", broker.bootstrap)  # fmt: skip
    # Post until one arrives: the reader is positioned at the end by then.
    for i in range(60):
        _post(broker, topic, _result(f"new-{i}"))
        try:
            first = tail.lines.get(timeout=1)
            break
        except queue.Empty:
            continue
    else:
        raise AssertionError("tail --from-now printed nothing")
    assert json.loads(first)["job_id"].startswith("new-")
    code, err = tail.stop(signal.SIGTERM)
    assert code == 0, err
    assert "old" not in first


def test_tail_without_follow_stops_when_idle(broker: EmbeddedBroker) -> None:
    topic = _topic(broker, "tail-idle")
    out = _cli("tail", "--topics", topic, "--timeout", "1", "--bootstrap-servers",
               broker.bootstrap)  # fmt: skip
    assert out.returncode == 0
    assert out.stdout == ""
    assert re.fullmatch(r"0 records in \d+\.\ds\n", out.stderr), out.stderr


def test_submit_and_tail_use_the_workers_configuration(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    jobs, results = _topic(broker, "cfg-jobs"), _topic(broker, "cfg-results")
    config = tmp_path / "worker.toml"
    config.write_text(f'[kafka]\nbootstrap_servers = "{broker.bootstrap}"\n'
                      f'input_topic = "{jobs}"\n')  # fmt: skip
    image = tmp_path / "cat.jpg"
    image.write_bytes(sample_image(seed=5))
    sent = _cli("submit", str(image), "--config", str(config), "--prompt", "Name it.",
                "--max-tokens", "12", "--temperature", "0.7", "--top-p", "0.9", "--seed", "3",
                "--repeat", "2")  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    assert sent.stderr.endswith(f"sent 2 jobs to {jobs}\n")
    posted = _read_all(broker, jobs)
    assert len(posted) == 2
    for job in posted:
        assert job["metadata"] == {"source": str(image)}
        assert job["prompt"] == "Name it."
        assert job["generation"] == {"max_tokens": 12, "temperature": 0.7, "top_p": 0.9,
                                     "seed": 3}  # fmt: skip
    assert {f"{j['job_id']}\t{image}" for j in posted} == set(sent.stdout.splitlines())

    dlq = _topic(broker, "cfg-dlq")
    _post(broker, results, _result("r1", str(image)))
    _post(broker, dlq, {"job_id": "f1", "code": "too_large", "message": "big",
                        "metadata": {"source": "huge.mp4"}})  # fmt: skip
    env = {"MMWORKER_CONFIG": str(config), "MMWORKER_KAFKA__OUTPUT_TOPIC": results,
           "MMWORKER_KAFKA__DEAD_LETTER_TOPIC": dlq}  # fmt: skip
    read = _cli("tail", "--timeout", "2", env=env)
    assert read.returncode == 0, read.stderr
    assert sorted(read.stdout.splitlines()) == [
        f"[{dlq}] FAILED huge.mp4 (job f1): too_large: big",
        f"[{results}] {image} (job r1) [image]: 'caption r1'",
    ]


def test_submit_says_what_it_skipped_and_why(broker: EmbeddedBroker, tmp_path: Path) -> None:
    topic = _topic(broker, "skips")
    media = tmp_path / "media"
    media.mkdir()
    (media / "small.jpg").write_bytes(sample_image(seed=1, width=64, height=48))
    big = media / "big.png"
    big.write_bytes(sample_image(seed=2, fmt="PNG"))
    (media / "README").write_text("holiday photos\n")
    common = ("--topic", topic, "--bootstrap-servers", broker.bootstrap, "--inline-max-bytes",
              "20000")  # fmt: skip
    out = _cli("submit", str(media), *common)
    assert out.returncode == 1
    size = big.stat().st_size
    # No worker runs in this group: one line says so first (`status.py`), then the skips.
    assert out.stderr.splitlines()[0].startswith("warning: no worker is consuming group")
    assert out.stderr.splitlines()[1:3] == [
        f"skipped {media / 'README'}: media is text ('holiday photos\\n'...), not an image or "
        "video",
        f"skipped {big}: {size} bytes is over --inline-max-bytes (20000), so it would go as a "
        "file:// URI, which a worker reads only under preprocess.allowed_roots (empty): raise "
        "--inline-max-bytes, or give the worker and this command --set "
        f"'preprocess.allowed_roots={json.dumps([str(media)])}'",
    ]
    assert out.stderr.endswith(f"sent 1 job to {topic}; 1 not sent (see above)\n")
    assert [ln.split("\t")[1] for ln in out.stdout.splitlines()] == [str(media / "small.jpg")]

    fixed = _cli("submit", str(media), *common, "--set",
                 f"preprocess.allowed_roots={json.dumps([str(media)])}")  # fmt: skip
    assert fixed.returncode == 0, fixed.stderr
    refs = {j["metadata"]["source"]: j["media"][0] for j in _read_all(broker, topic)}  # type: ignore[index]
    assert refs[str(big)] == {"uri": big.as_uri()}
    assert "data" in refs[str(media / "small.jpg")]


def test_broker_command_serves_until_ctrl_c() -> None:
    port = free_port()
    served = Running("broker", "--port", str(port), "--partitions", "2")
    line = served.line(timeout=60)
    assert line == (
        f"broker (Tansu, in memory) on 127.0.0.1:{port}; topics mmworker.jobs, mmworker.results "
        "(2 partitions), mmworker.dead-letter, mmworker.suspects; Ctrl-C stops it and forgets "
        "everything"
    )
    admin = KafkaAdminClient(bootstrap_servers=[f"127.0.0.1:{port}"])
    try:
        topics = {t["name"]: len(t["partitions"]) for t in admin.describe_topics()}
    finally:
        admin.close()
    assert topics["mmworker.jobs"] == 2 and topics["mmworker.dead-letter"] == 1
    code, err = served.stop(signal.SIGINT)
    assert code == 0
    assert err == "broker stopped (SIGINT)\n"


def test_the_demo_shows_the_worker_not_vllm(tmp_path: Path) -> None:
    """`make demo` on a fresh machine: at most 25 lines before the first result, no vLLM INFO,
    no deprecation warning, no leaked-semaphore warning at the end."""
    env = _env({"XDG_CACHE_HOME": str(tmp_path / "cache")})
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "mmworker", "demo", "--keep"], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT, timeout=900, check=False,
    )  # fmt: skip
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout[-4000:]
    answers = ("[demo.results]", "[demo.dead-letter]")
    first = next(i for i, ln in enumerate(lines) if ln.startswith(answers))
    assert first <= 25, "\n".join(lines[:first])
    assert not [ln for ln in lines if " INFO vllm" in ln or ln.startswith("(EngineCore")]
    assert not [ln for ln in lines if "leaked" in ln or "Traceback" in ln]
    # vLLM's warning about raw prompts (and any other deprecation) is gone, not hidden above.
    assert not [ln for ln in lines if "deprecat" in ln.lower()], out.stdout[-4000:]
    kept = Path(lines[-1].rpartition(": ")[2])
    assert lines[-1].startswith("kept the worker's directory") and (kept / "ball.mp4").is_file()
    assert time.monotonic() - started < 900
    shutil.rmtree(kept)
