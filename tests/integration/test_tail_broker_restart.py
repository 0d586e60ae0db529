"""`mmworker tail -f` while its broker goes away and comes back (issue #35 item 3), on the real
embedded broker: before, kafka-python printed dozens of ERROR/WARNING lines, tail never said
the broker was gone, and what was posted after the broker's return never showed."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import IO

import pytest
from kafka import KafkaProducer

from mmworker.config import KafkaConfig
from mmworker.devkit.broker import EmbeddedBroker, free_port
from mmworker.kafka_io import ensure_topics

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
#: How long the broker stays away: kafka-python retries a lost connection several times a
#: second, so a few seconds are enough to show whether its attempts reach the terminal.
DOWN_S = 6.0


class Tail:
    """`mmworker tail` left running; its stdout and stderr lines arrive in queues as written."""

    def __init__(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MMWORKER_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mmworker", "tail", *args], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )  # fmt: skip
        self.out: queue.Queue[str] = queue.Queue()
        self.err: queue.Queue[str] = queue.Queue()
        self.err_lines: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, into), daemon=True).start()

    @staticmethod
    def _pump(stream: IO[str], into: queue.Queue[str]) -> None:
        for line in stream:
            into.put(line.rstrip("\n"))

    def line(self, timeout: float = 60) -> str:
        try:
            return self.out.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no record printed; stderr so far: {self.stderr()}") from None

    def stderr_until(self, pattern: str, timeout: float = 60) -> str:
        """The first stderr line matching `pattern`, all stderr lines kept in `err_lines`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.err.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.err_lines.append(line)
            if re.search(pattern, line):
                return line
        raise AssertionError(f"no stderr line like {pattern!r} in {timeout}s: {self.stderr()}")

    def stderr(self) -> list[str]:
        while not self.err.empty():
            self.err_lines.append(self.err.get_nowait())
        return self.err_lines

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout=60)
        time.sleep(0.2)  # the pump threads read what was left in the pipes
        self.stderr()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _post(bootstrap: str, topic: str, *job_ids: str) -> None:
    producer = KafkaProducer(bootstrap_servers=[bootstrap], acks="all")
    for job_id in job_ids:
        doc = {"job_id": job_id, "text": f"caption {job_id}", "media": [{"kind": "image"}]}
        producer.send(topic, key=job_id.encode(), value=json.dumps(doc).encode())
    producer.flush()
    producer.close()


@pytest.mark.parametrize("topic_back", ["with_the_broker", "after_tail_saw_the_broker"])
def test_tail_follow_says_the_broker_is_lost_and_reads_on_when_it_returns(topic_back: str) -> None:
    """`after_tail_saw_the_broker`: the topic is missing from the first metadata after the
    return, so kafka-python drops it and would look again only after metadata_max_age_ms (5
    minutes); the reader asks for it again while it is missing."""
    port = free_port()
    topic = f"restart-{uuid.uuid4().hex[:6]}"
    first = EmbeddedBroker(port=port).start()
    tail: Tail | None = None
    try:
        ensure_topics(KafkaConfig(bootstrap_servers=first.bootstrap), {topic: 2})
        _post(first.bootstrap, topic, "before-1", "before-2")
        tail = Tail("-f", "--topics", topic, "--bootstrap-servers", first.bootstrap)
        before = {tail.line(), tail.line()}
        assert before == {f"[{topic}] before-{i} [image]: 'caption before-{i}'" for i in (1, 2)}

        first.stop()
        lost = tail.stderr_until("lost the Kafka brokers", timeout=30)
        # Refused once it is gone; a Tansu shutting down stops answering before it stops
        # listening (EmbeddedBroker.stop kills it after 5 s), which the check may see first.
        assert re.fullmatch(
            rf"mmworker tail: lost the Kafka brokers \(127\.0\.0\.1:{port}: (connection refused|"
            r"no Kafka answer within 5s)\); waiting for them to come back \(Ctrl-C stops\)",
            lost,
        ), lost
        time.sleep(DOWN_S)  # the broker stays away while kafka-python keeps retrying
        assert tail.proc.poll() is None, "tail -f must outlive its broker"

        # The embedded broker keeps its topics in memory: the restarted one has none until they
        # are created again, as `mmworker broker` and `run --create-topics` do.
        with EmbeddedBroker(port=port) as second:
            if topic_back == "after_tail_saw_the_broker":
                tail.stderr_until("the Kafka brokers are back", timeout=60)
            ensure_topics(KafkaConfig(bootstrap_servers=second.bootstrap), {topic: 2})
            _post(second.bootstrap, topic, "after-1", "after-2", "after-3")
            after = sorted([tail.line(), tail.line(), tail.line()])
            code = tail.stop()
        after += list(tail.out.queue)  # anything printed twice
        assert after == [f"[{topic}] after-{i} [image]: 'caption after-{i}'" for i in (1, 2, 3)]
        assert code == 0
        err = tail.stderr()
        # Its own lines only: no kafka-python ERROR/WARNING per attempt.
        assert err[0] == lost, err
        assert re.fullmatch(
            r"mmworker tail: the Kafka brokers are back after \d+\.\ds; reading on", err[1]
        ), err
        assert err[2] == (
            f"mmworker tail: topic {topic} was created again while the brokers were away: "
            "reading it from its beginning"
        )
        assert re.fullmatch(r"5 records in \d+\.\ds", err[3]), err
        assert len(err) == 4, err
    finally:
        if tail is not None:
            tail.kill()
        first.stop()


