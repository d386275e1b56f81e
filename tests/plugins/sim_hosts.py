"""Fixtures: see tests/conftest.py."""


# -- hub_mirror (helper B): a real SIMULATED Hub mirror process per test -------------------------------
import json as _json
import os as _os
import subprocess as _subprocess
import sys as _sys
import time as _time
from dataclasses import dataclass as _dataclass
from pathlib import Path as _Path

import pytest as _pytest


@_dataclass
class HubMirror:
    """A running `python -m orchestrator.sim.hub` (its own host folder, faults and request log)."""

    hostdir: _Path
    port: int
    proc: _subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a client process: HF_ENDPOINT at the mirror, no telemetry, a private HF_HOME."""
        env = {k: v for k, v in _os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
        env.update(HF_ENDPOINT=self.url, HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
                   HF_HOME=str(self.hostdir / "hf-home"), **extra)
        return env

    def add_fault(self, fault: str, model: str | None = None, **extra) -> None:
        from orchestrator.sim.fault_file import add_fault
        add_fault(self.hostdir, fault, model, **extra)

    def requests(self) -> list[dict]:
        """Every request served so far (the mirror's JSON-lines log)."""
        log = self.hostdir / "hub-requests.jsonl"
        if not log.exists():
            return []
        return [_json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def start_hub_mirror(hostdir: _Path, *args: str, timeout: float = 10.0) -> HubMirror:
    hostdir.mkdir(parents=True, exist_ok=True)
    proc = _subprocess.Popen([_sys.executable, "-m", "orchestrator.sim.hub", "--host-dir", str(hostdir),
                              "--port", "0", "--bind", "127.0.0.1", *args],
                             cwd=str(_Path(__file__).resolve().parents[2]),
                             stdout=_subprocess.DEVNULL, stderr=open(hostdir / "hub.stderr", "wb"))
    port_file = hostdir / "hub.port"
    deadline = _time.monotonic() + timeout
    while not port_file.exists():
        if proc.poll() is not None or _time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"hub mirror did not start: {(hostdir / 'hub.stderr').read_text()[-500:]}")
        _time.sleep(0.02)
    return HubMirror(hostdir, int(port_file.read_text()), proc)


def stop_hub_mirror(mirror: HubMirror) -> None:
    mirror.proc.terminate()
    try:
        mirror.proc.wait(10)
    except _subprocess.TimeoutExpired:
        mirror.proc.kill()
        mirror.proc.wait()


@_pytest.fixture
def hub_mirror(tmp_path):
    """A SIMULATED Hub mirror on 127.0.0.1 (scale 10000) with `vllm-orch-sim/tiny-random-3shard`,
    the gated `vllm-orch-sim/gated-tiny` and the shipped models' repos. Stopped after the test."""
    mirror = start_hub_mirror(tmp_path / "hub-host")
    yield mirror
    stop_hub_mirror(mirror)
