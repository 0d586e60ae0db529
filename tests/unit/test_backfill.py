"""`mmworker backfill` without a broker: manifests, job ids, output rows, the journal, resume."""

from __future__ import annotations

import csv
import json
import os
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mmworker_schemas import Failure, Job, Result, SourceCoords, Timings, Usage
from mmworker_schemas.codes import ErrorCode

from mmworker.backfill import (
    DUPLICATE,
    INVALID_ROW,
    NEW,
    OUTPUT_COLUMNS,
    STALE,
    BrokerLink,
    Columns,
    Defaults,
    Journal,
    ManifestError,
    Planned,
    Row,
    RowMissing,
    Sent,
    State,
    Tally,
    _next_job,
    answer_key,
    check_columns,
    count_rows,
    journal_path,
    load_state,
    local_failure,
    output_row,
    plan,
    read_manifest,
    repost_due,
    write_results,
)
from mmworker.devkit.samples import sample_image

ROWS: list[dict[str, object]] = [
    {"id": "a", "path": "img/a.jpg", "album": "x", "opts": {"max_tokens": 4}},
    {"id": "b", "path": "/abs/b.png", "album": "y", "opts": {"task": "tags", "seed": 3}},
    {"id": "c", "path": "https://example.org/c.jpg", "album": None, "opts": None},
]
COLS = Columns(uri="path", key="id", options="opts", metadata=("album",))
DEFAULTS = Defaults(generation={"max_tokens": 16, "temperature": 0.0})


def _write(tmp: Path, kind: str, rows: list[dict[str, object]] = ROWS) -> Path:
    if kind == "jsonl":
        path = tmp / "m.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    elif kind == "csv":
        path = tmp / "m.csv"
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            for r in rows:
                writer.writerow({k: json.dumps(v) if isinstance(v, dict) else v
                                 for k, v in r.items()})  # fmt: skip
    else:
        path = tmp / "m.parquet"
        table = pa.Table.from_pylist(
            [{**r, "opts": json.dumps(r["opts"]) if r["opts"] else None} for r in rows]
        )
        pq.write_table(table, path)
    return path


def _jobs(path: Path) -> list[Job]:
    planned = [plan(r, "bf", COLS, DEFAULTS, path.parent) for r in read_manifest(str(path))]
    assert all(p.problem is None for p in planned), [p.problem for p in planned]
    return [p.job for p in planned if p.job is not None]


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet"])
def test_each_manifest_format_gives_the_same_jobs(tmp_path: Path, kind: str) -> None:
    path = _write(tmp_path, kind)
    assert count_rows(str(path)) == 3
    jobs = _jobs(path)
    assert [j.job_id for j in jobs] == ["bf/a", "bf/b", "bf/c"]
    a, b, c = jobs
    assert a.media[0].uri == (tmp_path / "img" / "a.jpg").as_uri()  # relative: to the manifest
    assert b.media[0].uri == "file:///abs/b.png"
    assert c.media[0].uri == "https://example.org/c.jpg"
    assert (a.generation.max_tokens, b.generation.max_tokens) == (4, 16)  # the row's wins
    assert (b.task, b.generation.seed) == ("tags", 3)
    assert a.metadata is not None
    assert a.metadata == {"source": "img/a.jpg", "backfill": "bf", "row": "a",
                          "columns": {"album": "x"},
                          "fingerprint": a.metadata["fingerprint"]}  # fmt: skip


def test_a_directory_or_glob_is_its_media_files_by_content(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "photo").write_bytes(sample_image(width=32, height=32))
    (tmp_path / "b.jpg").write_bytes(sample_image(width=32, height=32, seed=1))
    (tmp_path / "notes.jpg").write_text("not an image, whatever its name says")
    rows = [r.fields["uri"] for r in read_manifest(str(tmp_path))]
    assert rows == [str(tmp_path / "b.jpg"), str(tmp_path / "sub" / "photo")]
    globbed = [r.fields["uri"] for r in read_manifest(str(tmp_path / "*.jpg"))]
    assert globbed == [str(tmp_path / "b.jpg")]


