"""Render every setting as a Markdown table: docs/configuration.md's reference comes from here
(`mmworker config --reference`; scripts/refresh-docs.py writes it there)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from mmworker.config import WorkerConfig


def _default(info: FieldInfo) -> str:
    extra = info.json_schema_extra
    if isinstance(extra, dict) and "default_doc" in extra:
        return f"{extra['default_doc']} (computed)"
    if info.default_factory is not None:
        try:
            value: Any = info.default_factory()  # type: ignore[call-arg]
        except TypeError:
            return "(computed)"
        if isinstance(value, BaseModel):
            return "(section)"
    else:
        value = info.default
    return f"`{value!s}`" if value is not None else "unset"


def render_reference() -> str:
    lines = [
        "| setting | environment variable | default | description |",
        "|---|---|---|---|",
    ]
    for name, info in WorkerConfig.model_fields.items():
        section = info.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            for sub, sub_info in section.model_fields.items():
                env = f"MMWORKER_{name.upper()}__{sub.upper()}"
                desc = (sub_info.description or "").replace("|", "\\|")
                lines.append(f"| `{name}.{sub}` | `{env}` | {_default(sub_info)} | {desc} |")
        else:
            desc = (info.description or "").replace("|", "\\|")
            lines.append(f"| `{name}` | `MMWORKER_{name.upper()}` | {_default(info)} | {desc} |")
    return "\n".join(lines)
