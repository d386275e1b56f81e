"""A cached virtual environment holding Ray (CPU, from PyPI): a REAL `ray start` for tests.

Why: a multi-node manifest with `multinode.backend: ray` renders `ray start --head ...` on the head and
`ray start --address HEAD:PORT ...` on every worker (render/artifacts.py `ray_argv`). Whether those
flags are Ray's, and whether the nodes form one cluster across hosts, only a real Ray can say; the
test that runs the rendered commands between two routed network namespaces uses this venv.
vLLM's CPU build cannot run on Ray (vllm/v1/executor/ray_utils.py: "current platform cpu does not
support ray"): this venv holds Ray alone, with no vLLM.

Built once per machine and recipe (devtools/cached_venv.py): ~/.cache/vllm-orch/ray-<version>-<hash>/
(about 0.4 GiB, ~1 min). The base interpreter is the system python3 when there is one (as for the
real vLLM's venv), so the venv could also be bound into the Debian test containers.

    python -m orchestrator.devtools.ray_venv          # build if needed, print the ray path
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.devtools import cached_venv
from orchestrator.devtools.cached_venv import BuildError, BuildInfo, cache_root, run
from orchestrator.devtools.real_vllm_venv import base_python

VERSION = "2.60.0"


def recipe() -> dict:
    base = base_python()
    return {"dist": "ray", "version": VERSION, "base_python": base, "layout": 1}


def venv_dir() -> Path:
    return cache_root() / f"ray-{VERSION}-{cached_venv.recipe_hash(recipe())}"


def ray_path(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / "ray"


def _build(venv: Path, log: list[str]) -> dict:
    run([base_python(), "-m", "venv", str(venv)], log)
    t0 = time.monotonic()
    run([str(cached_venv.python_of(venv)), "-m", "pip", "install", "-q", "--prefer-binary", f"ray=={VERSION}"],
        log, cached_venv.pip_env(), timeout=1800)
    install_s = time.monotonic() - t0
    ver = subprocess.run([str(ray_path(venv)), "--version"], capture_output=True, text=True, timeout=300)
    if ver.returncode != 0 or VERSION not in ver.stdout:
        raise BuildError(f"`ray --version` failed (exit {ver.returncode}): {ver.stderr.strip()[-300:]}",
                         ver.stderr, False)
    return {"install_seconds": round(install_s, 1), "ray_version": ver.stdout.strip()}


def ensure_venv(*, rebuild: bool = False) -> BuildInfo:
    return cached_venv.ensure(venv_dir(), recipe(), _build, rebuild=rebuild)


def main(argv: list[str] | None = None) -> int:
    try:
        info = ensure_venv(rebuild=bool(argv and "--rebuild" in argv))
    except BuildError as exc:
        print(f"ray venv: {exc}", file=sys.stderr)
        print(exc.log[-6000:], file=sys.stderr)
        return 1
    print(json.dumps({**info.as_dict(), "ray": str(ray_path())}) if argv and "--info" in argv else ray_path())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