def test_manifest_mistakes_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="no such file"):
        list(read_manifest(str(tmp_path / "gone.jsonl")))
    (tmp_path / "m.txt").write_text("x")
    with pytest.raises(ManifestError, match=r"a file ending in \.jsonl"):
        list(read_manifest(str(tmp_path / "m.txt")))
    (tmp_path / "bad.jsonl").write_text('{"uri": "a"}\n{"uri": \n')
    with pytest.raises(ManifestError, match="line 2: not JSON"):
        list(read_manifest(str(tmp_path / "bad.jsonl")))
    # A quote left open read the rest of the file into one field: three rows, one job.
    (tmp_path / "open.csv").write_text('uri,key\n"a.jpg,1\nb.jpg,2\nc.jpg,3\n')
    with pytest.raises(ManifestError, match=r"open\.csv: line .*: unexpected end of data"):
        count_rows(str(tmp_path / "open.csv"))
    with pytest.raises(ManifestError, match="a quote left open"):
        list(read_manifest(str(tmp_path / "open.csv")))
    # A long prompt is a field, not an error (csv's own limit is 128 KiB).
    (tmp_path / "long.csv").write_text("uri,prompt\na.jpg," + "x" * 300_000 + "\n")
    assert count_rows(str(tmp_path / "long.csv")) == 1
    ((row),) = list(read_manifest(str(tmp_path / "long.csv")))
    assert len(row.fields["prompt"]) == 300_000


def test_manifests_a_user_may_hand_over_are_read_or_refused_in_one_line(tmp_path: Path) -> None:
    """A file named like a glob is that file (it read as a glob matching nothing: an empty,
    "successful" backfill); a spreadsheet's "CSV UTF-8" starts with a byte-order mark (its first
    column read as "\ufeffuri"); another encoding and a damaged Parquet file were tracebacks."""
    named = tmp_path / "batch[2024].jsonl"
    named.write_text('{"uri": "https://example.org/a.jpg"}\n')
    assert [r.fields["uri"] for r in read_manifest(str(named))] == ["https://example.org/a.jpg"]
    bom = tmp_path / "sheet.csv"
    bom.write_bytes(b"\xef\xbb\xbfuri,album\nhttps://example.org/a.jpg,x\n")
    assert [r.fields for r in read_manifest(str(bom))] == [
        {"uri": "https://example.org/a.jpg", "album": "x"}
    ]
    check_columns(str(bom), Columns())
    latin = tmp_path / "latin.csv"
    latin.write_bytes(b"uri,album\nhttps://example.org/a.jpg,caf\xe9\n")
    with pytest.raises(ManifestError, match="not UTF-8"):
        list(read_manifest(str(latin)))
    damaged = tmp_path / "damaged.parquet"
    damaged.write_bytes(b"PAR1 not really")
    for read in (lambda: list(read_manifest(str(damaged))), lambda: count_rows(str(damaged))):
        with pytest.raises(ManifestError, match="not a readable Parquet file"):
            read()


@pytest.mark.parametrize(("name", "fmt"), [("res.out", "parquet"), ("res.parquet", "jsonl")])
def test_an_output_is_read_in_the_format_it_was_written(
    tmp_path: Path, name: str, fmt: str
) -> None:
    """`--format` may override the name's suffix; a re-run of the finished backfill (and a
    replay into it) read the output by its suffix and failed with a traceback."""
    from mmworker.backfill import read_output, write_rows, written_format

    out = tmp_path / name
    rows = [{"job_id": "bf/a", "outcome": "ok"}]
    write_rows(out, fmt, iter(rows))
    assert written_format(out) == fmt
    assert [r["job_id"] for r in read_output(out)] == ["bf/a"]


def _id(row: Row, cols: Columns, defaults: Defaults = DEFAULTS, name: str = "bf") -> str:
    return plan(row, name, cols, defaults, Path("/m")).job_id