def test_debug_shows_kafka_pythons_own_lines_again() -> None:
    """The chatter is off by default, not lost: `--debug` asks for it."""
    port = free_port()
    topic = f"restart-dbg-{uuid.uuid4().hex[:6]}"
    broker = EmbeddedBroker(port=port).start()
    tail: Tail | None = None
    try:
        ensure_topics(KafkaConfig(bootstrap_servers=broker.bootstrap), {topic: 1})
        _post(broker.bootstrap, topic, "one")
        tail = Tail("-f", "--debug", "--topics", topic, "--bootstrap-servers", broker.bootstrap)
        tail.line()
        broker.stop()
        tail.stderr_until("lost the Kafka brokers", timeout=30)
        assert tail.stop() == 0
        assert any(" kafka." in line for line in tail.stderr()), tail.stderr()
    finally:
        if tail is not None:
            tail.kill()
        broker.stop()


def test_tail_follow_says_a_hung_broker_is_lost_and_misses_nothing_when_it_resumes() -> None:
    """A stopped broker (SIGSTOP) still accepts connections, so a TCP check alone saw nothing
    wrong; it answers no Kafka request. It keeps its topics, so nothing is read twice or
    skipped when it resumes."""
    topic = f"hung-{uuid.uuid4().hex[:6]}"
    broker = EmbeddedBroker().start()
    assert broker.pid is not None
    tail: Tail | None = None
    try:
        ensure_topics(KafkaConfig(bootstrap_servers=broker.bootstrap), {topic: 1})
        _post(broker.bootstrap, topic, "before")
        tail = Tail("-f", "--topics", topic, "--bootstrap-servers", broker.bootstrap)
        assert tail.line() == f"[{topic}] before [image]: 'caption before'"
        os.kill(broker.pid, signal.SIGSTOP)
        lost = tail.stderr_until("lost the Kafka brokers", timeout=60)
        assert lost == (
            f"mmworker tail: lost the Kafka brokers ({broker.bootstrap}: no Kafka answer within "
            "5s); waiting for them to come back (Ctrl-C stops)"
        )
        os.kill(broker.pid, signal.SIGCONT)
        tail.stderr_until("the Kafka brokers are back", timeout=60)
        _post(broker.bootstrap, topic, "after-1", "after-2")
        after = [tail.line(), tail.line()]
        assert tail.stop() == 0
        after += list(tail.out.queue)  # anything printed twice
        assert after == [f"[{topic}] after-{i} [image]: 'caption after-{i}'" for i in (1, 2)]
        err = tail.stderr()
        assert err[0] == lost, err
        assert re.fullmatch(r"3 records in \d+\.\ds", err[2]), err
        assert len(err) == 3, err
    finally:
        if tail is not None:
            tail.kill()
        if broker.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(broker.pid, signal.SIGCONT)
        broker.stop()
