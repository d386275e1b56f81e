"""config/yamlsrc.py reads a file with libyaml's C parser when PyYAML has it, and reports every
error with the pure-Python parser: both must read the same file to the same data and lines."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchestrator.config import yamlsrc
from orchestrator.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
FILES = sorted([*(REPO / "models").glob("*.yaml"), REPO / "hosts.example.yaml", *(REPO / "tests" / "cases").glob("*.yaml"),
                *(REPO / "tests" / "fixtures").rglob("*.yaml")])


def doc(path: Path, loader) -> yamlsrc.YamlDoc:
    """A YamlDoc read by one loader only."""
    real = yamlsrc._FastUniqueKeyLoader
    yamlsrc._FastUniqueKeyLoader = loader
    try:
        return yamlsrc.YamlDoc(path, path.name)
    finally:
        yamlsrc._FastUniqueKeyLoader = real


def paths(data, prefix=()):
    yield prefix
    if isinstance(data, dict):
        for k, v in data.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from paths(v, (*prefix, i))


@pytest.mark.skipif(not hasattr(yaml, "CSafeLoader"), reason="PyYAML without libyaml: one parser only")
@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_c_parser_reads_what_the_python_parser_reads(path):
    try:
        slow = doc(path, yamlsrc._UniqueKeyLoader)
    except ConfigError as exc:                 # a bad file of the fixtures: refused the same way
        with pytest.raises(ConfigError) as fast_error:
            doc(path, yamlsrc._FastUniqueKeyLoader)
        assert str(fast_error.value) == str(exc)
        return
    fast = doc(path, yamlsrc._FastUniqueKeyLoader)
    assert fast.data == slow.data
    for loc in paths(slow.data):
        assert fast.line_of(loc) == slow.line_of(loc), loc


@pytest.mark.parametrize("text, says", [
    ("source: {repo: a/b\nserving: 1\n", "expected ',' or '}'"),
    ("a: 1\n b: 2\n", ":2: not valid YAML: mapping values are not allowed here"),
    ("a: [1, 2\n", "expected ',' or ']'"),
])
def test_a_syntax_error_is_told_by_the_python_parser(tmp_path, text, says):
    f = tmp_path / "m.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as fast:
        yamlsrc.YamlDoc(f, "m.yaml")
    with pytest.raises(ConfigError) as slow:
        doc(f, yamlsrc._UniqueKeyLoader)
    assert str(fast.value) == str(slow.value) and says in str(fast.value)