def test_job_ids_are_deterministic_and_follow_the_row() -> None:
    cols = Columns(uri="uri", prompt="prompt")
    row = Row(0, {"uri": "a.jpg", "prompt": "what?"})
    first = _id(row, cols)
    assert first.startswith("bf/") and len(first) == 3 + 32
    # The same row elsewhere in the manifest, or in another process: the same id.
    assert _id(Row(7, dict(row.fields)), cols) == first
    # Another prompt, other options, another name: another job.
    assert _id(Row(0, {"uri": "a.jpg", "prompt": "who?"}), cols) != first
    assert _id(row, cols, Defaults(generation={"max_tokens": 17})) != first
    assert _id(row, cols, name="bf2") != first
    # A key too long for a job id is hashed, still deterministically.
    keyed = Columns(uri="uri", key="k")
    long = Row(0, {"uri": "a.jpg", "k": "x" * 300})
    assert _id(long, keyed) == _id(Row(3, dict(long.fields)), keyed)
    assert len(_id(long, keyed)) == 3 + 32
    # A missing key falls back to the hash, and the row number names it in the output.
    fallback = plan(Row(4, {"uri": "a.jpg"}), "bf", keyed, DEFAULTS, Path("/m"))
    assert fallback.key == "4"
    assert fallback.job_id == _id(Row(9, {"uri": "a.jpg", "k": ""}), keyed)
    # A gap in a float key column (pandas writes NaN) is no key either: as "nan", every such
    # row was one job, and all but the first were dropped as its duplicates.
    gaps = [plan(Row(i, {"uri": f"{i}.jpg", "k": float("nan")}), "bf", keyed, DEFAULTS,
                 Path("/m")) for i in range(2)]  # fmt: skip
    assert [p.key for p in gaps] == ["0", "1"] and gaps[0].job_id != gaps[1].job_id


def test_rows_that_cannot_be_jobs_become_typed_failures(tmp_path: Path) -> None:
    cols = Columns(uri="uri", key="k", options="o")
    cases = {
        "zero": ({"max_tokens": 0}, "generation.max_tokens"),
        "unknown": ({"colour": "red"}, "unknown option 'colour'"),
        "notjson": ("{nope", "options: not JSON"),
    }
    for key, (options, expected) in cases.items():
        p = plan(Row(0, {"uri": "a.jpg", "k": key, "o": options}), "bf", cols, DEFAULTS, tmp_path)
        assert p.job is None and expected in str(p.problem), (key, p.problem)
        row = local_failure(p)
        assert (row["job_id"], row["outcome"], row["code"]) == (f"bf/{key}", "failed", INVALID_ROW)
    empty = plan(Row(0, {"k": "e"}), "bf", cols, DEFAULTS, tmp_path)
    assert empty.problem == "no media: column 'uri' is empty or missing"


def _result(job_id: str, text: str = "a cat") -> Result:
    return Result(
        job_id=job_id, text=text, finish_reason="length", model="tiny",
        usage=Usage(prompt_tokens=90, visual_tokens=4, output_tokens=1), media=[],
        timings=Timings(queue_wait_s=0.1, fetch_s=0, preprocess_s=0, engine_s=0.2, total_s=0.3),
        cache_hit=False, source=SourceCoords(topic="t", partition=0, offset=1), worker_id="w",
        metadata={"source": "a.jpg", "backfill": "bf", "row": "a", "columns": {"album": "x"}},
    )  # fmt: skip


def _failure(job_id: str) -> Failure:
    return Failure(
        job_id=job_id, code=ErrorCode.FORBIDDEN_URI, message="outside", retryable=False,
        attempts=1, source=SourceCoords(topic="t", partition=0, offset=2), worker_id="w",
        payload=b"{}", metadata={"source": "/etc/passwd", "backfill": "bf", "row": "b"},
        failed_at=datetime(2026, 1, 1, tzinfo=UTC),
    )  # fmt: skip


def test_output_rows_from_results_and_failures() -> None:
    ok = output_row(json.loads(_result("bf/a").model_dump_json(by_alias=True)))
    assert ok is not None
    assert set(ok) == {name for name, _ in OUTPUT_COLUMNS}
    assert (ok["outcome"], ok["caption"], ok["row"], ok["source"]) == ("ok", "a cat", "a", "a.jpg")
    assert (ok["prompt_tokens"], ok["output_tokens"], ok["total_s"]) == (90, 1, 0.3)
    assert json.loads(ok["metadata"]) == {"album": "x"}
    bad = output_row(json.loads(_failure("bf/b").model_dump_json()))
    assert bad is not None
    assert (bad["outcome"], bad["code"], bad["message"], bad["caption"]) == (
        "failed", "forbidden_uri", "outside", None)  # fmt: skip
    assert output_row({"job_id": "bf/x"}) is None  # neither a result nor a failure


