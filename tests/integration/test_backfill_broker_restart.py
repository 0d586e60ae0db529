"""A backfill whose broker stops and comes back on the same port (issue #35): it says so in one
line of its own each way, keeps going, and finishes with every row answered once.

The broker keeps its topics in a local S3 store (`devkit.object_store`), as a real cluster keeps
its log: nothing posted is lost, so the backfill re-posts nothing (`--grace` is longer than the
outage). The in-memory broker comes back empty: its topics are created again here (as an
operator would), and the backfill re-posts its unanswered jobs once `--grace` has passed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from mmworker.backfill import journal_path
from mmworker.config import KafkaConfig
from mmworker.devkit.broker import EmbeddedBroker
from mmworker.devkit.object_store import ObjectStore
from mmworker.devkit.samples import sample_image
from mmworker.kafka_io import ensure_worker_topics
from tests.integration.workerkit import WorkerProcess, make_topics

pytestmark = pytest.mark.integration

ROWS = 60
IMAGES = 6
WINDOW = 8


def _answers(out: Path) -> int:
    try:
        return journal_path(out).read_bytes().count(b'"t":"answer"')
    except FileNotFoundError:
        return 0


def _posted(out: Path) -> int:
    try:
        return journal_path(out).read_bytes().count(b'"t":"posted"')
    except FileNotFoundError:
        return 0


def _wait_for(what: str, done: object, proc: subprocess.Popen[bytes], log: Path, s: float) -> None:
    deadline = time.monotonic() + s
    while not done():  # type: ignore[operator]
        assert proc.poll() is None, f"{what}: the backfill exited\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"{what}: not within {s}s\n{log.read_text()[-4000:]}"
        time.sleep(0.1)


def _manifest(tmp_path: Path) -> Path:
    media = tmp_path / "media"
    media.mkdir()
    for k in range(IMAGES):
        (media / f"img{k}.jpg").write_bytes(sample_image(64, 64, seed=k))
    manifest = tmp_path / "restart.jsonl"
    lines = [json.dumps({"key": f"r{i:03d}", "uri": f"media/img{i % IMAGES}.jpg"}) + "\n"
             for i in range(ROWS)]  # fmt: skip
    manifest.write_text("".join(lines))
    return manifest


def _backfill_through_a_restart(
    tmp_path: Path, broker: EmbeddedBroker, grace_s: float, empty: bool
) -> str:
    """Run a backfill, stop the broker, start it again on the same port 5 s later; the
    backfill's summary once it has finished (exit 0). With a broker that keeps its log, the
    worker runs throughout and the stop comes once 10 rows are answered. An empty one would also
    take the worker's state (its producer is refused after such a restart: the worker's business,
    not this test's), so the worker starts after it, and the stop comes once a window of jobs
    is posted: those are what the broker loses."""
    manifest = _manifest(tmp_path)
    out = tmp_path / "restart-out.jsonl"
    log = tmp_path / "backfill.log"
    topics = make_topics(broker.bootstrap, "restart")
    group = f"restart-{uuid.uuid4().hex[:6]}"
    # Idempotence off, the worker's and the backfill's: Tansu can lose a batch cut off by its
    # restart and answer its retry "duplicate" (test_broker_restart_producer.py says how).
    extra: dict[str, object] = {"limits.max_in_flight": 4, "kafka.max_poll_records": 4,
                                "kafka.enable_idempotence": False}  # fmt: skip
    worker = WorkerProcess(broker.bootstrap, tmp_path, topics, group, extra)
    if not empty:
        worker.__enter__()
    cmd = [sys.executable, "-m", "mmworker", "backfill", str(manifest), "--out", str(out),
           "--bootstrap-servers", broker.bootstrap, "--max-tokens", "1",
           "--key-column", "key", "--window", str(WINDOW), "--grace", str(grace_s),
           "--set", f"kafka.input_topic={topics['input']}",
           "--set", f"kafka.output_topic={topics['output']}",
           "--set", f"kafka.dead_letter_topic={topics['dlq']}",
           "--set", f"kafka.group_id={group}",
           "--set", "kafka.enable_idempotence=false"]  # fmt: skip
    with log.open("wb") as f:
        backfill = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        if empty:
            _wait_for("a window posted", lambda: _posted(out) >= WINDOW, backfill, log, 60)
        else:
            _wait_for("10 answers", lambda: _answers(out) >= 10, backfill, log, 300)
        broker.stop()
        stopped = time.monotonic()
        _wait_for(
            "the line of its own", lambda: "lost the brokers" in log.read_text(), backfill, log, 60
        )
        time.sleep(max(0.0, 5 - (time.monotonic() - stopped)))
        broker.start()  # the same port
        if empty:  # the in-memory broker forgot everything: its topics come back, empty
            kafka = KafkaConfig(
                bootstrap_servers=broker.bootstrap, input_topic=topics["input"],
                output_topic=topics["output"], dead_letter_topic=topics["dlq"],
            )  # fmt: skip
            ensure_worker_topics(kafka, 3)
            _wait_for("a re-post", lambda: _posted(out) > WINDOW, backfill, log, 60)
            worker.__enter__()
        code = backfill.wait(600)
    finally:
        if backfill.poll() is None:
            backfill.kill()
        worker_log = worker.log() if worker.proc is not None else "(not started)"
        worker.__exit__(None, None, None)
    text = log.read_text()
    assert code == 0, f"{text[-4000:]}\n--- worker\n{worker_log}"
    assert text.count("lost the brokers") == 1, text[-4000:]
    assert text.count("the brokers are back after") == 1, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["row"] for r in rows] == [f"r{i:03d}" for i in range(ROWS)]  # each row once
    assert all(r["outcome"] == "ok" for r in rows), [r for r in rows if r["outcome"] != "ok"][:3]
    summary = text[text.rindex("backfill restart:") :]
    assert f"{ROWS} rows in" in summary and f"{ROWS} ok, 0 failed" in summary, summary
    print(summary)
    return summary


@pytest.mark.timeout(900)
def test_a_backfill_rides_out_a_broker_restart(tmp_path: Path) -> None:
    """The broker keeps its log (local S3 store): nothing to post again. The grace period is
    longer than any stall a restart may cause: a CI run (140504e) took 153 s for what takes
    42-82 s here, and one job was re-posted at a 120 s grace. A later CI run (6f5d69c, 420 s
    grace) re-posted two jobs whose answers the worker had published during the outage: Tansu
    had lost that batch and answered its retry "duplicate", which an idempotent producer takes
    as delivered (test_broker_restart_producer.py). Both sides now run without idempotence
    here, which is what `kafka.enable_idempotence` is for; the 140504e case was probably the
    same."""
    with ObjectStore() as store, EmbeddedBroker(store=store) as broker:
        summary = _backfill_through_a_restart(tmp_path, broker, grace_s=420, empty=False)
    assert f"this run: {ROWS} posted (0 re-posted)" in summary, summary  # nothing was lost


@pytest.mark.timeout(600)
def test_a_backfill_posts_again_what_an_empty_broker_lost(tmp_path: Path) -> None:
    """The in-memory broker comes back without the window of jobs it held: past --grace, the
    backfill posts them again from its journal, once each."""
    with EmbeddedBroker() as broker:
        summary = _backfill_through_a_restart(tmp_path, broker, grace_s=3, empty=True)
    assert f"this run: {ROWS + WINDOW} posted ({WINDOW} re-posted)" in summary, summary


def _fill(bootstrap: str, topic: str, n: int) -> None:
    """Records of someone else on the output topic: what a resume reads through first."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=50, batch_size=1 << 20)
    value = json.dumps({"job_id": "someone-else/x", "text": "x" * 64}).encode()
    for _ in range(n):
        producer.send(topic, value)
    producer.flush(120)
    producer.close()


