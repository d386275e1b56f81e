"""The tree recipe: which Debian mirror this machine's apt uses, and a stable cache key."""

from __future__ import annotations

import pytest

from orchestrator.sim import nspawn, nspawn_tree


def test_mirror_from_deb822_sources(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\n"
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n")
    assert nspawn_tree.debian_mirror(tmp_path) == "http://mirror.example/debian"


def test_mirror_from_one_line_sources_list(tmp_path):
    (tmp_path / "sources.list").write_text(
        "# comment\ndeb [arch=amd64] http://ftp.example/debian bookworm main\n")
    assert nspawn_tree.debian_mirror(tmp_path) == "http://ftp.example/debian"


def test_mirror_default_when_nothing_matches(tmp_path):
    assert nspawn_tree.debian_mirror(tmp_path) == "http://deb.debian.org/debian"


def test_recipe_hash_is_stable_and_changes_with_the_recipe():
    r = nspawn_tree.recipe("http://m/debian")
    assert nspawn_tree.recipe_hash(r) == nspawn_tree.recipe_hash(dict(r))
    assert nspawn_tree.recipe_hash({**r, "packages": r["packages"] + ["curl"]}) != \
        nspawn_tree.recipe_hash(r)


def test_addresses_and_names():
    assert nspawn.addresses(7) == ("10.200.7.1", "10.200.7.2")
    assert len("vorch254c") <= 15                      # kernel limit on interface names
    with pytest.raises(ValueError):
        nspawn.addresses(255)