def _answer(p: Planned, text: str) -> dict[str, object]:
    """The output row of a worker's answer to planned row `p`."""
    meta = p.job.metadata if p.job is not None else {}
    result = _result(p.job_id, text).model_copy(update={"metadata": meta})
    row = output_row(json.loads(result.model_dump_json(by_alias=True)))
    assert row is not None
    return row


def _manifest(tmp: Path, n: int) -> tuple[Path, list[tuple[Row, Planned]]]:
    path = tmp / "m.jsonl"
    path.write_text("".join(json.dumps({"k": f"r{i}", "uri": f"{i}.jpg"}) + "\n"
                            for i in range(n)))  # fmt: skip
    cols = Columns(key="k")
    return path, [(r, plan(r, "bf", cols, DEFAULTS, tmp)) for r in read_manifest(str(path))]


def _journal(out: Path, answers: list[dict[str, object]]) -> None:
    journal = Journal(out)
    journal.write({"t": "answer", "row": a} for a in answers)
    journal.close()


def _table(out: Path) -> list[dict[str, object]]:
    if out.suffix == ".parquet":
        return list(pq.read_table(out).to_pylist())
    return [json.loads(x) for x in out.read_text().splitlines()]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_output_is_in_manifest_order_once_per_row_from_the_output_and_the_journal(
    tmp_path: Path, suffix: str
) -> None:
    _, rows = _manifest(tmp_path, 5)
    plans = [p for _, p in rows]
    out = tmp_path / f"results{suffix}"
    retry = tmp_path / "results.retry.jsonl"
    journal = Journal(out)  # answered in another order than the manifest's
    journal.write({"t": "answer", "row": _answer(p, f"t{p.index}")} for p in plans[2::-1])
    journal.close()
    with pytest.raises(RowMissing, match="manifest row 3"):  # rows 3 and 4 have no answer yet
        write_results(out, suffix.strip("."), rows, retry)
    assert not out.exists() and journal_path(out).exists()  # nothing final, the journal kept
    # A second run: one duplicate of an answered row, the two missing ones, a torn last line.
    journal = Journal(out)
    journal.write({"t": "answer", "row": _answer(p, f"t{p.index}")} for p in plans[1:])
    journal.close()
    with journal_path(out).open("ab") as f:
        f.write(b'{"t":"answer","row":{"job_id":"bf/')
    state = load_state(out)
    assert all(state.outcome(p) == "ok" for p in plans)
    assert journal_path(out).read_bytes().endswith(b"}\n")  # the torn line was cut off
    written = write_results(out, suffix.strip("."), rows, retry)
    assert (written.rows, written.outcomes, written.retry) == (5, {"ok": 5}, None)
    table = _table(out)
    assert [r["job_id"] for r in table] == [f"bf/r{i}" for i in range(5)]
    assert [r["row_number"] for r in table] == [0, 1, 2, 3, 4]  # kept beside the key
    assert [r["caption"] for r in table] == [f"t{i}" for i in range(5)]
    assert not journal_path(out).exists() and not retry.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl", out.name]  # no scratch left


def test_a_changed_question_is_asked_again_under_the_same_key(tmp_path: Path) -> None:
    """Issue #35: an answer stands only for the question its row asks now. Here the key column
    keeps the job id while the options change; the earlier answer is stale, not reused."""
    _, rows = _manifest(tmp_path, 2)
    out = tmp_path / "o.jsonl"
    retry = tmp_path / "o.retry.jsonl"
    _journal(out, [_answer(p, "old") for _, p in rows])
    write_results(out, "jsonl", rows, retry)
    longer = Defaults(generation={"max_tokens": 99})
    again = [(r, plan(r, "bf", Columns(key="k"), longer, tmp_path)) for r, _ in rows]
    assert [p.job_id for _, p in again] == [p.job_id for _, p in rows]
    assert all(p.fingerprint != q.fingerprint for (_, p), (_, q) in zip(again, rows, strict=True))
    state = load_state(out)
    assert [state.outcome(p) for _, p in rows] == ["ok", "ok"]
    assert [state.outcome(p) for _, p in again] == [None, None]  # asked again
    tally = Tally(total=2)
    plans = iter([p for _, p in again])
    assert _next_job(plans, state, set(), tally) == again[0][1]
    # The old answer arriving late for the new question is stale; the new one is taken.
    state.posted[again[0][1].job_id] = Sent(1.0, b"{}", again[0][1].fingerprint)
    assert state.answer(_answer(rows[0][1], "late")) == STALE
    assert state.answer(_answer(again[0][1], "new")) == NEW
    assert state.answer(_answer(again[0][1], "new")) == DUPLICATE
    with pytest.raises(RowMissing):  # row 1's new question has no answer yet
        write_results(out, "jsonl", again, retry)
    _journal(out, [_answer(p, "new") for _, p in again])
    written = write_results(out, "jsonl", again, retry)
    assert [r["caption"] for r in _table(out)] == ["new", "new"]
    assert written.unused == 2  # the two old answers


