"""`mmworker status` against a live group on the real embedded broker (issue #35 item 4): the
members it names are the group's, its lag is what a direct offset read by another client says,
and a group nobody consumes is said to be so."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions
from confluent_kafka.admin import AdminClient
from kafka import KafkaConsumer, KafkaProducer
from kafka.structs import OffsetAndMetadata
from kafka.structs import TopicPartition as KafkaTP

from mmworker.config import KafkaConfig
from mmworker.devkit.broker import EmbeddedBroker, free_port
from mmworker.devkit.samples import sample_image
from mmworker.kafka_io import SUSPECTS_TOPIC_CONFIG, ensure_topics, keep_finished_joins
from tests.conftest import GROUP_SETTINGS
from tests.integration.conftest import Service

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
PARTITIONS = 3
#: Records posted to each input partition, and how many of them the group commits there.
POSTED = (5, 3, 4)
COMMITTED = (2, 3, 0)
HOUR_MS = 3600 * 1000


def _status(broker: EmbeddedBroker, names: dict[str, str], *extra: str) -> Any:
    out = subprocess.run(
        [sys.executable, "-m", "mmworker", "status", *_flags(broker, names), *extra],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False, env=_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout) if "--json" in extra else out.stdout


def _flags(broker: EmbeddedBroker, names: dict[str, str]) -> list[str]:
    return [
        "--bootstrap-servers", broker.bootstrap, "--group-id", names["group"],
        "--input-topic", names["input"], "--dead-letter-topic", names["dlq"],
        "--set", f"kafka.suspects_topic={names['suspects']}",
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MMWORKER_")}


def _names() -> dict[str, str]:
    tag = uuid.uuid4().hex[:6]
    return {
        "group": f"status-{tag}",
        "input": f"status-{tag}.jobs",
        "dlq": f"status-{tag}.dlq",
        "suspects": f"status-{tag}.suspects",
    }


def _member(broker: EmbeddedBroker, topic: str, group: str, client_id: str) -> KafkaConsumer:
    member = KafkaConsumer(
        topic, bootstrap_servers=[broker.bootstrap], group_id=group, client_id=client_id,
        enable_auto_commit=False, auto_offset_reset="earliest", **GROUP_SETTINGS,
    )  # fmt: skip
    # As the worker's own consumer does: with two members polling in turn for 100 ms each, a
    # join round that ends between two polls is otherwise thrown away and joined again, and a
    # CI run saw one member hold both partitions and the other none for 90 s.
    keep_finished_joins(member)
    return member


def _until_assigned(members: list[KafkaConsumer], partitions: int, timeout: float = 90) -> None:
    """Poll every member until each holds partitions and together they hold
    them all, each partition once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for m in members:
            m.poll(timeout_ms=100, max_records=1)
        held = [tp for m in members for tp in m.assignment()]
        if all(m.assignment() for m in members) and len(held) == len(set(held)) == partitions:
            return
    raise AssertionError(f"no stable assignment in {timeout}s: {[m.assignment() for m in members]}")


def _committed_by_librdkafka(broker: EmbeddedBroker, group: str) -> dict[int, int]:
    """The group's committed offsets as librdkafka's admin client reads them: another client,
    another implementation of OffsetFetch."""
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    futures = admin.list_consumer_group_offsets(
        [ConsumerGroupTopicPartitions(group)], request_timeout=30
    )
    result = futures[group].result(timeout=30)
    return {tp.partition: tp.offset for tp in result.topic_partitions if tp.offset >= 0}


