"""Raw Kafka value → `Job`, with the failure classified the way the dead-letter record needs it."""

from __future__ import annotations

import json

from pydantic import ValidationError

from mmworker_schemas.errors import InvalidJson, InvalidSchema, UnsupportedVersion
from mmworker_schemas.job import JOB_ID_MAX_LENGTH, Job
from mmworker_schemas.version import SCHEMA_MAJOR, major_of


def parse_job(raw: bytes | None) -> Job:
    """Decode and validate one message.

    The major version is checked before the schema so that a message from a newer major is reported
    as `unsupported_version` (replayable by a newer worker) rather than as `invalid_schema`.
    """
    if raw is None:
        raise InvalidJson("message has no value (tombstone)")
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidJson(f"message is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidJson(f"message is JSON {type(doc).__name__}, not an object")
    job_id = _salvaged_job_id(doc.get("job_id"))
    version = doc.get("schema_version", f"{SCHEMA_MAJOR}.0")
    major = major_of(version)
    if major is None:
        raise InvalidSchema(f"schema_version {version!r} is not 'MAJOR.MINOR'", job_id=job_id)
    if major != SCHEMA_MAJOR:
        raise UnsupportedVersion(
            f"schema_version {version} has major {major}; this worker reads major {SCHEMA_MAJOR}",
            job_id=job_id,
        )
    try:
        return Job.model_validate_json(raw)
    except ValidationError as exc:
        raise InvalidSchema(_summarise(exc), job_id=job_id) from None


def _salvaged_job_id(value: object) -> str | None:
    """The job id of a message that fails validation, if it is one a Failure can carry.

    It becomes the dead-letter record's key and a field of its JSON: a 900 KB id or one with a
    lone surrogate (valid to `json.loads`, unencodable as UTF-8) would make that record
    unpublishable and stall the partition, so such an id is dropped, not copied.
    """
    if not isinstance(value, str) or not 1 <= len(value) <= JOB_ID_MAX_LENGTH:
        return None
    if any(ord(c) < 0x20 for c in value):
        return None
    try:
        value.encode()
    except UnicodeEncodeError:
        return None
    return value


def _summarise(exc: ValidationError) -> str:
    """One line per problem, location first: what a producer needs to fix the message."""
    parts = []
    for err in exc.errors(include_url=False)[:10]:
        loc = ".".join(str(p) for p in err["loc"]) or "<message>"
        parts.append(f"{loc}: {err['msg']}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
