"""`vllm-orch monitor` on a SIMULATED host serving a keyed service with a TTFT objective: the
service's labels come from the host's records; by default the keyed service is scraped like any
other, without a key (the simulated vLLM, like vLLM 0.33, answers /metrics without one), and no file
written holds the key; a scrape credential is opt-in (--scrape-key-file, over --scheme https; plain
http refused with exit 3); the objective becomes its own alert, and the real promtool passes the
written rule tests and config; a hostile --state-target is exit 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request

import pytest
import yaml

from .deployhelp import cli_env, deploy, entry, tuned, write_models

KEY = "sk-monitor-cli-8a2e"
SCRAPE = "sk-scrape-only-5b7d"


def run(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=180)


def holding(folder, *secrets: str) -> list:
    return [p for p in folder.rglob("*") if p.is_file() and any(s in p.read_text() for s in secrets)]


def test_monitor_of_a_keyed_service_with_an_objective(sim_host, tmp_path, monkeypatch):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: install Debian's `prometheus` package (`./dev test` installs it)")
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    m = tuned("minimax-m25", serving={"secret_env": ["VLLM_API_KEY"]}, performance={"slo_ttft_p95_seconds": 1.5})
    assert deploy(entry(sim_host), m).ok
    env = cli_env(sim_host, write_models(tmp_path / "models", [m]))
    out = tmp_path / "monitoring"

    bad = run(env, "monitor", "--host", "sim", "--out", str(out), "--state-target", "x:1; rm -rf /")
    assert bad.returncode == 2 and "is not HOST:PORT" in bad.stderr, bad.stdout + bad.stderr

    made = run(env, "monitor", "--host", "sim", "--out", str(out))
    assert made.returncode == 0, made.stdout + made.stderr
    [group] = json.loads((out / "targets" / "vllm.json").read_text())
    assert json.loads((out / "targets" / "vllm-keyed.json").read_text()) == []
    assert group == {"targets": [f"127.0.0.1:{m.serving.port}"],
                     "labels": {"host": "sim", "service": m.name, "model": m.name, "served_name": m.served_name,
                                "gpus": "0,1,2,3", "node_role": "single", "vllm_version": "0.33.0"}}
    assert not (out / "secrets").exists() and holding(out, KEY, "authorization") == []
    with urllib.request.urlopen(f"http://{group['targets'][0]}/metrics", timeout=30) as r:   # as Prometheus will
        assert r.status == 200 and "vllm:" in r.read().decode()
    rules = yaml.safe_load((out / "rules" / "vllm-orch.rules.yml").read_text())
    slo = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "VllmTtftSlo"]
    assert [r["expr"] for r in slo] == [f'vllm_orch:ttft_seconds:p95{{host="sim", service="{m.name}"}} > 1.5']
    tested = subprocess.run([promtool, "test", "rules", str(out / "rules" / "vllm-orch.rules.test.yml")],
                            capture_output=True, text=True, timeout=120)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    checked = subprocess.run([promtool, "check", "config", str(out / "prometheus.yml")], capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    # opt-in: the operator's own scrape credential, referenced; over plain http only when forced
    scrape = tmp_path / "scrape.key"
    scrape.write_text(SCRAPE)
    scrape.chmod(0o600)
    plain = run(env, "monitor", "--host", "sim", "--out", str(tmp_path / "plain"), "--scrape-key-file", str(scrape))
    assert plain.returncode == 3 and "plain http" in plain.stderr, plain.stdout + plain.stderr
    assert not (tmp_path / "plain").exists()
    tls = run(env, "monitor", "--host", "sim", "--out", str(tmp_path / "tls"), "--scrape-key-file", str(scrape),
              "--scheme", "https")
    assert tls.returncode == 0, tls.stdout + tls.stderr
    jobs = {j["job_name"]: j for j in yaml.safe_load((tmp_path / "tls" / "prometheus.yml").read_text())["scrape_configs"]}
    assert jobs["vllm-keyed"]["authorization"] == {"type": "Bearer", "credentials_file": str(scrape)}
    assert jobs["vllm-keyed"]["scheme"] == "https"
    assert [g["labels"]["service"] for g in json.loads((tmp_path / "tls" / "targets" / "vllm-keyed.json").read_text())] \
        == [m.name]
    assert holding(tmp_path / "tls", KEY, SCRAPE) == []
    checked = subprocess.run([promtool, "check", "config", str(tmp_path / "tls" / "prometheus.yml")],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    # no manifest for it here: still a target (unkeyed, no objective), and said so
    bare = run(cli_env(sim_host, write_models(tmp_path / "none", [])), "monitor", "--host", "sim",
               "--out", str(tmp_path / "bare"))
    assert bare.returncode == 0, bare.stdout + bare.stderr
    assert f"{m.name}: its manifest could not be read" in bare.stdout, bare.stdout
    assert [g["labels"]["service"] for g in json.loads((tmp_path / "bare" / "targets" / "vllm.json").read_text())] \
        == [m.name]
