"""A backfill whose broker stops and comes back on the same port (issue #35): it says so in one
line of its own each way, keeps going, and finishes with every row answered once.

The broker keeps its topics in a local S3 store (`devkit.object_store`), as a real cluster keeps
its log: nothing posted is lost, so the backfill re-posts nothing (`--grace` is longer than the
outage). A broker that comes back empty (the in-memory one) also works out: the backfill
re-posts its unanswered jobs once `--grace` has passed, which the unit of this module does not
cover (the worker's own client must survive that too).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from mmworker.backfill import journal_path
from mmworker.devkit.broker import EmbeddedBroker
from mmworker.devkit.object_store import ObjectStore
from mmworker.devkit.samples import sample_image
from tests.integration.workerkit import WorkerProcess, make_topics

pytestmark = pytest.mark.integration

ROWS = 60
IMAGES = 6


def _answers(out: Path) -> int:
    try:
        return journal_path(out).read_bytes().count(b'"t":"answer"')
    except FileNotFoundError:
        return 0


def _wait_for(what: str, done: object, proc: subprocess.Popen[bytes], log: Path, s: float) -> None:
    deadline = time.monotonic() + s
    while not done():  # type: ignore[operator]
        assert proc.poll() is None, f"{what}: the backfill exited\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"{what}: not within {s}s\n{log.read_text()[-4000:]}"
        time.sleep(0.1)


@pytest.mark.timeout(600)
def test_a_backfill_rides_out_a_broker_restart(tmp_path: Path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    for k in range(IMAGES):
        (media / f"img{k}.jpg").write_bytes(sample_image(64, 64, seed=k))
    manifest = tmp_path / "restart.jsonl"
    lines = [json.dumps({"key": f"r{i:03d}", "uri": f"media/img{i % IMAGES}.jpg"}) + "\n"
             for i in range(ROWS)]  # fmt: skip
    manifest.write_text("".join(lines))
    out = tmp_path / "restart-out.jsonl"
    log = tmp_path / "backfill.log"
    with ObjectStore() as store, EmbeddedBroker(store=store) as broker:
        topics = make_topics(broker.bootstrap, "restart")
        group = f"restart-{uuid.uuid4().hex[:6]}"
        extra: dict[str, object] = {"limits.max_in_flight": 4, "kafka.max_poll_records": 4}
        with WorkerProcess(broker.bootstrap, tmp_path, topics, group, extra) as worker:
            cmd = [sys.executable, "-m", "mmworker", "backfill", str(manifest), "--out", str(out),
                   "--bootstrap-servers", broker.bootstrap, "--max-tokens", "1",
                   "--key-column", "key", "--window", "8", "--grace", "120",
                   "--set", f"kafka.input_topic={topics['input']}",
                   "--set", f"kafka.output_topic={topics['output']}",
                   "--set", f"kafka.dead_letter_topic={topics['dlq']}",
                   "--set", f"kafka.group_id={group}"]  # fmt: skip
            with log.open("wb") as f:
                backfill = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
            try:
                _wait_for("10 answers", lambda: _answers(out) >= 10, backfill, log, 300)
                broker.stop()
                stopped = time.monotonic()
                _wait_for(
                    "the line of its own",
                    lambda: "lost the brokers" in log.read_text(), backfill, log, 60,
                )  # fmt: skip
                answered_before = _answers(out)
                time.sleep(max(0.0, 5 - (time.monotonic() - stopped)))
                broker.start()  # the same port, the same topics and records
                code = backfill.wait(300)
            finally:
                if backfill.poll() is None:
                    backfill.kill()
            text = log.read_text()
            assert code == 0, f"{text[-4000:]}\n--- worker\n{worker.log()}"
    assert text.count("lost the brokers") == 1, text[-4000:]
    assert text.count("the brokers are back after") == 1, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["row"] for r in rows] == [f"r{i:03d}" for i in range(ROWS)]  # each row once
    assert all(r["outcome"] == "ok" for r in rows), [r for r in rows if r["outcome"] != "ok"][:3]
    summary = text[text.rindex("backfill restart:") :]
    assert f"{ROWS} rows in" in summary and f"{ROWS} ok, 0 failed" in summary, summary
    assert f"this run: {ROWS} posted (0 re-posted)" in summary, summary  # nothing was lost
    print(f"answered before the stop: {answered_before}\n{summary}")
