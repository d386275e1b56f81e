"""The host-side engine script (orchestrator/host/remote/engine.py) on folders made here: what counts
as a built venv, and what its removal refuses to touch."""

from __future__ import annotations

import importlib.util
import json
import os

from orchestrator.config.engine import lock_of
from orchestrator.config.manifest import Engine
from orchestrator.paths import package_file

spec = importlib.util.spec_from_file_location("engine_script", package_file("host", "remote", "engine.py"))
script = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
spec.loader.exec_module(script)  # type: ignore[union-attr]

LOCK = lock_of(Engine(vllm="0.33.0", torch="2.13.0+cu130"))


def args(root) -> dict:
    return {"root": str(root), "lock": LOCK.as_dict()}


def test_the_script_hashes_a_lock_as_the_controller_does():
    assert script.lock_hash(LOCK.as_dict()) == LOCK.hash


def test_missing_partial_mismatch_and_a_link_are_told_apart(tmp_path):
    root = tmp_path / "engines"
    root.mkdir()
    assert script.check(args(root))["state"] == "missing"
    venv = root / LOCK.name
    venv.mkdir()
    assert script.check(args(root))["state"] == "partial"          # no marker: a build cut short
    other = lock_of(Engine(vllm="0.24.0"))
    (venv / script.MARKER).write_text(json.dumps({"hash": other.hash, "lock": {
        "python": other.python, "requirements": list(other.requirements)}}))
    assert script.check(args(root))["state"] == "mismatch"
    (venv / script.MARKER).write_text(json.dumps({"hash": LOCK.hash, "lock": {
        "python": LOCK.python, "requirements": list(LOCK.requirements)}}))
    broken = script.check(args(root))                                 # its marker is right, it does not run
    assert broken["state"] == "broken" and "does not run" in broken["detail"]
    forged = dict(LOCK.as_dict(), hash="0" * 16)
    assert script.check({"root": str(root), "lock": forged})["state"] == "mismatch"
    os.rename(venv, tmp_path / "elsewhere")
    venv.symlink_to(tmp_path / "elsewhere")
    assert script.check(args(root))["state"] == "broken"            # a link is no venv vllm-orch built


def test_remove_and_list_touch_only_engine_venv_folders_under_the_root(tmp_path):
    root = tmp_path / "engines"
    root.mkdir()
    keep = tmp_path / "precious"
    keep.mkdir()
    (root / LOCK.name).symlink_to(keep)
    (root / "not-an-engine").mkdir()
    (root / f"vllm-0.24.0-{'a' * 16}").mkdir()
    assert script.remove({"root": str(root), "name": LOCK.name})["removed"] is False
    assert script.remove({"root": str(root), "name": "not-an-engine"})["removed"] is False
    assert script.remove({"root": str(root), "name": f"../{keep.name}"})["removed"] is False
    assert keep.is_dir() and (root / "not-an-engine").is_dir()
    listed = script.listing({"root": str(root)})["engines"]
    assert [e["name"] for e in listed] == [f"vllm-0.24.0-{'a' * 16}"] and listed[0]["complete"] is False
    assert script.remove({"root": str(root), "name": f"vllm-0.24.0-{'a' * 16}"})["removed"] is True
