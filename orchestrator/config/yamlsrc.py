"""Loading YAML files with enough position information to point errors at file:line."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (YAML silently keeps the last one)."""


def _construct_mapping(loader, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


class YamlDoc:
    """A parsed YAML document plus its node tree, to find the line of a field path."""

    def __init__(self, path: Path, display: str):
        self.path = path
        self.display = display
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"{display}: cannot read: {exc.strerror or exc}") from None
        try:
            self.node = yaml.compose(text, Loader=_UniqueKeyLoader)
            self.data = yaml.load(text, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{display}:{mark.line + 1}" if mark else display
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError(f"{where}: not valid YAML: {problem}") from None

    def line_of(self, loc: Sequence[Any]) -> int | None:
        """1-based line of the deepest node on the path that exists."""
        node, line = self.node, None
        if node is None:
            return None
        line = node.start_mark.line + 1
        for part in loc:
            if isinstance(node, yaml.MappingNode):
                for k, v in node.value:
                    if k.value == str(part):
                        node, line = v, k.start_mark.line + 1
                        break
                else:
                    return line
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
                node = node.value[part]
                line = node.start_mark.line + 1
            else:
                return line
        return line


def display_path(path: Path) -> str:
    """Path as the user would type it: relative to the cwd when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def format_loc(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out
