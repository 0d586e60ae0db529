"""`--set KEY=VALUE`: what an item means, for `mmworker` and for the bench scripts alike.

The bench scripts hand their `--set` items to the worker and read them for their own peers
(plain engines given the same settings); if they read an item otherwise than the worker does,
a benchmark compares a worker and a peer configured differently without saying so.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from mmworker.errors import ConfigError


def parse_set(item: str) -> tuple[str, Any]:
    """The dotted key and the value of one item. The value is read as JSON so that numbers,
    lists and null are typed; text that is not JSON is taken as it is (a topic name needs no
    quotes), and `none` is None. An item without `=` is refused: taking it as a key with an
    empty value would set a setting nobody asked to change."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        example = "e.g. --set limits.max_in_flight=64"
        raise ConfigError(f"--set needs KEY=VALUE, got {item!r}: {example}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = None if raw.strip().lower() == "none" else raw
    return key.strip(), value


def parse_sets(items: Iterable[str]) -> dict[str, Any]:
    """Every item, by dotted key; a key given twice keeps its last value, as the worker does."""
    return dict(parse_set(item) for item in items)
