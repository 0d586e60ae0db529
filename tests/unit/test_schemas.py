from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest
from mmworker_schemas import (
    SCHEMA_VERSION,
    ErrorCode,
    Failure,
    InvalidJson,
    InvalidSchema,
    Job,
    SourceCoords,
    UnsupportedVersion,
    parse_job,
)
from mmworker_schemas.export import JSON_DIR, MODELS, render


def _job(**over: object) -> bytes:
    doc: dict[str, object] = {"job_id": "j1", "media": [{"uri": "https://example.com/a.jpg"}]}
    doc.update(over)
    return json.dumps(doc).encode()


def test_minimal_job_gets_defaults() -> None:
    job = parse_job(_job())
    assert job.schema_version == SCHEMA_VERSION == "1.5"
    assert job.generation.max_tokens == 128
    assert job.generation.ignore_eos is False
    assert job.instruction(["image"]).startswith("Describe this image")
    assert job.instruction(["video"]).startswith("Describe what happens")


def test_inline_media_is_base64_on_the_wire_and_bytes_in_python() -> None:
    raw = _job(media=[{"data": base64.b64encode(b"\x89PNG...").decode()}])
    job = parse_job(raw)
    assert job.media[0].data == b"\x89PNG..."
    assert (
        json.loads(job.model_dump_json())["media"][0]["data"]
        == base64.b64encode(b"\x89PNG...").decode()
    )


@pytest.mark.parametrize(
    ("raw", "error", "code"),
    [
        (b"not json", InvalidJson, ErrorCode.INVALID_JSON),
        (b"[1, 2]", InvalidJson, ErrorCode.INVALID_JSON),
        (b"\xff\xfe", InvalidJson, ErrorCode.INVALID_JSON),
        (_job(media=[]), InvalidSchema, ErrorCode.INVALID_SCHEMA),
        (_job(media=[{"uri": "ftp://x/y"}]), InvalidSchema, ErrorCode.INVALID_SCHEMA),
        (
            _job(media=[{"uri": "https://a", "data": "AA=="}]),
            InvalidSchema,
            ErrorCode.INVALID_SCHEMA,
        ),
        (_job(schema_version="2.0"), UnsupportedVersion, ErrorCode.UNSUPPORTED_VERSION),
        (_job(schema_version="one"), InvalidSchema, ErrorCode.INVALID_SCHEMA),
        # Unicode digits that int() refuses: were an internal_error with a traceback
        (_job(schema_version="\u00b2.0"), InvalidSchema, ErrorCode.INVALID_SCHEMA),
        (_job(schema_version="1.\u0663"), InvalidSchema, ErrorCode.INVALID_SCHEMA),
        (_job(generation={"max_tokens": 0}), InvalidSchema, ErrorCode.INVALID_SCHEMA),
        (_job(generation={"ignore_eos": "maybe"}), InvalidSchema, ErrorCode.INVALID_SCHEMA),
        (_job(metadata={"blob": "x" * 20000}), InvalidSchema, ErrorCode.INVALID_SCHEMA),
    ],
)
def test_bad_messages_raise_typed_errors(
    raw: bytes, error: type[Exception], code: ErrorCode
) -> None:
    with pytest.raises(error) as info:
        parse_job(raw)
    assert info.value.code == code  # type: ignore[attr-defined]


def test_error_keeps_job_id_when_it_parsed_that_far() -> None:
    with pytest.raises(InvalidSchema) as info:
        parse_job(_job(media=[]))
    assert info.value.job_id == "j1"
    assert "media" in info.value.message


@pytest.mark.parametrize(
    "raw",
    [
        b'{"job_id": "a\\ud800b", "media": []}',  # lone surrogate: json.loads takes it
        json.dumps({"job_id": "x" * 900_000, "media": []}).encode(),
        json.dumps({"job_id": "tab\there", "media": []}).encode(),
        json.dumps({"job_id": "", "media": []}).encode(),
    ],
    ids=["lone-surrogate", "900k-chars", "control-char", "empty"],
)
def test_error_drops_a_job_id_no_failure_record_could_carry(raw: bytes) -> None:
    """The id keys the dead-letter record: an unencodable or huge one makes it unpublishable."""
    with pytest.raises(InvalidSchema) as info:
        parse_job(raw)
    assert info.value.job_id is None
    failure = Failure(
        job_id=info.value.job_id, code=info.value.code, message=info.value.message,
        retryable=False, attempts=1, payload=Failure.bounded_payload(raw)[0],
        source=SourceCoords(topic="t", partition=0, offset=0), worker_id="w",
    )  # fmt: skip
    assert len(failure.model_dump_json().encode()) < 100_000


def test_ignore_eos_is_accepted_and_round_trips() -> None:
    job = parse_job(_job(generation={"max_tokens": 64, "ignore_eos": True}))
    assert job.generation.ignore_eos is True
    assert job.generation.max_tokens == 64
    assert json.loads(job.model_dump_json())["generation"]["ignore_eos"] is True


def test_a_1_0_message_still_parses() -> None:
    job = parse_job(_job(schema_version="1.0", generation={"max_tokens": 32, "seed": 3}))
    assert job.schema_version == "1.0"
    assert job.generation.max_tokens == 32
    assert job.generation.ignore_eos is False


def test_newer_minor_with_unknown_fields_is_accepted() -> None:
    job = parse_job(_job(schema_version="1.7", shiny_new_field={"a": 1}))
    assert job.job_id == "j1"
    assert "shiny_new_field" not in job.model_dump()


def test_failure_payload_round_trips_and_is_bounded() -> None:
    raw = b"\x00\xffbinary" * 20000
    payload, cut = Failure.bounded_payload(raw)
    f = Failure(
        job_id=None, code=ErrorCode.INVALID_JSON, message="m", retryable=False, attempts=1,
        source=SourceCoords(topic="t", partition=0, offset=5), worker_id="w",
        payload=payload, payload_truncated=cut,
    )  # fmt: skip
    back = Failure.model_validate_json(f.model_dump_json())
    assert cut and len(back.payload) == 64 * 1024
    assert back.payload == raw[: 64 * 1024]


def test_committed_json_schemas_are_current() -> None:
    for name, model in MODELS.items():
        path = JSON_DIR / f"{name}.schema.json"
        assert path.read_text() == render(model), (
            f"{path} is stale: run python -m mmworker_schemas.export"
        )


def test_schemas_and_preprocess_import_no_heavy_packages() -> None:
    code = (
        "import sys, mmworker_schemas, mmworker_preprocess.prepare, mmworker_preprocess.fetch;"
        "heavy = [m for m in ('torch', 'vllm', 'kafka', 'transformers') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_job_is_frozen() -> None:
    job = Job.model_validate_json(_job())
    with pytest.raises(ValueError):
        job.job_id = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "options",
    [
        {"image": {"min_pixels": 10**400}},  # OverflowError in smart_resize
        {"image": {"max_pixels": 10**400}},  # OverflowError in the token budget's bound
        {"video": {"max_pixels": 10**400}},
        {"video": {"strategy": "interval", "interval_s": 1e-320}},  # infinite frame count
    ],
)
def test_media_options_the_arithmetic_cannot_take_are_invalid_schema(
    options: dict[str, object],
) -> None:
    """They passed validation and failed in preprocessing as internal_error with a traceback."""
    with pytest.raises(InvalidSchema):
        parse_job(_job(**options))
