"""The engine check's recorded verdict on a REAL vLLM (vLLM's CPU build, the real_vllm cache): the
first check runs the full verify (the pins, `import vllm`, `vllm --version`: tens of seconds of CPU),
the next trusts its verdict (stats only: the real venv's files, __pycache__ folders included, do not
move between two checks), and --verify-engine verifies again. The engine venv stands at its content
address under engines_root as a real folder whose entries link to the cached venv (the check refuses
a venv folder that is itself a link). Figures: benchmarks/bench_engines.py --real-venv."""

from __future__ import annotations

import json
import os
from pathlib import Path

from orchestrator.config.engine import Lock, lock_of
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Engine
from orchestrator.host import engine
from orchestrator.host.local import LocalHost


def linked_engine(tmp: Path, venv: Path, version: str) -> tuple[HostEntry, Lock]:
    """An engines_root under tmp holding the cached real venv as the engine venv of a lock pinning
    vLLM `version` (with Python 3.11, the cached venv's), marked built."""
    lock = lock_of(Engine(vllm=version.split("+")[0], python="3.11"))
    root = tmp / "engines"
    folder = root / lock.name
    folder.mkdir(parents=True)
    for item in venv.iterdir():
        (folder / item.name).symlink_to(item)
    (folder / "vllm-orch-engine.json").write_text(json.dumps({
        "hash": lock.hash, "lock": {"python": lock.python, "requirements": list(lock.requirements)},
        "vllm_version": version}))
    # service_user root: the cached venv lives under /root (0700); the checks' drop to an unprivileged
    # service user is tests/integration/test_engine_least_privilege.py's
    entry = HostEntry(name="h", address="local", service_manager="process", engines_root=str(root),
                      service_user="root", python=os.sys.executable, models_root=str(tmp / "models"),
                      units_dir=str(tmp / "units"), state_dir=str(tmp / "state"))
    return entry, lock


def test_a_real_venvs_verdict_is_trusted_until_forced(real_vllm, tmp_path):
    entry, lock = linked_engine(tmp_path, Path(real_vllm["venv"]), real_vllm["version"])
    host = LocalHost("h")
    first = engine.check(host, entry, lock)
    assert first.ok and first.verified == "now", first
    assert first.vllm_version is not None and first.vllm_version.split("+")[0] == lock.vllm_version
    assert first.verify_seconds is not None and first.verify_seconds > 0
    second = engine.check(host, entry, lock)
    assert second.ok and second.verified == "earlier", second           # the real venv did not move
    assert second.vllm_version == first.vllm_version
    forced = engine.check(host, entry, lock, force=True)
    assert forced.ok and forced.verified == "now" and forced.why_verified == "--verify-engine", forced
    assert engine.check(host, entry, lock).verified == "earlier"
