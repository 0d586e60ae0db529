"""`mmworker replay` without a broker: what is selected, what is refused, what is posted."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from mmworker.schemas import Failure, SourceCoords
from mmworker.schemas.codes import ErrorCode

from mmworker.errors import ConfigError
from mmworker.replay import Selection, parse_codes, parse_when, refusal, replay_payload

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def _failure(code: ErrorCode = ErrorCode.FETCH_FAILED, **kw: object) -> Failure:
    fields: dict[str, object] = {
        "job_id": "j1", "code": code, "message": "m", "retryable": code == ErrorCode.FETCH_FAILED,
        "attempts": 3, "source": SourceCoords(topic="in", partition=0, offset=4),
        "worker_id": "w", "payload": b'{"job_id":"j1","media":[{"uri":"file:///x.jpg"}]}',
        "failed_at": NOW,
    }  # fmt: skip
    return Failure.model_validate({**fields, **kw})


def test_times_are_iso_or_ages() -> None:
    assert parse_when("2h", now=NOW) == NOW - timedelta(hours=2)
    assert parse_when("90s", now=NOW) == NOW - timedelta(seconds=90)
    assert parse_when("1.5d", now=NOW) == NOW - timedelta(days=1.5)
    assert parse_when("2026-12-01T09:30") == datetime(2026, 12, 1, 9, 30, tzinfo=UTC)
    offset = parse_when("2026-12-01T09:30+02:00")
    assert offset == datetime(2026, 12, 1, 7, 30, tzinfo=UTC)
    with pytest.raises(ConfigError, match="'yesterday' is not a time"):
        parse_when("yesterday")


def test_codes_are_checked() -> None:
    assert parse_codes(["fetch_failed,job_timeout", "too_large"]) == {
        ErrorCode.FETCH_FAILED, ErrorCode.JOB_TIMEOUT, ErrorCode.TOO_LARGE}  # fmt: skip
    with pytest.raises(ConfigError, match="--code fetch_faild: no such failure code"):
        parse_codes(["fetch_faild"])


def test_selection_by_code_time_and_retryability() -> None:
    fetch, forbidden = _failure(), _failure(ErrorCode.FORBIDDEN_URI)
    assert Selection().wants(fetch) and Selection().wants(forbidden)
    assert not Selection(retryable_only=True).wants(forbidden)
    assert Selection(codes=frozenset({ErrorCode.FORBIDDEN_URI})).wants(forbidden)
    assert not Selection(codes=frozenset({ErrorCode.FORBIDDEN_URI})).wants(fetch)
    assert Selection(since=NOW).wants(fetch)  # since is inclusive, until exclusive
    assert not Selection(until=NOW).wants(fetch)
    assert not Selection(since=NOW + timedelta(seconds=1)).wants(fetch)


def test_a_cut_payload_is_refused_with_the_reason() -> None:
    assert refusal(_failure()) is None
    why = refusal(_failure(payload_truncated=True))
    assert why is not None and why.startswith(
        "its payload was cut: the worker keeps at most 64 KiB"
    )
    assert refusal(_failure(payload=b"")) == "it has no payload to post"


def test_the_payload_goes_back_with_its_replay_count() -> None:
    once = json.loads(replay_payload(_failure()))
    assert once == {"job_id": "j1", "media": [{"uri": "file:///x.jpg"}],
                    "metadata": {"replays": 1}}  # fmt: skip
    again = _failure(payload=json.dumps({**once, "metadata": {"replays": 1, "k": "v"}}).encode())
    assert json.loads(replay_payload(again))["metadata"] == {"replays": 2, "k": "v"}
    for raw in (b'{"job_id": "x", "media": [', b"[1, 2]", b'{"metadata": "odd"}'):
        assert replay_payload(_failure(payload=raw)) == raw  # not ours to repair: as it was
