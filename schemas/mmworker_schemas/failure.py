"""The dead-letter record: enough to understand a failure and to replay the original message."""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from mmworker_schemas.codes import ErrorCode
from mmworker_schemas.result import SourceCoords
from mmworker_schemas.version import SCHEMA_VERSION

#: The original payload is kept for replay up to this size; larger ones are cut and flagged.
MAX_PAYLOAD_BYTES = 64 * 1024


class Failure(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="ignore", ser_json_bytes="base64", val_json_bytes="base64"
    )

    schema_version: str = SCHEMA_VERSION
    job_id: str | None = Field(description="None when the message could not be parsed that far")
    code: ErrorCode
    message: str
    retryable: bool = Field(description="The cause may go away; replaying later may succeed")
    attempts: int = Field(ge=1)
    source: SourceCoords
    worker_id: str
    payload: bytes = Field(description="The original message value (base64), maybe cut")
    payload_truncated: bool = False
    metadata: dict[str, JsonValue] = Field(default_factory=dict)
    failed_at: datetime = Field(default_factory=lambda: datetime.now(UTC))

    @classmethod
    def bounded_payload(cls, raw: bytes) -> tuple[bytes, bool]:
        """Cut a payload to the replay limit, saying whether anything was dropped."""
        return raw[:MAX_PAYLOAD_BYTES], len(raw) > MAX_PAYLOAD_BYTES
