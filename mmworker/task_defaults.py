"""The tasks every worker ships with: what downstream services asked for most, as plain data.

A deployment adds or replaces tasks by name in its config (`[tasks.NAME]`); these stay unless
replaced. Every schema keeps to what xgrammar enforces (no `uniqueItems`, no `pattern` together
with a length bound: vLLM refuses those rather than ignore them) and bounds every string, number
and array, so no answer is endless; `max_tokens` is sized for what a real model writes, and an
answer cut at it is `incomplete_output`, never a result.
"""

from __future__ import annotations

from typing import Any

from mmworker_schemas.job import DEFAULT_PROMPTS

_JSON = " Answer with JSON only."


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _string(max_length: int, min_length: int = 1) -> dict[str, Any]:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def _schema(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "schema": _object(properties)}


_COUNT = {"type": "integer", "minimum": 1, "maximum": 9999}
SAFETY_CATEGORIES = ("sexual", "violence", "gore", "weapons", "drugs", "hate", "self_harm")

#: Raw config data (validated into `TaskConfig`s by the config): `{media}` in a prompt becomes
#: "image", "video" or "images and videos", from the sniffed kinds.
DEFAULT_TASKS: dict[str, dict[str, Any]] = {
    "caption": {
        "description": "Free-text caption (what a job without a task gets)",
        "prompt": dict(DEFAULT_PROMPTS),
    },
    "tags": {
        "description": "Up to 10 short tags",
        "prompt": "List up to 10 short tags (one to three words each) for the main subjects, "
        "setting and style of this {media}." + _JSON,
        "response_format": _schema(
            {"tags": {"type": "array", "items": _string(40), "minItems": 1, "maxItems": 10}}
        ),
        "max_tokens": 192,
    },
    "summary": {
        "description": "A title and a one- or two-sentence description",
        "prompt": "Give this {media} a short title and a one- or two-sentence description." + _JSON,
        "response_format": _schema({"title": _string(80), "description": _string(400)}),
        "max_tokens": 256,
    },
    "objects": {
        "description": "Kinds of objects with how many of each",
        "prompt": "List the kinds of objects visible in this {media} and how many of each there "
        "are." + _JSON,
        "response_format": _schema(
            {
                "objects": {
                    "type": "array",
                    "items": _object({"name": _string(40), "count": _COUNT}),
                    "maxItems": 20,
                }
            }
        ),
        "max_tokens": 384,
    },
    "ocr": {
        "description": "On-screen text, one entry per line, in reading order",
        "prompt": "Transcribe all text visible in this {media}, one entry per line, in reading "
        "order; an empty list if there is none." + _JSON,
        "response_format": _schema(
            {"lines": {"type": "array", "items": _string(200), "maxItems": 50}}
        ),
        "max_tokens": 1024,
    },
    "safety": {
        "description": "A safety flag and the categories that apply",
        "prompt": "Would this {media} be unsuitable for a general audience? Say so, and name the "
        "categories that apply (none if it is suitable)." + _JSON,
        "response_format": _schema(
            {
                "unsafe": {"type": "boolean"},
                "categories": {
                    "type": "array",
                    "items": {"enum": list(SAFETY_CATEGORIES)},
                    "maxItems": len(SAFETY_CATEGORIES),
                },
            }
        ),
        "max_tokens": 96,
    },
}
