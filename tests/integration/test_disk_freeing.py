"""Only our files, on the SIMULATED host: a deploy that must free disk deletes only model folders
vllm-orch made, never someone else's folder under models_root, and asks first: without a terminal
it is refused unless --yes. gc keeps the same folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from orchestrator.ops.stop import stop_model

from .deployhelp import deploy, entry, on_port, write_models

REPO = Path(__file__).resolve().parents[2]


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=180, stdin=subprocess.DEVNULL, cwd=str(REPO))


def test_deploy_deletes_only_our_folders_and_asks_first(sim_host, tmp_path):
    e = entry(sim_host)
    small, big = on_port("minimax-m25"), on_port("kimi-k25-int4")
    assert deploy(e, small).ok
    stop_model(sim_host.host, e, small.name)
    models_root = sim_host.dir / "models"
    ours = models_root / small.name
    assert json.loads((ours / ".vllm-orch" / "verified.json").read_text())["complete"]
    # Someone else's folder under models_root: older and bigger than ours, so the least recently used.
    theirs = models_root / "alice-experiments"
    theirs.mkdir()
    (theirs / "checkpoint.bin").write_bytes(os.urandom(40 << 20))
    os.utime(theirs, (1, 1))
    # A budget that Kimi fits in only once minimax's folder is gone (alice's is not counted: not ours).
    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"simb": {**sim_host.entry, "models_disk_budget_gib": 0.07}}}))
    models = write_models(tmp_path / "models", [small, big])
    env = dict(os.environ, VLLM_ORCH_STATE_HOME=str(sim_host.home.parent), VLLM_ORCH_MODELS=str(models),
               VLLM_ORCH_INVENTORY=str(inventory))

    dry = cli(env, "deploy", big.name, "--host", "simb", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "asks before deleting (--yes accepts)" in dry.stdout and f"delete {small.name}" in dry.stdout
    assert "kept alice-experiments: not made by vllm-orch" in dry.stdout

    refused = cli(env, "deploy", big.name, "--host", "simb")           # no terminal, no --yes
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "needs confirmation" in refused.stderr and "--yes" in refused.stderr
    assert ours.is_dir() and theirs.is_dir()                           # nothing deleted

    done = cli(env, "deploy", big.name, "--host", "simb", "--yes", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert not ours.exists() and (theirs / "checkpoint.bin").stat().st_size == 40 << 20

    gc = cli(env, "gc", "--host", "simb", "--yes", "--json")
    assert gc.returncode == 0, gc.stdout + gc.stderr
    out = json.loads(gc.stdout)
    assert ["alice-experiments", "not made by vllm-orch (no .vllm-orch/verified.json), never deleted"] in out["keep"]
    assert theirs.is_dir()


def test_an_interrupted_first_download_still_marks_the_folder_as_ours(hub_mirror, tmp_path):
    """The download script writes its record before the first shard, so a folder whose very first
    download was cut short is still recognised as vllm-orch's (and gc may free it)."""
    script = REPO / "orchestrator" / "host" / "remote" / "download.py"
    dest = tmp_path / "tiny"
    hub_mirror.add_fault("hub-drop", None)
    proc = subprocess.run([sys.executable, str(script), "--repo", "vllm-orch-sim/tiny-random-3shard", "--revision",
                           "main", "--local-dir", str(dest), "--workers", "1", "--retries", "0", "--allow",
                           "*.safetensors"], capture_output=True, text=True, env=hub_mirror.env(), timeout=120)
    assert proc.returncode == 1 and '"kind":"network"' in proc.stdout, proc.stdout + proc.stderr
    assert '"event":"file"' not in proc.stdout                          # not one file finished
    record = json.loads((dest / ".vllm-orch" / "verified.json").read_text())
    assert record["repo"] == "vllm-orch-sim/tiny-random-3shard" and record["files"] == {}
    assert record["complete"] is False
