"""status / logs / stop on a real-systemd host (systemd-nspawn) reached over real SSH: units,
journalctl, the cgroup kill and the monotonic start time are the real things here."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.config.manifest import get_manifest
from orchestrator.host.connect import open_host
from orchestrator.host.services import Service
from orchestrator.ops.execute import Reporter
from orchestrator.ops.status import host_status
from orchestrator.plan.run import Options
from orchestrator.sim import manager
from tests.plugins.sim_hosts import free_port

pytestmark = pytest.mark.systemd
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sd_sim(systemd_sim_host, tmp_path_factory):
    """The SIMULATED systemd host (tests/plugins/remote_hosts.py), a models folder with Kimi on a free
    port and an inventory naming the host."""
    entry, data, hdir = systemd_sim_host
    models = tmp_path_factory.mktemp("models")
    m = yaml.safe_load((REPO / "models" / "kimi-k25-int4.yaml").read_text())
    m["serving"]["port"] = free_port()
    (models / "kimi-k25-int4.yaml").write_text(yaml.safe_dump(m))
    inventory = tmp_path_factory.mktemp("inv") / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {entry.name: data}}))
    return entry, models, inventory, hdir


def cli(inventory: Path, models: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "--inventory", str(inventory),
                           "--models", str(models), *args], capture_output=True, text=True, timeout=180,
                          cwd=str(REPO))


def test_status_logs_and_stop_on_a_systemd_host_over_ssh(sd_sim):
    from orchestrator.ops.deploy import run_deploy

    entry, models, inventory, hdir = sd_sim
    m = get_manifest("kimi-k25-int4", models)[0]
    # deploy installs the unit, downloads and starts; its streamed smoke completion through the SSH
    # tunnel does not finish on this host at the moment (reported), so the service is started
    # again by hand when deploy gave up at that gate.
    res = run_deploy(entry, m, Options(budget_s=8, no_progress_s=8, gpu_release_timeout_s=15, poll_s=0.2),
                     Reporter(None, quiet=True), dry_run=False)
    if not res.ok:
        steps = {s["step"]: s for s in res.as_dict()["steps"]}
        assert "passed: process alive, port accepting, /health 200, model listed" in steps["ready"]["result"], steps
        with open_host(entry) as host:
            svc = Service.for_host(host, entry, m.name)
            svc.run_all(svc.start_commands(), "start")
    port_of = lambda name: m.serving.port               # noqa: E731 - no active record without deploy
    deadline = time.monotonic() + 30
    while (st := host_status(entry, port_of)).state != "ready":
        assert st.state == "loading" and time.monotonic() < deadline, st
        time.sleep(0.3)
    assert st.active_model == "kimi-k25-int4", st
    assert st.uptime_s is not None and 0 <= st.uptime_s < 120      # from the unit's monotonic start
    assert sum(1 for p in st.gpu_processes if p["owner"] == "kimi-k25-int4") == 8
    assert st.kv_cache_usage is not None and st.requests_running == 0

    logs = cli(inventory, models, "logs", "kimi-k25-int4", "--host", entry.name, "--since-deploy")
    assert logs.returncode == 0, logs.stderr
    # the deploy's start and (when deploy gave up at the smoke gate) the start by hand
    assert logs.stdout.count("Application startup complete.") == (1 if res.ok else 2)
    tail = cli(inventory, models, "logs", "kimi-k25-int4", "--host", entry.name, "-n", "3")
    assert len(tail.stdout.splitlines()) == 3
    assert "vllm-kimi-k25-int4" in logs.stdout                   # journal lines carry the identifier

    r = cli(inventory, models, "stop", "kimi-k25-int4", "--host", entry.name, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["was"] == "running" and out["gpus"] == list(range(8)) and "free" in out["gpus_free"]
    with open_host(entry) as host:
        state = host.run(["systemctl", "is-active", "vllm-kimi-k25-int4.service"]).stdout.strip()
        assert state in ("inactive", "failed")
    assert not [f for f in (hdir / "gpu-procs").glob("*.json")
                if manager.alive(json.loads(f.read_text())["pid"], None)]
    st = host_status(entry, port_of)
    assert st.state == "stopped" and st.running_models == []
    again = cli(inventory, models, "stop", "kimi-k25-int4", "--host", entry.name)
    assert again.returncode == 0 and "already stopped" in again.stdout
