"""Fleets on four real-systemd SIMULATED hosts reached over SSH (tests/plugins/remote_hosts.py),
through the command line as a user runs it: a fleet deploy and its compact dry run, a host that
cannot be reached in the group, and a rolling swap with the new model faulted on the third host
(hosts 1-2 serve the new model, 3 rolled back to the old, 4 untouched), watched by a probe loop."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from orchestrator.host.connect import open_host
from orchestrator.probe.api import Endpoint, health
from orchestrator.sim import fault_file
from tests.plugins.remote_hosts import serve_nothing as serve_nothing_on

from .deployhelp import on_port, write_models

pytestmark = pytest.mark.systemd
REPO = Path(__file__).resolve().parents[2]
OLD, NEW = "kimi-k25-int4", "kimi-k25-nvfp4"
PORT = 8000                                  # each host has its own network namespace


@pytest.fixture(scope="module")
def fleet(systemd_sim_hosts, tmp_path_factory):
    """Four SIMULATED systemd hosts serving nothing, a models folder with OLD and NEW, and an
    inventory naming them with the groups `fleet` (all four) and `withdead` (two of them around a
    host nothing answers on). Yields (hosts, run) where run(*args) runs the CLI."""
    hosts = systemd_sim_hosts(4)
    serve_nothing(hosts)                         # other modules may have left services on the first one
    tmp = tmp_path_factory.mktemp("fleet")
    models = write_models(tmp / "models", [on_port(OLD, PORT), on_port(NEW, PORT)])
    names = [e.name for e, _d, _h in hosts]
    inventory = tmp / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({
        "hosts": {**{e.name: data for e, data, _h in hosts},
                  "dead": {"address": "127.0.0.1", "port": 1, "connect_timeout": 3}},
        "groups": {"fleet": names, "withdead": [names[0], "dead", names[1]]}}))

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "--inventory", str(inventory),
                               "--models", str(models), *args], capture_output=True, text=True, timeout=900,
                              cwd=str(REPO), env={**_env(), "VLLM_ORCH_STATE_HOME": str(tmp / "state")})

    yield hosts, run
    serve_nothing(hosts)                         # the hosts are the session's: leave them as found


def serve_nothing(hosts) -> None:
    """Every vllm unit stopped and disabled, no pending fault, no service / swap / health records."""
    for e, _data, hdir in hosts:
        fault_file.clear_faults(hdir)
        serve_nothing_on(e)


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("VLLM_ORCH_INVENTORY", "VLLM_ORCH_MODELS")}


def serving(run) -> dict[str, tuple[str | None, str]]:
    """host -> (active model, state), from `status --group fleet --json`."""
    r = run("status", "--group", "fleet", "--json")
    return {h["host"]: (h.get("active_model"), h.get("state")) for h in json.loads(r.stdout)}


def test_fleet_deploy_on_four_systemd_hosts(fleet):
    hosts, run = fleet
    names = [e.name for e, _d, _h in hosts]
    r = run("deploy", OLD, "--group", "fleet", "--json")
    rows = json.loads(r.stdout)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-2000:])
    assert [(x["host"], x["result"]) for x in rows] == [(n, "ok") for n in names]
    assert all(x["detail"]["steps"][-1]["status"] == "done" for x in rows)      # each host's own deploy ran
    assert serving(run) == {n: (OLD, "ready") for n in names}
    # the fleet plan: the four hosts' plans are the same plan (nothing to change), shown once
    r = run("deploy", OLD, "--group", "fleet", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"Identical plan on 4 hosts: {', '.join(names)}" in r.stdout
    assert r.stdout.count("Plan: deploy") == 1 and "Differs on" not in r.stdout and "Nothing to change." in r.stdout


def test_an_unreachable_host_is_a_failed_row_and_the_others_succeed(fleet):
    hosts, run = fleet
    a, b = hosts[0][0].name, hosts[1][0].name
    r = run("deploy", OLD, "--group", "withdead")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "2 ok, 1 failed" in r.stdout
    table = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.split() and ln.split()[0] in (a, b, "dead")}
    assert " ok " in table[a] and " ok " in table[b]
    assert " failed " in table["dead"] and "cannot connect" in table["dead"]
    assert "Traceback" not in r.stderr


def test_rolling_swap_stops_at_the_faulted_third_host(fleet):
    hosts, run = fleet
    names = [e.name for e, _d, _h in hosts]
    if serving(run) != {n: (OLD, "ready") for n in names}:
        assert run("deploy", OLD, "--group", "fleet").returncode == 0
    fault_file.add_fault(hosts[2][2], "crash-gpu-memory", model=NEW)
    counts: list[int] = []
    done = threading.Event()

    def probe_loop() -> None:
        """How many hosts answer /health 200, over and over, while the rollout runs."""
        conns = [open_host(e) for e, _d, _h in hosts]
        try:
            while not done.is_set():
                counts.append(sum(health(Endpoint(c, PORT), timeout=10) == 200 for c in conns))
        finally:
            for c in conns:
                c.close()

    prober = threading.Thread(target=probe_loop, daemon=True)
    prober.start()
    try:
        r = run("swap", NEW, "--group", "fleet", "--json")
    finally:
        done.set()
        prober.join(60)
    rows = {x["host"]: x for x in json.loads(r.stdout)}
    assert r.returncode == 1, (r.stdout[-3000:], r.stderr[-2000:])
    assert [rows[n]["result"] for n in names] == ["ok", "ok", "failed", "not run"]
    assert "rollback: kimi-k25-int4 serves again" in rows[names[2]]["cause"]
    assert [rows[n]["note"] for n in names] == [f"{NEW} (ready)", f"{NEW} (ready)", f"{OLD} (ready)",
                                                 f"{OLD} (ready)"]
    assert serving(run) == {names[0]: (NEW, "ready"), names[1]: (NEW, "ready"), names[2]: (OLD, "ready"),
                            names[3]: (OLD, "ready")}
    # one host at a time: never fewer than three of the four serving
    assert len(counts) > 10 and min(counts) >= 3 and counts[-1] == 4, counts
    assert 3 in counts                              # the probe did see a host being swapped
