"""The configured tasks of test_structured_e2e.py, in a module of their own: the session's shared
worker (the `service` fixture in conftest.py) is started with them, before that test runs.

The schemas bound every answer (enums, small integers, maxItems) to fewer characters than
`max_tokens`, so guided decoding always closes them in time.
"""

from __future__ import annotations

SCENE = {  # nested objects; the longest answer is 88 characters
    "type": "object",
    "properties": {
        "place": {"enum": ["indoors", "outdoors", "underwater", "space"]},
        "light": {
            "type": "object",
            "properties": {
                "level": {"type": "integer", "minimum": 0, "maximum": 9},
                "natural": {"type": "boolean"},
            },
            "required": ["level", "natural"],
            "additionalProperties": False,
        },
        "people": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["place", "light", "people"],
    "additionalProperties": False,
}
LABELS = {  # an array of enums; the longest answer is 49 characters
    "type": "object",
    "properties": {
        "labels": {
            "type": "array",
            "items": {"enum": ["cat", "dog", "car", "tree", "person", "sky"]},
            "minItems": 1,
            "maxItems": 4,
        }
    },
    "required": ["labels"],
    "additionalProperties": False,
}
CODE = r"[A-Z]{3}-[0-9]{2,4}"
MAX_TOKENS = 96
TASKS = {
    "scene": {"prompt": "Describe the scene of this {media}.", "max_tokens": MAX_TOKENS,
              "response_format": {"type": "json_schema", "schema": SCENE}},
    "labels": {"prompt": "Label this {media}.", "max_tokens": MAX_TOKENS,
               "response_format": {"type": "json_schema", "schema": LABELS}},
    "code": {"prompt": "Read the product code in this {media}.", "max_tokens": MAX_TOKENS,
             "response_format": {"type": "regex", "regex": CODE}},
}  # fmt: skip
