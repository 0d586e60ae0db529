"""What `mmworker status` prints, from figures fixed here; the figures themselves are read from
the real broker in tests/integration/test_status.py. Apache Kafka's side of DescribeGroups
(assignments) cannot run here, so its member bytes are made by kafka-python's own encoder."""

from __future__ import annotations

import json

from kafka.protocol.consumer.metadata import ConsumerProtocolAssignment

from mmworker.group_members import Member, _assigned
from mmworker.status import GroupStatus, PartitionLag, RecentFailures, Suspects, render

NOW = 1_800_000_000.0


def _status(members: tuple[Member, ...], **kw: object) -> GroupStatus:
    parts = (
        PartitionLag("jobs", 0, 40, 48, 8, int((NOW - 35) * 1000)),
        PartitionLag("jobs", 1, None, 4, 4, int((NOW - 3 * 3600) * 1000)),
        PartitionLag("jobs", 2, 7, 7, 0, None),
    )
    base: dict[str, object] = {
        "bootstrap": "k:9092", "group": "g", "taken_at": NOW, "state": "Stable",
        "members": members, "partitions": parts,
        "dead_letters": RecentFailures("2027-01-15T07:00:00+00:00", 3, {"fetch_failed": 2, "engine_crash": 1}, True),  # noqa: E501
        "suspects": Suspects(live=1, recent=0, complete=True),
    } | kw  # fmt: skip
    return GroupStatus(**base)  # type: ignore[arg-type]


def test_assignment_bytes_as_apache_kafka_sends_them() -> None:
    raw = ConsumerProtocolAssignment(
        version=0, assigned_partitions=[("jobs", [2, 0]), ("backfill", [1])], user_data=b""
    ).encode()
    assert _assigned(raw) == (("backfill", 1), ("jobs", 0), ("jobs", 2))
    assert _assigned(b"") is None  # Tansu: not reported
    assert _assigned(b"\x00\x01") is None  # not the consumer protocol's encoding


def test_nobody_consuming_comes_first() -> None:
    lines = render(_status(()), "last 1h").splitlines()
    assert lines[0] == (
        "NOBODY IS CONSUMING: group g has no live member; 12 jobs waiting, the oldest for 3.0h"
    )
    assert "  jobs[0]  committed 40  end 48  lag 8  oldest 35s" in lines
    assert "  jobs[1]  committed -  end 4  lag 4  oldest 3.0h" in lines
    assert "  jobs[2]  committed 7  end 7  lag 0" in lines
    assert "  total 12" in lines
    assert "dead letters (last 1h): 3 (fetch_failed 2, engine_crash 1)" in lines


def test_members_with_and_without_reported_assignments() -> None:
    kafka = Member("mmworker-1", "mmworker", "10.0.0.7", (("jobs", 0), ("jobs", 1)))
    tansu = Member("mmworker-2", "mmworker", None, None)
    idle = Member("mmworker-3", "mmworker", "10.0.0.8", ())
    lines = render(_status((kafka, tansu, idle), lag_complete=False), "last 1h").splitlines()
    assert lines[0] == (
        "group g: Stable, 3 members consuming; 12 jobs waiting or running, the oldest for 3.0h"
    )
    assert lines[1:4] == [
        "  member mmworker-1 (client mmworker on 10.0.0.7): jobs[0], jobs[1]",
        "  member mmworker-2 (client mmworker): assignment not reported by this broker",
        "  member mmworker-3 (client mmworker on 10.0.0.8): no partitions",
    ]
    assert "lag (read cut short: at least):" in lines


def test_json_carries_the_verdict_and_totals() -> None:
    member = Member("mmworker-1", "mmworker", None, (("jobs", 0),))
    doc = json.loads(json.dumps(_status((member,)).to_json()))
    assert doc["consuming"] is True and doc["total_lag"] == 12
    assert doc["oldest_waiting_s"] == 3 * 3600
    assert doc["members"] == [
        {
            "member_id": "mmworker-1",
            "client_id": "mmworker",
            "host": None,
            "partitions": [["jobs", 0]],
        }
    ]
    assert doc["partitions"][1] == {
        "topic": "jobs", "partition": 1, "committed": None, "end": 4, "lag": 4,
        "oldest_waiting_ms": int((NOW - 3 * 3600) * 1000),
    }  # fmt: skip
    assert doc["dead_letters"]["by_code"] == {"fetch_failed": 2, "engine_crash": 1}


def test_a_missing_input_topic_is_named() -> None:
    text = render(_status((), partitions=(), missing_topics=("jobs",)), "since 2027-01-15")
    assert "  jobs: no such topic on the brokers" in text.splitlines()
    assert text.splitlines()[0] == "NOBODY IS CONSUMING: group g has no live member; 0 jobs waiting"
