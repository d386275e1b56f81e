"""A virtual environment built once per machine and recipe, then reused (shared by the venv builders).

Why: tests and rehearsals need real packages that take minutes to install (vLLM's parser, vLLM's CPU
build). Each builder states a recipe (everything that decides the content); its hash names the folder
under the cache root, so a changed recipe builds a new venv beside the old one.

The build runs under an exclusive file lock (concurrent pytest sessions wait for one build) in the
final folder itself - a venv's scripts record their own path, so it cannot be built elsewhere and
renamed - and the info file `vllm-orch-build.json` is written last, only after the builder's own check
passed: a folder without it is half-built and is removed and built again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

INFO_FILE = "vllm-orch-build.json"

# pip output that means "no package index reachable", as opposed to a broken recipe.
_OFFLINE_MARKERS = ("NewConnectionError", "Network is unreachable", "Temporary failure in name "
                    "resolution", "No matching distribution found", "Could not find a version",
                    "ConnectTimeoutError", "ProxyError", "Max retries exceeded")


def cache_root() -> Path:
    """$VLLM_ORCH_CACHE, else $XDG_CACHE_HOME/vllm-orch, else ~/.cache/vllm-orch."""
    if os.environ.get("VLLM_ORCH_CACHE"):
        return Path(os.environ["VLLM_ORCH_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-orch"


def recipe_hash(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def in_ci() -> bool:
    """CI must fail, not skip, when an environment cannot be built."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@dataclass
class BuildInfo:
    python: Path
    built_now: bool          # False when the cached venv was reused
    seconds: float           # build time (or the recorded one when reused)
    size_bytes: int
    facts: dict = field(default_factory=dict)   # what the builder's check measured
    log: str = ""

    def as_dict(self) -> dict:
        return {"python": str(self.python), "built_now": self.built_now,
                "build_seconds": round(self.seconds, 1), "size_bytes": self.size_bytes,
                "size_gib": round(self.size_bytes / 2**30, 2), **self.facts}


class BuildError(RuntimeError):
    """The venv could not be built. `offline` is True when pip could not reach a package index."""

    def __init__(self, message: str, log: str, offline: bool):
        super().__init__(message)
        self.log = log
        self.offline = offline


def dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def run(cmd: list[str], log: list[str], env: dict | None = None, timeout: float = 1800) -> str:
    """Run one build step, appending its output to `log`; BuildError (offline or not) on failure."""
    log.append("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    log.append(proc.stdout[-4000:] + proc.stderr[-8000:])
    if proc.returncode != 0:
        text = proc.stdout + proc.stderr
        raise BuildError(f"{cmd[2:5]} exited {proc.returncode}: "
                         f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}", "\n".join(log),
                         offline=any(m in text for m in _OFFLINE_MARKERS))
    return proc.stdout


def pip_env() -> dict:
    return {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_built(venv: Path) -> bool:
    return (venv / INFO_FILE).is_file()


def ensure(venv: Path, recipe: dict, build: Callable[[Path, list[str]], dict], *,
           rebuild: bool = False) -> BuildInfo:
    """The venv at `venv`, built by `build(venv, log)` first if it is missing (or `rebuild`).

    `build` creates the venv, installs, checks that it works and returns facts to record (e.g. how
    long the check took); it raises BuildError when anything fails."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    info_file = venv / INFO_FILE
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # another process may be building it right now
        if info_file.is_file() and not rebuild:
            rec = json.loads(info_file.read_text())
            facts = rec.get("facts", {k: v for k, v in rec.items()    # (older records: top level)
                                      if k not in ("recipe", "build_seconds", "size_bytes", "built_at")})
            return BuildInfo(python_of(venv), False, rec["build_seconds"], rec["size_bytes"], facts)
        shutil.rmtree(venv, ignore_errors=True)   # a half-built one (no info file) or a rebuild
        log: list[str] = []
        started = time.monotonic()
        try:
            facts = build(venv, log) or {}
        except BaseException:
            shutil.rmtree(venv, ignore_errors=True)
            raise
        seconds = time.monotonic() - started
        size = dir_size(venv)
        tmp = venv / f".{INFO_FILE}.tmp"
        tmp.write_text(json.dumps({"recipe": recipe, "build_seconds": round(seconds, 1),
                                   "size_bytes": size, "facts": facts, "built_at": time.time()},
                                  indent=1))
        os.replace(tmp, info_file)                # the venv is complete and checked from here on
        return BuildInfo(python_of(venv), True, seconds, size, facts, "\n".join(log))
