"""Every command that changes a host has --dry-run, and with it the host is left exactly as it was:
no file under the host's folders created, changed or removed, the running service untouched."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from orchestrator.probe.api import Endpoint, health
from tests.integration.deployhelp import cli_env, deploy, entry, on_port, write_models
from tests.unit.test_cli import HOST_CHANGING


def snapshot(root: Path) -> dict[str, str]:
    """path -> sha256 of every file of the host's folder. Left aside: the service's logs (a running
    server may write at any moment) and the SIMULATED Hub mirror's own files (hub-*: the mirror
    logs the metadata requests a plan makes; it stands for huggingface.co, not for the host).
    Content, not mtime: the host-side helper scripts are uploaded again, unchanged, on each run."""
    out = {}
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if p.is_file() and "logs" not in rel.parts and not rel.name.startswith("hub-"):
            out[str(rel)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def test_dry_run_changes_nothing_on_the_host(sim_host, tmp_path):
    kimi, minimax = on_port("kimi-k25-int4"), on_port("minimax-m25")
    e = entry(sim_host)
    assert deploy(e, kimi).ok
    # something for each dry run to find: an inactive folder for gc, a changed manifest for regen
    old = sim_host.dir / "models" / "old-model"
    (old / ".vllm-orch").mkdir(parents=True)
    (old / ".vllm-orch" / "verified.json").write_text('{"repo": "a/b", "files": {}, "complete": true}')
    (old / "model.safetensors").write_bytes(b"\0" * 1024)
    changed = kimi.model_copy(update={"env": {**kimi.env, "VLLM_ORCH_TEST_CHANGED": "1"}})
    models = write_models(tmp_path / "models", [changed, minimax])
    env = cli_env(sim_host, models)
    server_record = (Path(e.state_dir) / "run" / f"vllm-{kimi.name}.pid").read_text().strip()
    server_pid = server_record.split()[0]
    before = snapshot(sim_host.dir)

    def run(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args, "--host", "sim", "--dry-run"],
                           env={**env, "COLUMNS": "200"}, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (args, r.stdout, r.stderr)
        return r.stdout

    outputs = {
        "deploy": run("deploy", kimi.name),
        "swap": run("swap", minimax.name),
        "regen": run("regen"),
        "stop": run("stop", kimi.name),
        "gc": run("gc"),
    }
    assert set(outputs) == set(HOST_CHANGING)
    assert "VLLM_ORCH_TEST_CHANGED" in outputs["regen"]                  # the diff is shown...
    assert "stop the service (running, PID" in outputs["stop"] and "services/kimi-k25-int4.json" in outputs["stop"]
    assert "old-model" in outputs["gc"]
    assert snapshot(sim_host.dir) == before                                # ...and nothing is written
    assert (Path(e.state_dir) / "run" / f"vllm-{kimi.name}.pid").read_text().strip() == server_record
    os.kill(int(server_pid), 0)                                            # the service still runs
    assert health(Endpoint(sim_host.host, kimi.serving.port)) == 200
    assert old.is_dir()