def test_status_names_the_members_and_its_lag_matches_a_direct_read(
    broker: EmbeddedBroker,
) -> None:
    names = _names()
    cfg = KafkaConfig(bootstrap_servers=broker.bootstrap)  # type: ignore[call-arg]
    ensure_topics(cfg, {names["input"]: PARTITIONS, names["dlq"]: 1})
    ensure_topics(cfg, {names["suspects"]: 1}, configs=SUSPECTS_TOPIC_CONFIG)
    producer = KafkaProducer(bootstrap_servers=[broker.bootstrap], acks="all")
    now_ms = int(time.time() * 1000)
    # Stamped a minute apart, oldest first: the record at each committed offset has a known age.
    stamps: dict[tuple[int, int], int] = {}
    ends: dict[int, int] = {}
    for partition, count in enumerate(POSTED):
        for i in range(count):
            stamp = now_ms - (count - i) * 60_000
            meta = producer.send(
                names["input"], value=b"{}", partition=partition, timestamp_ms=stamp
            ).get(timeout=30)
            stamps[(partition, meta.offset)] = stamp
            ends[partition] = meta.offset + 1  # the direct read of the end: the broker's ack
    # Dead letters: two inside the last hour, one two hours old; suspects: one live, one cleared.
    failures = (("fetch_failed", 60_000), ("engine_crash", 120_000), ("job_timeout", 2 * HOUR_MS))
    for code, age_ms in failures:
        producer.send(
            names["dlq"], value=json.dumps({"code": code}).encode(), timestamp_ms=now_ms - age_ms
        ).get(timeout=30)
    death = json.dumps({"deaths": 1, "at": time.time()}).encode()
    for key in (b"t/0/1", b"t/0/2"):
        producer.send(names["suspects"], key=key, value=death).get(timeout=30)
    producer.send(names["suspects"], key=b"t/0/2", value=None).get(timeout=30)
    producer.close(timeout=5)

    a = _member(broker, names["input"], names["group"], "status-worker-a")
    b = _member(broker, names["input"], names["group"], "status-worker-b")
    _until_assigned([a, b], PARTITIONS)
    for member in (a, b):
        member.commit({
            KafkaTP(tp.topic, tp.partition): OffsetAndMetadata(COMMITTED[tp.partition], "", -1)
            for tp in member.assignment() if COMMITTED[tp.partition]
        })  # fmt: skip
    committed = _committed_by_librdkafka(broker, names["group"])
    assert committed == {p: c for p, c in enumerate(COMMITTED) if c}

    try:
        seen = _status(broker, names, "--json")
        member_ids = {a._coordinator._generation.member_id, b._coordinator._generation.member_id}
    finally:
        # kafka-python's own close: it always sends LeaveGroup, so Tansu forgets both members
        # (a member that leaves without it stays listed there until another one joins).
        for member in (a, b):
            member.close(autocommit=False)

    assert seen["consuming"] is True
    assert seen["state"] == "Stable"
    assert {m["member_id"] for m in seen["members"]} == member_ids
    assert sorted(m["client_id"] for m in seen["members"]) == ["status-worker-a", "status-worker-b"]
    # Tansu does not report assignments; status says so instead of guessing.
    assert [m["partitions"] for m in seen["members"]] == [None, None]
    by_partition = {p["partition"]: p for p in seen["partitions"]}
    assert set(by_partition) == set(range(PARTITIONS))
    for partition in range(PARTITIONS):
        row = by_partition[partition]
        start = committed.get(partition, 0)
        assert row["end"] == ends[partition]
        assert row["committed"] == committed.get(partition)
        assert row["lag"] == ends[partition] - start
        oldest = stamps.get((partition, start))
        assert row["oldest_waiting_ms"] == oldest
    assert seen["total_lag"] == sum(ends[p] - committed.get(p, 0) for p in range(PARTITIONS))
    waiting = [p for p in range(PARTITIONS) if ends[p] > committed.get(p, 0)]
    oldest_overall = min(stamps[(p, committed.get(p, 0))] for p in waiting)
    assert abs(seen["oldest_waiting_s"] - (seen["taken_at"] - oldest_overall / 1000)) < 0.01
    assert seen["dead_letters"]["count"] == 2
    assert seen["dead_letters"]["by_code"] == {"fetch_failed": 1, "engine_crash": 1}
    assert seen["suspects"] == {"live": 1, "recent": 1, "complete": True}

    # Everybody left: nobody consumes, the jobs still wait.
    after = _status(broker, names, "--json")
    assert after["consuming"] is False and after["members"] == []
    assert after["total_lag"] == seen["total_lag"]
    text = _status(broker, names)
    total = seen["total_lag"]
    assert text.splitlines()[0].startswith(
        f"NOBODY IS CONSUMING: group {names['group']} has no live member; {total} jobs waiting, "
        "the oldest for "
    ), text


