"""Write the JSON Schemas of the wire messages into schemas/mmworker_schemas/json/ (committed,
checked by a test).

Run: `python -m mmworker_schemas.export` after changing a model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import BaseModel

from mmworker_schemas.failure import Failure
from mmworker_schemas.job import Job
from mmworker_schemas.result import Result

MODELS: dict[str, type[BaseModel]] = {"job": Job, "result": Result, "failure": Failure}
JSON_DIR = Path(__file__).parent / "json"


def render(model: type[BaseModel]) -> str:
    return json.dumps(model.model_json_schema(mode="validation"), indent=2, sort_keys=True) + "\n"


def main() -> int:
    JSON_DIR.mkdir(exist_ok=True)
    for name, model in MODELS.items():
        (JSON_DIR / f"{name}.schema.json").write_text(render(model))
    print(f"wrote {len(MODELS)} schemas to {JSON_DIR}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
