"""Rewrite the generated parts of the repository from the code: the configuration reference
(docs/configuration.md) and the JSON Schemas under schemas/mmworker_schemas/json. Tests fail when
either is stale; this fixes it.

Run: .venv/bin/python scripts/refresh-docs.py
"""

from __future__ import annotations

import re
from pathlib import Path

from mmworker_schemas.export import main as export_schemas

from mmworker.config_reference import render_reference

ROOT = Path(__file__).resolve().parents[1]


def refresh_reference() -> None:
    path = ROOT / "docs" / "configuration.md"
    text = path.read_text()
    table = re.compile(r"\| setting \| environment variable \|.*?\n(?=\n)", re.S)
    new, count = table.subn(lambda _m: render_reference().rstrip("\n") + "\n", text, count=1)
    if count != 1:
        raise SystemExit(f"{path}: configuration reference table not found")
    path.write_text(new)


if __name__ == "__main__":
    refresh_reference()
    export_schemas()
    print("refreshed docs/configuration.md's reference and schemas/mmworker_schemas/json")