def test_status_of_a_group_that_never_existed(broker: EmbeddedBroker) -> None:
    names = _names()
    ensure_topics(KafkaConfig(bootstrap_servers=broker.bootstrap), {names["input"]: 2})  # type: ignore[call-arg]
    producer = KafkaProducer(bootstrap_servers=[broker.bootstrap], acks="all")
    for _ in range(3):
        producer.send(names["input"], value=b"{}", partition=1).get(timeout=30)
    producer.close(timeout=5)
    seen = _status(broker, names, "--json")
    assert seen["consuming"] is False
    # Nothing committed: a worker would start at the log start, so all three wait.
    assert [(p["partition"], p["committed"], p["end"], p["lag"]) for p in seen["partitions"]] == [
        (0, None, 0, 0),
        (1, None, 3, 3),
    ]
    assert seen["missing_topics"] == []
    assert seen["dead_letters"] == {**seen["dead_letters"], "count": 0, "complete": True}


def test_status_watch_refreshes_until_ctrl_c(broker: EmbeddedBroker) -> None:
    names = _names()
    ensure_topics(KafkaConfig(bootstrap_servers=broker.bootstrap), {names["input"]: 1})  # type: ignore[call-arg]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmworker", "status", *_flags(broker, names), "--json", "-w", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env(),
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout

    def pump() -> None:
        for line in stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    try:
        first = json.loads(lines.get(timeout=60))
        producer = KafkaProducer(bootstrap_servers=[broker.bootstrap], acks="all")
        producer.send(names["input"], value=b"{}").get(timeout=30)
        producer.close(timeout=5)
        deadline = time.monotonic() + 60
        later = first
        while later["total_lag"] == 0 and time.monotonic() < deadline:
            later = json.loads(lines.get(timeout=60))
    finally:
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=30)
    assert first["total_lag"] == 0 and later["total_lag"] == 1
    assert later["taken_at"] > first["taken_at"]
    assert proc.returncode == 0, err


def test_status_names_a_real_worker(service: Service) -> None:
    """The session's running `mmworker run` (conftest's `service`) is the one member status
    names, under the worker's client id; the same topics read for a group nobody runs are not
    consumed."""
    names = {
        "group": service.group,
        "input": service.topics["input"],
        "dlq": service.topics["dlq"],
        "suspects": "mmworker.suspects",
    }
    seen = _status(service.broker, names, "--json")
    assert [m["client_id"] for m in seen["members"]] == ["mmworker"], seen["members"]
    assert seen["consuming"] is True
    assert {p["topic"] for p in seen["partitions"]} == {service.topics["input"]}
    idle = _status(service.broker, {**names, "group": f"nobody-{uuid.uuid4().hex[:6]}"}, "--json")
    assert idle["consuming"] is False and idle["members"] == []


WARNING = "warning: no worker is consuming group"


def _settings(broker: EmbeddedBroker, names: dict[str, str]) -> list[str]:
    """`_flags` for the commands that take the group and topics as settings only."""
    return [
        "--bootstrap-servers", broker.bootstrap,
        "--set", f"kafka.group_id={names['group']}",
        "--set", f"kafka.input_topic={names['input']}",
        "--set", f"kafka.dead_letter_topic={names['dlq']}",
    ]  # fmt: skip