@pytest.mark.timeout(300)
def test_a_resume_whose_broker_comes_back_empty_while_it_catches_up_goes_on(
    tmp_path: Path,
) -> None:
    """A resume first reads the answers that arrived while no backfill ran, up to the end
    offsets it found then. Brokers that came back empty meanwhile never reach those: it waited
    for them without end, posting nothing. Now it asks for the ends again, goes on, and posts
    the lost window again (no worker runs here: nothing is answered)."""
    with EmbeddedBroker() as broker:
        manifest = _manifest(tmp_path)
        out = tmp_path / "catch-up.jsonl"
        topics = make_topics(broker.bootstrap, "catchup")
        cmd = [sys.executable, "-m", "mmworker", "backfill", str(manifest), "--out", str(out),
               "--bootstrap-servers", broker.bootstrap, "--key-column", "key",
               "--window", str(WINDOW), "--grace", "1",
               "--set", f"kafka.input_topic={topics['input']}",
               "--set", f"kafka.output_topic={topics['output']}",
               "--set", f"kafka.dead_letter_topic={topics['dlq']}",
               "--set", "kafka.enable_idempotence=false"]  # fmt: skip
        first_log, log = tmp_path / "first.log", tmp_path / "resume.log"
        with first_log.open("wb") as f:
            first = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            _wait_for("a window posted", lambda: _posted(out) >= WINDOW, first, first_log, 60)
        finally:
            first.send_signal(signal.SIGINT)
        assert first.wait(30) == 130, first_log.read_text()[-3000:]
        _fill(broker.bootstrap, topics["output"], 200_000)
        with log.open("wb") as f:
            resume = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            _wait_for("catching up", lambda: "resuming: " in log.read_text(), resume, log, 60)
            resume.send_signal(signal.SIGSTOP)  # in the middle of 200,000 records
            broker.stop()
            broker.start()  # the same port, empty: its topics come back, empty
            kafka = KafkaConfig(
                bootstrap_servers=broker.bootstrap, input_topic=topics["input"],
                output_topic=topics["output"], dead_letter_topic=topics["dlq"],
            )  # fmt: skip
            ensure_worker_topics(kafka, 3)
            resume.send_signal(signal.SIGCONT)
            _wait_for("the window again", lambda: _posted(out) > WINDOW, resume, log, 90)
        finally:
            resume.send_signal(signal.SIGCONT)
            resume.send_signal(signal.SIGINT)
        assert resume.wait(30) == 130, log.read_text()[-3000:]
        assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
