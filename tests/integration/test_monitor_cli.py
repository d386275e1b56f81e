"""`vllm-orch monitor` on a SIMULATED host serving a keyed service with a TTFT objective: the
service's labels come from the host's records, the key reaches only its 0600 file (from the
environment; without it exit 2 naming the service, nothing written), the objective becomes its own
alert, and the real promtool passes the written rule tests; a hostile --state-target is exit 2."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys

import pytest
import yaml

from .deployhelp import cli_env, deploy, entry, tuned, write_models

KEY = "sk-monitor-cli-8a2e"


def run(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=180)


def test_monitor_of_a_keyed_service_with_an_objective(sim_host, tmp_path, monkeypatch):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: install Debian's `prometheus` package (`./dev test` installs it)")
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    m = tuned("minimax-m25", serving={"secret_env": ["VLLM_API_KEY"]}, performance={"slo_ttft_p95_seconds": 1.5})
    assert deploy(entry(sim_host), m).ok
    env = cli_env(sim_host, write_models(tmp_path / "models", [m]))
    out = tmp_path / "monitoring"

    without = run({k: v for k, v in env.items() if k != "VLLM_API_KEY"}, "monitor", "--host", "sim", "--out", str(out))
    assert without.returncode == 2, without.stdout + without.stderr
    assert f"{m.name} on sim" in without.stderr and "VLLM_API_KEY" in without.stderr, without.stderr
    assert not (out / "prometheus.yml").exists()

    bad = run(env, "monitor", "--host", "sim", "--out", str(out), "--state-target", "x:1; rm -rf /")
    assert bad.returncode == 2 and "is not HOST:PORT" in bad.stderr, bad.stdout + bad.stderr

    made = run(env, "monitor", "--host", "sim", "--out", str(out))
    assert made.returncode == 0, made.stdout + made.stderr
    [group] = json.loads((out / "targets" / "vllm-keyed.json").read_text())
    assert json.loads((out / "targets" / "vllm.json").read_text()) == []
    assert group == {"targets": [f"127.0.0.1:{m.serving.port}"],
                     "labels": {"host": "sim", "service": m.name, "model": m.name, "served_name": m.served_name,
                                "gpus": "0,1,2,3", "node_role": "single", "vllm_version": "0.33.0"}}
    key_file = out / "secrets" / "vllm-api-key"
    assert key_file.read_text() == KEY and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert [p for p in out.rglob("*") if p.is_file() and KEY in p.read_text()] == [key_file]
    rules = yaml.safe_load((out / "rules" / "vllm-orch.rules.yml").read_text())
    slo = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "VllmTtftSlo"]
    assert [r["expr"] for r in slo] == [f'vllm_orch:ttft_seconds:p95{{host="sim", service="{m.name}"}} > 1.5']
    tested = subprocess.run([promtool, "test", "rules", str(out / "rules" / "vllm-orch.rules.test.yml")],
                            capture_output=True, text=True, timeout=120)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    checked = subprocess.run([promtool, "check", "config", str(out / "prometheus.yml")], capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    # no manifest for it here: still a target (unkeyed, no objective), and said so
    bare = run(cli_env(sim_host, write_models(tmp_path / "none", [])), "monitor", "--host", "sim",
               "--out", str(tmp_path / "bare"))
    assert bare.returncode == 0, bare.stdout + bare.stderr
    assert f"{m.name}: its manifest could not be read" in bare.stdout, bare.stdout
    assert [g["labels"]["service"] for g in json.loads((tmp_path / "bare" / "targets" / "vllm.json").read_text())] \
        == [m.name]