def test_invalid_rows_are_rechecked_on_every_run_never_kept(tmp_path: Path) -> None:
    """Issue #35 item 1, the unit half: rows that failed locally (a wrong --uri-column) came
    back as 10 extra rows next to the right ones on a re-run with the right column."""
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"path": f"{i}.jpg"}) + "\n" for i in range(3)))
    out, retry = tmp_path / "o.jsonl", tmp_path / "o.retry.jsonl"

    def rows(cols: Columns) -> list[tuple[Row, Planned]]:
        return [(r, plan(r, "bf", cols, DEFAULTS, tmp_path)) for r in read_manifest(str(path))]

    wrong = rows(Columns(uri="uri"))
    written = write_results(out, "jsonl", wrong, retry)
    assert (written.rows, written.outcomes) == (3, {INVALID_ROW: 3})
    assert len(retry.read_text().splitlines()) == 3
    right = rows(Columns(uri="path"))
    assert load_state(out).outcomes == {}  # nothing of the wrong run is kept
    _journal(out, [_answer(p, "c") for _, p in right])
    written = write_results(out, "jsonl", right, retry)
    assert (written.rows, written.outcomes, written.retry) == (3, {"ok": 3}, None)
    assert [r["row_number"] for r in _table(out)] == [0, 1, 2]
    assert not retry.exists()


