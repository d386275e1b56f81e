"""docs/manifest-reference.md, generated from the pydantic field descriptions (a test keeps it in
sync): `python -m orchestrator.devtools.docgen > docs/manifest-reference.md`."""

from __future__ import annotations

import json
import re
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from orchestrator.config.inventory import HostEntry, Inventory
from orchestrator.config.manifest import Manifest


def _type(ann) -> str:
    text = str(ann) if not isinstance(ann, type) else ann.__name__
    text = re.sub(r"orchestrator(\.\w+)*\.(?=\w)", "", text)      # Performance, not orchestrator.config...
    return text.replace("typing.", "").replace("NoneType", "None")


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section)"
        return f"`{json.dumps(value)}`"
    if field.default is PydanticUndefined:
        return "**required**"
    return f"`{json.dumps(field.default)}`"


def _mapped_model(ann) -> type[BaseModel] | None:
    """The value model of a `dict[str, Model]` field (requires.hardware, a host's overrides)."""
    args = typing.get_args(ann)
    if typing.get_origin(ann) is dict and args and isinstance(args[-1], type) and issubclass(args[-1], BaseModel):
        return args[-1]
    return None


def _optional_model(ann) -> type[BaseModel] | None:
    """The model of a `Model | None` field (multinode, a host's cluster): an optional section."""
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if len(args) == 1 and len(typing.get_args(ann)) == 2 and isinstance(args[0], type) \
            and issubclass(args[0], BaseModel):
        return args[0]
    return None


def _rows(model: type[BaseModel], prefix: str, out: list[str], sections: list) -> None:
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            sections.append((f"{prefix}{name}", ann, field.description))
            out.append(f"| `{prefix}{name}` | section | {_default(field)} | {field.description} |")
            continue
        optional = _optional_model(ann)
        if optional is not None:
            sections.append((f"{prefix}{name}", optional, field.description))
            out.append(f"| `{prefix}{name}` | optional section | (absent) | {field.description} |")
            continue
        mapped = _mapped_model(ann)
        if mapped is not None:
            sections.append((f"{prefix}{name}.<key>", mapped, field.description))
            out.append(f"| `{prefix}{name}` | `{{key: {mapped.__name__}}}` | {_default(field)} | "
                       f"{(field.description or '').replace('|', chr(92) + '|')} |")
            continue
        desc = (field.description or "").replace("|", "\\|")
        out.append(f"| `{prefix}{name}` | `{_type(ann)}` | {_default(field)} | {desc} |")


def _table(model: type[BaseModel], prefix: str) -> tuple[list[str], list]:
    out = ["| field | type | default | description |", "|---|---|---|---|"]
    sections: list = []
    _rows(model, prefix, out, sections)
    return out, sections


def reference() -> str:
    lines = ["# Manifest reference", "",
             "Generated from the field descriptions in `orchestrator/config/manifest.py` and",
             "`orchestrator/config/inventory.py` by `python -m orchestrator.devtools.docgen`; a test fails when this file",
             "is out of date. `models/example.yaml` shows every field in use; `vllm-orch schema` prints",
             "the JSON schema for editors.", "",
             "## Model manifest (`models/NAME.yaml`)", ""]
    top, sections = _table(Manifest, "")
    lines += top
    _sections(sections, lines)
    lines += ["", "## Host inventory (`hosts.yaml`: `hosts: {NAME: entry}`)", "",
              "See `hosts.example.yaml`. A host named `local` with `address: local` is this machine. Every",
              "`*.yaml` of the extra-inventory folder (`hosts.d/` in vllm-orch's state home, see",
              "docs/user-guide.md) is read with the same schema.", ""]
    rows, sections = _table(HostEntry, "")
    lines += rows
    _sections(sections, lines)
    lines += ["", "## Host groups (`hosts.yaml`: `groups: {NAME: [HOST, ...]}`)", "",
              Inventory.model_fields["groups"].description or "", "",
              "Select a group with `--group NAME` on any host command (docs/user-guide.md, \"Fleets\"); a",
              "group, like a host, is defined once across the inventory files."]
    return "\n".join(lines) + "\n"


def _sections(sections: list, lines: list[str]) -> None:
    """Each nested section's table, its own nested sections after it."""
    for path, model, desc in sections:
        lines += ["", f"### `{path}`", "", desc or "", ""]
        rows, nested = _table(model, f"{path}.")
        lines += rows
        _sections(nested, lines)


if __name__ == "__main__":
    print(reference(), end="")
