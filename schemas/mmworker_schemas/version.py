"""Wire-format versioning.

Rule (also in docs/jobs.md): `schema_version` is "MAJOR.MINOR". A worker accepts every minor of its
own major and ignores fields it does not know, so producers may upgrade first within a major.
A different major is refused with `unsupported_version` before any other validation, so a v2
message is never half-understood by a v1 worker.
"""

from __future__ import annotations

from typing import Final

SCHEMA_MAJOR: Final = 1
SCHEMA_MINOR: Final = 5
SCHEMA_VERSION: Final = f"{SCHEMA_MAJOR}.{SCHEMA_MINOR}"
#: Pattern every message's version must match; the major is pinned so JSON Schema users see it too.
VERSION_PATTERN: Final = rf"^{SCHEMA_MAJOR}\.\d+$"


def major_of(version: object) -> int | None:
    """Return the major of a "MAJOR.MINOR" string, or None when it is not one."""
    if not isinstance(version, str):
        return None
    head, _, tail = version.partition(".")
    # ASCII digits only: "²".isdigit() holds and int("²") raises, which ended as internal_error
    if not _digits(head) or not _digits(tail):
        return None
    return int(head)


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()