def test_resume_state_knows_what_is_posted_answered_and_due(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    journal = Journal(out)
    ok_a = {"job_id": "bf/a", "fingerprint": "fa", "outcome": "ok"}
    journal.write([
        {"t": "posted", "id": "bf/a", "at": 100.0, "fp": "fa", "job": '{"a":1}'},
        {"t": "posted", "id": "bf/b", "at": 100.0, "fp": "fb", "job": '{"b":1}'},
        {"t": "posted", "id": "bf/c", "at": 190.0, "fp": "fc", "job": '{"c":1}'},
        {"t": "answer", "row": ok_a},
        {"t": "positions", "pos": {"out:0": 5}},
        {"t": "positions", "pos": {"out:0": 9, "dlq:0": 2}},
    ])  # fmt: skip
    journal.close()
    state = load_state(out)
    assert state.outcomes == {answer_key("bf/a", "fa"): "ok"}
    assert sorted(state.posted) == ["bf/b", "bf/c"]
    assert state.posted["bf/b"] == Sent(100.0, b'{"b":1}', "fb")
    assert state.positions == {"out:0": 9, "dlq:0": 2}
    # Past the grace period only the old one is re-posted; the young one may still be answered.
    assert repost_due(state.posted, now=200.0, grace_s=60) == ["bf/b"]
    assert repost_due(state.posted, now=260.0, grace_s=60) == ["bf/b", "bf/c"]
    # A failure that lost the job's metadata is taken as the answer to what was posted.
    assert state.answer({"job_id": "bf/b", "outcome": "failed", "code": "x"}) == NEW
    assert state.outcomes[answer_key("bf/b", "fb")] == "x"
    assert state.answer({"job_id": "bf/b", "fingerprint": "fb", "outcome": "ok"}) == DUPLICATE
    assert "bf/b" not in state.posted


def test_a_journal_resumes_under_its_own_name_only(tmp_path: Path) -> None:
    """Its posted jobs fill the window and their answers are another backfill's: under another
    --name the resume posted nothing and waited for ever."""
    from mmworker.backfill import check_journal_name
    from mmworker.errors import ConfigError

    out = tmp_path / "r.jsonl"
    journal = Journal(out)
    journal.write([{"t": "posted", "id": "bf/a", "at": 1.0, "fp": "fa", "job": "{}"}])
    journal.close()
    state = load_state(out)
    check_journal_name(out, state, "bf")
    with pytest.raises(ConfigError, match=r"another backfill than 'other' \(it posted job 'bf/a'"):
        check_journal_name(out, state, "other")


def test_next_job_skips_answered_posted_duplicate_and_bad_rows(tmp_path: Path) -> None:
    cols = Columns(uri="uri", key="k", options="o")
    fields: list[dict[str, object]] = [
        {"uri": "a.jpg", "k": "done"}, {"uri": "a.jpg", "k": "posted"},
        {"uri": "a.jpg", "k": "bad", "o": {"max_tokens": -1}}, {"uri": "a.jpg", "k": "new"},
        {"uri": "a.jpg", "k": "new"}, {"uri": "b.jpg", "k": "last"},
    ]  # fmt: skip
    plans = [plan(Row(i, f), "bf", cols, DEFAULTS, tmp_path) for i, f in enumerate(fields)]
    state = State(
        outcomes={answer_key("bf/done", plans[0].fingerprint): "ok"},
        posted={"bf/posted": Sent(1.0, b"{}", plans[1].fingerprint)},
    )
    tally, seen = Tally(total=6), set[str]()
    got = []
    it = iter(plans)
    while p := _next_job(it, state, seen, tally):
        got.append(p.job_id)
    assert got == ["bf/new", "bf/last"]
    assert (tally.duplicate_rows, tally.outcomes[INVALID_ROW]) == (1, 1)
    assert tally.done == 3  # done, bad, the duplicate; the others wait for answers
    assert tally.awaiting == {"bf/posted", "bf/new", "bf/last"}


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet"])
def test_columns_the_options_name_are_checked_before_anything_is_posted(
    tmp_path: Path, kind: str
) -> None:
    path = _write(tmp_path, kind)
    check_columns(str(path), COLS)  # all there
    wrong = Columns(uri="uri", key="id", metadata=("album", "colour"))
    with pytest.raises(ManifestError) as caught:
        check_columns(str(path), wrong)
    message = str(caught.value)
    assert "\n" not in message
    assert "no column 'uri' (--uri-column), 'colour' (--metadata-columns)" in message, message
    assert "id, path, album, opts" in message, message
    (tmp_path / "d").mkdir()
    with pytest.raises(ManifestError, match=r"'path' \(--uri-column\); its columns \(a directory"):
        check_columns(str(tmp_path / "d"), Columns(uri="path"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    check_columns(str(empty), wrong)  # no rows: nothing to check, nothing is posted


def test_journal_writes_whole_lines_in_one_call(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "o.jsonl")
    journal.write({"t": "positions", "pos": {"x:0": i}} for i in range(1000))
    journal.close()
    lines = journal_path(tmp_path / "o.jsonl").read_bytes().splitlines()
    assert len(lines) == 1000 and json.loads(lines[-1])["pos"] == {"x:0": 999}
    assert os.stat(journal_path(tmp_path / "o.jsonl")).st_mode & 0o777 == 0o644 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_lost_broker_is_one_line_each_way(capsys: pytest.CaptureFixture[str]) -> None:
    now = [0.0]
    link = BrokerLink("kafka.bootstrap_servers=k:9092", after_s=3.0, clock=lambda: now[0])
    assert link.observe(True, "") is False
    for t in (1.0, 2.0, 2.9):  # a reconnect kafka-python makes by itself is no loss
        now[0] = t
        assert link.observe(False, "no connection") is False
    now[0] = 3.5
    assert link.observe(True, "") is False  # back before it was reported: nothing said
    assert capsys.readouterr().err == ""
    for t in (10.0, 12.0, 13.0, 20.0, 30.0):
        now[0] = t
        assert link.observe(False, "KafkaTimeoutError while posting") is False
    now[0] = 41.0
    assert link.observe(True, "") is True  # the caller re-posts what is unanswered, after grace
    assert link.observe(True, "") is False
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("mmworker backfill: lost the brokers (kafka.bootstrap_servers=k:")
    assert "KafkaTimeoutError while posting" in lines[0]
    assert lines[1].startswith("mmworker backfill: the brokers are back after 31s")
    assert link.outages == 1


def test_a_loss_counts_from_the_start_of_the_post_that_blocked_on_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A post to a broker that just went away blocks for its flush timeout (30 s) before it
    fails: the line comes at that first failure, not after a second blocked post (a CI run
    waited over 60 s for it)."""
    now = [100.0]
    link = BrokerLink("kafka.bootstrap_servers=k:9092", after_s=3.0, clock=lambda: now[0])
    now[0] = 130.0  # the post began at 100 and gave up at 130
    assert link.observe(False, "KafkaTimeoutError while posting", since=100.0) is False
    assert "lost the brokers" in capsys.readouterr().err
    now[0] = 131.0
    assert link.observe(True, "") is True
    assert "back after 31s" in capsys.readouterr().err


def test_an_output_from_before_fingerprints_is_kept_by_job_id(tmp_path: Path) -> None:
    """An output written by an earlier release has no fingerprint column: its answers stand for
    their job ids, so a finished backfill is not asked again after an upgrade."""
    _, rows = _manifest(tmp_path, 3)
    out, retry = tmp_path / "old.jsonl", tmp_path / "old.retry.jsonl"
    legacy = [{k: v for k, v in _answer(p, f"t{p.index}").items()
               if k not in ("fingerprint", "row_number")} for _, p in rows]  # fmt: skip
    out.write_text("".join(json.dumps(r) + "\n" for r in legacy[::-1]))
    state = load_state(out)
    assert [state.outcome(p) for _, p in rows] == ["ok", "ok", "ok"]
    written = write_results(out, "jsonl", rows, retry)
    assert written.rows == 3 and written.unused == 0
    assert [(r["caption"], r["row_number"]) for r in _table(out)] == [
        (f"t{i}", i) for i in range(3)
    ]


def test_a_retry_manifest_beside_the_output_asks_for_the_same_files(tmp_path: Path) -> None:
    """Relative paths are read from a manifest's own directory; the retry manifest sits beside
    the output, so its rows pointed at other files (out/img.jpg for data/img.jpg), or none."""
    from mmworker.backfill import with_absolute_media

    data, results = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    results.mkdir()
    _, rows = _manifest(data, 2)
    # A row that never became a job (options not JSON): its fix is an edit of the retry
    # manifest, which must then ask for the same file too.
    cols = Columns(key="k", options="o")
    (data / "bad.jsonl").write_text(json.dumps({"k": "bad", "uri": "2.jpg", "o": "{"}) + "\n")
    (bad_row,) = read_manifest(str(data / "bad.jsonl"))
    bad = plan(bad_row, "bf", cols, DEFAULTS, data)
    assert bad.job is None and bad.problem
    out, retry = results / "captions.jsonl", results / "captions.retry.jsonl"
    failed = [_failure(p.job_id).model_copy(update={"metadata": p.job.metadata})  # type: ignore[union-attr]
              for _, p in rows]  # fmt: skip
    _journal(out, [output_row(json.loads(f.model_dump_json())) for f in failed])  # type: ignore[misc]
    rows.append((bad_row, bad))
    absolute = ((with_absolute_media(r, p, "uri", data), p) for r, p in rows)
    written = write_results(out, "jsonl", absolute, retry)
    assert written.retry == retry  # every row failed
    again = [plan(r, "bf", cols, DEFAULTS, results) for r in read_manifest(str(retry))]
    first = [p for _, p in rows[:2]]
    assert [p.job.media[0].uri for p in again[:2]] == [p.job.media[0].uri for p in first]  # type: ignore[union-attr]
    assert [p.job.media[0].uri for p in first] == [(data / f"{i}.jpg").as_uri() for i in range(2)]  # type: ignore[union-attr]
    assert [p.job_id for p in again[:2]] == [p.job_id for p in first]
    assert again[2].job is None and again[2].source == (data / "2.jpg").as_uri()
    # A path that is none at all stays as written (it raised out of the final write).
    (data / "nul.jsonl").write_text(json.dumps({"k": "nul", "uri": "a\u0000b.jpg"}) + "\n")
    (nul_row,) = read_manifest(str(data / "nul.jsonl"))
    nul = plan(nul_row, "bf", cols, DEFAULTS, data)
    assert nul.job is None and with_absolute_media(nul_row, nul, "uri", data) == nul_row


def test_the_output_is_on_disk_before_the_journal_that_could_redo_it_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing was flushed: a reboot right after the final pass left an empty or cut output,
    and the journal was already gone."""
    _, rows = _manifest(tmp_path, 2)
    out, retry = tmp_path / "out.jsonl", tmp_path / "out.retry.jsonl"
    _journal(out, [_answer(p, "a caption") for _, p in rows])
    steps: list[str] = []
    real_fsync, real_replace, real_unlink = os.fsync, os.replace, Path.unlink

    def fsync(fd: int) -> None:
        target = Path(os.readlink(f"/proc/self/fd/{fd}"))
        steps.append(f"fsync {target.name if target.is_file() else 'directory'}")
        real_fsync(fd)

    def replace(src: Path, dst: Path) -> None:
        steps.append(f"rename {Path(src).name} -> {Path(dst).name}")
        real_replace(src, dst)

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self == journal_path(out):
            steps.append("drop the journal")
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(Path, "unlink", unlink)
    write_results(out, "jsonl", rows, retry)
    assert steps == [
        "fsync .out.jsonl.tmp", "rename .out.jsonl.tmp -> out.jsonl", "fsync directory",
        "drop the journal",
    ]  # fmt: skip


def test_an_out_that_is_not_a_backfills_output_is_a_one_line_error(tmp_path: Path) -> None:
    """--out naming the manifest, another tool's JSONL or a directory raised KeyError or
    IsADirectoryError mid-run (exit 1, which says "some rows failed")."""
    manifest, _ = _manifest(tmp_path, 2)
    other = tmp_path / "other.jsonl"
    other.write_text('{"id": 1}\n')
    # `mmworker tail --json`: results with a job id, and no outcome (a KeyError mid-run)
    tailed = tmp_path / "tailed.jsonl"
    tailed.write_text(json.dumps({"job_id": "bf/a", "text": "a cat", "model": "m"}) + "\n")
    (tmp_path / "dir.jsonl").mkdir()
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    from mmworker.errors import ConfigError

    cases = [(manifest, "row 1 is not a row"), (other, "row 1 is not a row"),
             (tailed, "row 1 is not a row"),
             (tmp_path / "dir.jsonl", "IsADirectoryError"), (broken, "near row 1")]  # fmt: skip
    for out, why in cases:
        with pytest.raises(ConfigError, match=why):
            load_state(out)


def test_a_job_over_the_producers_request_size_is_its_rows_failure(tmp_path: Path) -> None:
    """The producer refused it (MessageSizeTooLargeError), which stopped the whole backfill as
    "cannot post to topic", and again at every re-run, on the same row."""
    cols = Columns(uri="uri", prompt="prompt")
    big = Row(0, {"uri": "a.jpg", "prompt": "x" * 5000})
    small = Row(1, {"uri": "b.jpg", "prompt": "what?"})
    refused = plan(big, "bf", cols, DEFAULTS, tmp_path, max_bytes=4096)
    assert refused.job is None and refused.problem is not None
    assert "over kafka.max_request_size (4096)" in refused.problem
    assert plan(small, "bf", cols, DEFAULTS, tmp_path, max_bytes=4096).job is not None
    assert plan(big, "bf", cols, DEFAULTS, tmp_path).job is not None  # no limit given


def test_catching_up_with_the_brokers_gone_stops_on_a_signal_a_library_swallowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The catch-up loop runs without end while no broker answers, which is when a user presses
    Ctrl-C; a library that swallowed the `Interrupted` left it running until a second Ctrl-C."""
    import signal as signals

    from mmworker import exits
    from mmworker.backfill import Collector

    polls: list[int] = []

    class Gone:
        def poll(self, journal: object, tally: object, timeout_ms: int) -> int:
            polls.append(timeout_ms)
            assert len(polls) < 50, "still catching up after the signal"
            if len(polls) == 3:
                exits._seen.append(signals.SIGINT)  # the handler ran; its raise was swallowed
            return 0

        def connected(self) -> bool:
            return False

    class Link:
        def observe(self, up: bool, why: str) -> None:
            pass

    monkeypatch.setattr(exits, "_seen", [])
    with pytest.raises(exits.Interrupted):
        Collector.catch_up(Gone(), None, None, Link())  # type: ignore[arg-type]
    assert len(polls) == 3
