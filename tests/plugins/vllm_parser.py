"""Fixtures: the REAL vLLM 0.33.0 argument parser in a cached venv, and fake package folders.

  vllm_parser_python   (session) path of the cached venv's python (vllm 0.33.0 --no-deps, torch CPU,
                        the parser's import-time deps). Built once per machine: ~1.5 min cold,
                        instant when cached (orchestrator/devtools/vllm_parser_venv.py).
                        Skips only when the build is impossible (no package index); with CI=true
                        a failed build fails the tests instead.
  fake_site_packages   factory: fake_site_packages({"vllm": "0.33.0", "torch": "2.13.0+cu130"})
                        -> a folder of *.dist-info (METADATA Name/Version) to put on PYTHONPATH,
                        the way simulated hosts fake their packages (orchestrator/sim/manager.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.devtools import vllm_parser_venv as venv_mod

# The first test that needs the venv may have to build it (~1.5 min cold, more on a slow mirror):
# give that test alone a longer timeout than pyproject's 300 s.
BUILD_TIMEOUT = 1800


def pytest_collection_modifyitems(config, items):
    if venv_mod.is_built():
        return
    for item in items:
        if "vllm_parser_python" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(BUILD_TIMEOUT))
            break


@pytest.fixture(scope="session")
def vllm_parser_python() -> Path:
    try:
        info = venv_mod.ensure_venv()
    except venv_mod.BuildError as exc:
        if exc.offline and os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
            pytest.skip(f"cannot build the real vLLM parser venv (no package index reachable): {exc}")
        pytest.fail(f"building the real vLLM parser venv failed: {exc}\n{exc.log[-4000:]}")
    return info.python


def write_dist_info(folder: Path, name: str, version: str) -> Path:
    """A minimal installed-distribution record importlib.metadata reads like a real one."""
    d = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return d


@pytest.fixture
def fake_site_packages(tmp_path):
    def make(versions: dict[str, str], name: str = "site-packages") -> Path:
        folder = tmp_path / name
        folder.mkdir(parents=True, exist_ok=True)
        for pkg, ver in versions.items():
            write_dist_info(folder, pkg, ver)
        return folder
    return make
