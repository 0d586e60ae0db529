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
from mmworker.schemas import Failure, Job, Result, SourceCoords, Timings, Usage
from mmworker.schemas.codes import ErrorCode

from mmworker.backfill import (
    INVALID_ROW,
    OUTPUT_COLUMNS,
    Columns,
    Defaults,
    Journal,
    ManifestError,
    Row,
    State,
    Tally,
    _next_job,
    count_rows,
    journal_path,
    load_state,
    local_failure,
    output_row,
    plan,
    read_manifest,
    repost_due,
    write_output,
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
    assert a.metadata == {"source": "img/a.jpg", "backfill": "bf", "row": "a",
                          "columns": {"album": "x"}}  # fmt: skip


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


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_output_merges_the_earlier_output_and_the_journal_without_duplicates(
    tmp_path: Path, suffix: str
) -> None:
    out = tmp_path / f"results{suffix}"
    rows = [output_row(json.loads(_result(f"bf/{i}", f"t{i}").model_dump_json(by_alias=True)))
            for i in range(5)]  # fmt: skip
    journal = Journal(out)
    journal.write({"t": "answer", "row": r} for r in rows[:3])
    journal.close()
    assert write_output(out, suffix.strip(".")) == 3
    assert not journal_path(out).exists()
    # A second run: one duplicate of an answered row, two new rows, then a line cut by SIGKILL.
    journal = Journal(out)
    journal.write({"t": "answer", "row": r} for r in [rows[1], *rows[3:]])
    journal.close()
    with journal_path(out).open("ab") as f:
        f.write(b'{"t":"answer","row":{"job_id":"bf/')
    state = load_state(out)
    assert set(state.outcomes) == {f"bf/{i}" for i in range(5)}
    assert journal_path(out).read_bytes().endswith(b"}\n")  # the torn line was cut off
    assert write_output(out, suffix.strip(".")) == 5
    table = (pq.read_table(out).to_pylist() if suffix == ".parquet"
             else [json.loads(x) for x in out.read_text().splitlines()])  # fmt: skip
    assert [r["job_id"] for r in table] == [f"bf/{i}" for i in range(5)]
    assert [r["caption"] for r in table] == [f"t{i}" for i in range(5)]


def test_resume_state_knows_what_is_posted_answered_and_due(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    journal = Journal(out)
    journal.write([
        {"t": "posted", "id": "bf/a", "at": 100.0, "job": '{"a":1}'},
        {"t": "posted", "id": "bf/b", "at": 100.0, "job": '{"b":1}'},
        {"t": "posted", "id": "bf/c", "at": 190.0, "job": '{"c":1}'},
        {"t": "answer", "row": local_failure(plan(Row(0, {"k": "a"}), "bf",
                                                  Columns(key="k"), DEFAULTS, tmp_path))},
        {"t": "positions", "pos": {"out:0": 5}},
        {"t": "positions", "pos": {"out:0": 9, "dlq:0": 2}},
    ])  # fmt: skip
    journal.close()
    state = load_state(out)
    assert state.outcomes == {"bf/a": INVALID_ROW}
    assert sorted(state.posted) == ["bf/b", "bf/c"]
    assert state.posted["bf/b"] == (100.0, b'{"b":1}')
    assert state.positions == {"out:0": 9, "dlq:0": 2}
    # Past the grace period only the old one is re-posted; the young one may still be answered.
    assert repost_due(state.posted, now=200.0, grace_s=60) == ["bf/b"]
    assert repost_due(state.posted, now=260.0, grace_s=60) == ["bf/b", "bf/c"]
    assert state.answer({"job_id": "bf/b", "outcome": "ok"}) is True
    assert state.answer({"job_id": "bf/b", "outcome": "ok"}) is False  # a duplicate
    assert "bf/b" not in state.posted


def test_next_job_skips_answered_posted_duplicate_and_bad_rows(tmp_path: Path) -> None:
    cols = Columns(uri="uri", key="k", options="o")
    fields: list[dict[str, object]] = [
        {"uri": "a.jpg", "k": "done"}, {"uri": "a.jpg", "k": "posted"},
        {"uri": "a.jpg", "k": "bad", "o": {"max_tokens": -1}}, {"uri": "a.jpg", "k": "new"},
        {"uri": "a.jpg", "k": "new"}, {"uri": "b.jpg", "k": "last"},
    ]  # fmt: skip
    rows = [Row(i, f) for i, f in enumerate(fields)]
    state = State(outcomes={"bf/done": "ok"}, posted={"bf/posted": (1.0, b"{}")})
    journal = Journal(tmp_path / "o.jsonl")
    tally, seen = Tally(total=6), set[str]()
    plans = (plan(r, "bf", cols, DEFAULTS, tmp_path) for r in rows)
    got = []
    while p := _next_job(plans, state, seen, journal, tally):
        got.append(p.job_id)
    journal.close()
    assert got == ["bf/new", "bf/last"]
    assert (tally.duplicate_rows, tally.outcomes[INVALID_ROW]) == (1, 1)
    assert state.outcomes["bf/bad"] == INVALID_ROW  # journaled, so a resume does not re-plan it
    assert load_state(tmp_path / "o.jsonl").outcomes == {"bf/bad": INVALID_ROW}


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