def test_submit_warns_in_one_line_when_nobody_consumes(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    names = _names()
    ensure_topics(KafkaConfig(bootstrap_servers=broker.bootstrap), {names["input"]: 1})  # type: ignore[call-arg]
    photo = tmp_path / "photo.jpg"
    photo.write_bytes(sample_image(seed=3))
    argv = [sys.executable, "-m", "mmworker", "submit", str(photo), *_settings(broker, names)]

    def submit() -> list[str]:
        out = subprocess.run(
            argv, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False, env=_env()
        )
        assert out.returncode == 0, out.stderr
        return [ln for ln in out.stderr.splitlines() if ln.startswith(WARNING)]

    assert submit() == [
        f"{WARNING} {names['group']!r} on {broker.bootstrap}: the jobs wait until one runs "
        "(`mmworker status` shows the group)"
    ]
    member = _member(broker, names["input"], names["group"], "status-worker")
    try:
        _until_assigned([member], 1)
        assert submit() == []
    finally:
        member.close(autocommit=False)


def test_backfill_warns_in_one_line_when_nobody_consumes(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    names = _names()
    cfg = KafkaConfig(bootstrap_servers=broker.bootstrap)  # type: ignore[call-arg]
    ensure_topics(cfg, {names["input"]: 1, "mmworker.results": 1, names["dlq"]: 1})
    (tmp_path / "a.jpg").write_bytes(sample_image(seed=4))
    (tmp_path / "m.jsonl").write_text('{"uri": "a.jpg"}\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmworker", "backfill", str(tmp_path / "m.jsonl"),
         "--out", str(tmp_path / "r.jsonl"), *_settings(broker, names)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env(),
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    stderr = proc.stderr

    def pump() -> None:
        for line in stderr:
            lines.put(line.rstrip("\n"))

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        seen: list[str] = []
        while not any(ln.startswith(WARNING) for ln in seen) and time.monotonic() < deadline:
            seen.append(lines.get(timeout=60))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    warned = [ln for ln in seen if ln.startswith(WARNING)]
    assert warned == [
        f"{WARNING} {names['group']!r} on {broker.bootstrap}: the jobs wait until one runs "
        "(`mmworker status` shows the group)"
    ], seen


def test_status_watch_outlives_a_broker_restart() -> None:
    """`-w` is what an operator leaves open while a broker is restarted: it says the broker is
    gone in a line per refresh, without a traceback, and shows the group again once it is back."""
    port = free_port()
    names = _names()
    first = EmbeddedBroker(port=port).start()
    ensure_topics(KafkaConfig(bootstrap_servers=first.bootstrap), {names["input"]: 1})  # type: ignore[call-arg]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmworker", "status", *_flags(first, names), "--json", "-w", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env(),
    )  # fmt: skip
    out: queue.Queue[str] = queue.Queue()
    err: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None and proc.stderr is not None
    for stream, into in ((proc.stdout, out), (proc.stderr, err)):
        threading.Thread(target=_pump, args=(stream, into), daemon=True).start()
    second: EmbeddedBroker | None = None
    gone = ""
    try:
        assert json.loads(out.get(timeout=60))["partitions"][0]["topic"] == names["input"]
        first.stop()
        gone = err.get(timeout=60)
        assert gone.startswith(f"mmworker status: cannot read group {names['group']!r}"), gone
        second = EmbeddedBroker(port=port).start()
        ensure_topics(KafkaConfig(bootstrap_servers=second.bootstrap), {names["input"]: 1})  # type: ignore[call-arg]
        deadline = time.monotonic() + 90
        while True:  # lines the failing refreshes printed meanwhile are skipped
            doc = json.loads(out.get(timeout=90))
            if doc["partitions"] or time.monotonic() > deadline:
                break
        assert doc["partitions"][0]["topic"] == names["input"] and doc["consuming"] is False
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        first.stop()
        if second is not None:
            second.stop()
    errors = [gone, *(err.get_nowait() for _ in range(err.qsize()))]
    # one line per failed refresh, and nothing else: no traceback, no kafka-python retry noise
    assert all(line.startswith("mmworker status: cannot read group") for line in errors), errors
    assert proc.returncode == 0


def _pump(stream: Any, into: queue.Queue[str]) -> None:
    for line in stream:
        into.put(line.rstrip("\n"))
