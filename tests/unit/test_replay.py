"""`mmworker replay` without a broker: what is selected, what is refused, what is posted."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from mmworker_schemas import Failure, SourceCoords
from mmworker_schemas.codes import ErrorCode

from mmworker.backfill import OUTPUT_COLUMNS, journal_path, read_output, write_rows
from mmworker.devkit.broker import EmbeddedBroker
from mmworker.errors import ConfigError
from mmworker.replay import (
    Selection,
    backfill_failures,
    parse_codes,
    parse_when,
    refusal,
    replay_payload,
    update_backfill_output,
)

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


def _out_row(i: int, outcome: str, code: str | None = None) -> dict[str, object]:
    row: dict[str, object] = dict.fromkeys(name for name, _ in OUTPUT_COLUMNS)
    row.update(job_id=f"bf/{i}", row=str(i), row_number=i, source=f"{i}.jpg", outcome=outcome,
               code=code, fingerprint=f"fp{i}", metadata='{"album": "a"}')  # fmt: skip
    return row


def test_a_replay_rewrites_its_rows_of_a_backfill_output_in_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o.jsonl"
    rows = [_out_row(0, "ok"), _out_row(1, "failed", "fetch_failed"), _out_row(2, "ok"),
            _out_row(3, "failed", "invalid_schema"),
            _out_row(4, "failed", "job_timeout")]  # fmt: skip
    write_rows(out, "jsonl", rows)
    retry = tmp_path / "o.retry.jsonl"
    retry.write_text('{"uri": "1.jpg"}\n{"uri": "3.jpg"}\n{"uri": "4.jpg"}\n')
    assert backfill_failures(out) == {"bf/1": "fp1", "bf/4": "fp4"}  # never invalid_schema
    answered = {**_out_row(9, "ok"), "job_id": "bf/1", "caption": "a cat", "row": "x"}
    again = {**_out_row(9, "failed", "job_timeout"), "job_id": "bf/4", "fingerprint": "fp4"}
    update_backfill_output(out, {"bf/1": answered, "bf/4": again}, 60, unanswered=0)
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["job_id"] for r in got] == [f"bf/{i}" for i in range(5)]  # the same order
    assert (got[1]["outcome"], got[1]["caption"]) == ("ok", "a cat")
    # The row's own fields stay: its key, number, source and metadata columns.
    assert (got[1]["row"], got[1]["row_number"], got[1]["source"]) == ("1", 1, "1.jpg")
    assert got[1]["metadata"] == '{"album": "a"}' and got[1]["fingerprint"] == "fp9"
    assert got[4]["code"] == "job_timeout" and got[0] == rows[0]
    assert retry.read_text() == '{"uri": "3.jpg"}\n{"uri": "4.jpg"}\n'  # row 1 left it
    err = capsys.readouterr().err
    assert f"updated {out}: 2 rows answered again, 1 of them ok now" in err, err


def test_a_retry_manifest_that_does_not_match_is_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o.parquet"
    write_rows(out, "parquet", [_out_row(0, "failed", "fetch_failed"), _out_row(1, "ok")])
    retry = tmp_path / "o.retry.jsonl"
    retry.write_text('{"uri": "edited by hand"}\n{"uri": "x"}\n')  # 2 lines for 1 failed row
    update_backfill_output(out, {"bf/0": _out_row(0, "ok")}, 60, unanswered=0)
    assert [r["outcome"] for r in read_output(out)] == ["ok", "ok"]
    assert retry.read_text() == '{"uri": "edited by hand"}\n{"uri": "x"}\n'
    assert "o.retry.jsonl left as it was" in capsys.readouterr().err


def test_an_unfinished_backfill_is_not_replayed_into(tmp_path: Path) -> None:
    out = tmp_path / "o.jsonl"
    with pytest.raises(ConfigError, match="no such file"):
        backfill_failures(out)
    write_rows(out, "jsonl", [_out_row(0, "failed", "fetch_failed")])
    journal_path(out).write_text("")
    with pytest.raises(ConfigError, match="not finished"):
        backfill_failures(out)


def test_the_selection_is_of_each_jobs_latest_failure(broker: EmbeddedBroker) -> None:
    """On the real broker: j1 failed to fetch, was replayed, and then failed for good; a
    `--retryable-only` replay re-posted its first failure's payload all the same (the filter
    ran before each job's latest failure was picked). j2's only failure is retryable."""
    from kafka import KafkaProducer

    from mmworker.config import load_config
    from mmworker.kafka_io import ensure_topics
    from mmworker.replay import scan

    dlq = f"dlq-{uuid.uuid4().hex[:6]}"
    cfg = load_config(kafka={"bootstrap_servers": broker.bootstrap, "dead_letter_topic": dlq})
    ensure_topics(cfg.kafka, {dlq: 1})
    first = _failure()
    final = _failure(ErrorCode.UNDECODABLE_IMAGE, failed_at=NOW + timedelta(minutes=5))
    other = _failure(job_id="j2")
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap)
    for failure in (first, final, other):
        producer.send(dlq, failure.model_dump_json().encode()).get(10)
    producer.close()

    found = scan(cfg, Selection(retryable_only=True))
    assert set(found.chosen) == {"j2"}, found.chosen
    assert (found.scanned, found.matched) == (3, 1)
    everything = scan(cfg, Selection())
    assert everything.chosen["j1"][0].code == ErrorCode.UNDECODABLE_IMAGE
    assert (everything.matched, len(everything.chosen)) == (3, 2)
