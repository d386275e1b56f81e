"""Loading YAML files with enough position information to point errors at file:line.

Manifests and inventories may come from someone else, so a file is refused (exit 2, file:line)
before PyYAML builds anything big or deep: over MAX_BYTES, not UTF-8, a NUL or another control
character, nesting deeper than MAX_DEPTH (PyYAML's composer recurses), more than MAX_NODES nodes
once aliases are expanded (a "billion laughs" file is a few hundred bytes), a key that is a list or
a mapping, a key given twice.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import ConfigError

MAX_BYTES = 1 << 20          # 1 MiB: the largest shipped manifest is ~5 KB
MAX_DEPTH = 64
MAX_NODES = 100_000          # scalars, sequences and mappings, aliases expanded


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (YAML silently keeps the last one)."""


def _construct_mapping(loader, node, deep=False):
    seen: dict[Any, int] = {}          # key -> its line (0-based)
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a key must be a plain value, not a list or a mapping", key_node.start_mark) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


class _FastUniqueKeyLoader(getattr(yaml, "CSafeLoader", _UniqueKeyLoader)):    # type: ignore[misc]
    """The same loader on libyaml's C parser, when PyYAML has it: a CLI start reads every manifest
    and inventory, and the pure-Python parser took ~0.2 s of CPU for the shipped nine. Used only for
    files it parses without error; an error is reported by the pure-Python parser, whose messages and
    positions the refusals are written against."""


_FastUniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


class YamlDoc:
    """A parsed YAML document plus its node tree, to find the line of a field path."""

    def __init__(self, path: Path, display: str):
        self.path = path
        self.display = display
        text = read_text(path, display)
        try:
            try:
                self.node, self.data = _parse(text, display, _FastUniqueKeyLoader)
            except yaml.YAMLError:
                self.node, self.data = _parse(text, display, _UniqueKeyLoader)
        except yaml.reader.ReaderError as exc:     # a control character: no mark, a position
            line = text.count("\n", 0, max(0, exc.position)) + 1
            char = chr(exc.character) if isinstance(exc.character, int) else exc.character
            raise ConfigError(f"{display}:{line}: not valid YAML: control character {char!r} "
                              f"(only printable text is allowed)") from None
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


def _parse(text: str, display: str, loader: type) -> tuple[yaml.Node | None, Any]:
    """The node tree (for line_of) and the data built from it: one parse, after check_shape's walk."""
    check_shape(text, display, loader)
    parser = loader(text)
    try:
        node = parser.get_single_node()
        return node, parser.construct_document(node) if node is not None else None
    finally:
        parser.dispose()


def read_text(path: Path, display: str) -> str:
    """The file as UTF-8 text, refused (file:line) when too big, not UTF-8, or holding a NUL."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > MAX_BYTES:
                raise ConfigError(f"{display}: the file is larger than {MAX_BYTES // 1024} KiB: not a manifest "
                                  f"or an inventory")
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{display}: cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_BYTES:                   # grew while we read, or not a regular file
        raise ConfigError(f"{display}: the file is larger than {MAX_BYTES // 1024} KiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{display}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x})") from None
    nul = text.find("\0")
    if nul >= 0:
        raise ConfigError(f"{display}:{text.count(chr(10), 0, nul) + 1}: not valid YAML: a NUL character")
    return text


def check_shape(text: str, display: str, loader: type = _UniqueKeyLoader) -> None:
    """Walk the event stream (iterative, cheap) and refuse deep nesting and alias expansion bombs
    before the (recursive) composer and the constructor see them."""
    sizes: dict[str, int] = {}                   # anchor -> its node count, aliases expanded
    stack: list[list] = [[None, 0]]              # [anchor, nodes so far] per open collection
    total = 0
    for event in yaml.parse(text, Loader=loader):
        line = event.start_mark.line + 1 if event.start_mark is not None else 0
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            stack.append([event.anchor, 0])
            if len(stack) - 1 > MAX_DEPTH:
                raise ConfigError(f"{display}:{line}: nested more than {MAX_DEPTH} levels deep")
            continue
        if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            anchor, count = stack.pop()
            count += 1
            if anchor:
                sizes[anchor] = count
            stack[-1][1] += count
        elif isinstance(event, yaml.ScalarEvent):
            if event.anchor:
                sizes[event.anchor] = 1
            stack[-1][1] += 1
        elif isinstance(event, yaml.AliasEvent):
            stack[-1][1] += sizes.get(event.anchor or "", 1)
        else:
            continue
        total = sum(frame[1] for frame in stack)
        if total > MAX_NODES:
            raise ConfigError(f"{display}:{line}: more than {MAX_NODES} values after "
                              f"expanding aliases (anchors `&` and aliases `*`)")


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
