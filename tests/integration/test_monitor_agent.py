"""A service that listens on loopback only (every sleep-capable one: docs/security.md) on a host the
fleet's Prometheus reaches over the network: `vllm-orch monitor` leaves it out of the fleet's
targets (its host's address refuses the connection; 127.0.0.1 would be the Prometheus machine's
own port) and writes agent/HOST/, a Prometheus in agent mode for that host. Here, with REAL
Prometheus processes (Debian's package): the agent scrapes the SIMULATED host's loopback service and
remote-writes to a central Prometheus with the remote-write receiver on, whose query API then has
the service's `up` and its `vllm:engine_sleep_state` with the fleet's labels. Nothing waits a
fixed time: it polls."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from .deployhelp import cli_env, deploy, entry, free_port, write_models
from .test_monitor_prometheus import binary, cli, get, poll
from .test_sleep_swap import sleepy

UNREACHABLE = "192.0.2.10"          # TEST-NET-1 (RFC 5737): where the fleet's Prometheus "reaches" the host


@pytest.mark.long
def test_a_loopback_service_is_scraped_by_an_agent_on_its_host_and_reaches_the_fleets_prometheus(sim_host,
                                                                                                  tmp_path):
    promtool, prometheus = binary("promtool"), binary("prometheus")
    m = sleepy("kimi-k25-int4")                      # serving.host 127.0.0.1, sleep mode
    assert deploy(entry(sim_host), m).ok
    env = cli_env(sim_host, write_models(tmp_path / "models", [m]))
    simulated = sim_host.home.parent / "hosts.d" / f"{sim_host.name}.yaml"     # the inventory entry sim up wrote
    inventory = yaml.safe_load(simulated.read_text())
    inventory["hosts"][sim_host.name]["monitoring"] = {"address": UNREACHABLE}
    simulated.write_text(yaml.safe_dump(inventory))
    central, agent = free_port(), free_port()
    out = tmp_path / "monitoring"
    made = cli(env, "monitor", "--host", sim_host.name, "--out", str(out), "--interval", "1",
               "--remote-write", f"http://127.0.0.1:{central}/api/v1/write")
    assert made.returncode == 0, made.stdout + made.stderr
    assert f"{m.name} listens on loopback only" in made.stdout, made.stdout
    assert json.loads((out / "targets" / "vllm.json").read_text()) == []       # not at 192.0.2.10, not at 127.0.0.1
    [group] = json.loads((out / "agent" / sim_host.name / "targets" / "vllm.json").read_text())
    assert group["targets"] == [f"127.0.0.1:{m.serving.port}"]
    assert group["labels"]["service"] == m.name and group["labels"]["host"] == sim_host.name
    for config in (out / "prometheus.yml", out / "agent" / sim_host.name / "prometheus.yml"):
        checked = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True,
                                 timeout=60)
        assert checked.returncode == 0, checked.stdout + checked.stderr

    logs = [open(tmp_path / "central.log", "w"), open(tmp_path / "agent.log", "w")]
    children = [
        subprocess.Popen([prometheus, f"--config.file={out / 'prometheus.yml'}", "--web.enable-remote-write-receiver",
                          f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{central}"],
                         stdout=subprocess.DEVNULL, stderr=logs[0]),
        subprocess.Popen([prometheus, "--enable-feature=agent",
                          f"--config.file={out / 'agent' / sim_host.name / 'prometheus.yml'}",
                          f"--storage.agent.path={tmp_path / 'agent-wal'}", f"--web.listen-address=127.0.0.1:{agent}"],
                         stdout=subprocess.DEVNULL, stderr=logs[1]),
    ]
    try:
        def query(expr: str) -> list:
            return get(central, "/api/v1/query", query=expr)["data"]["result"]
        where = f'host="{sim_host.name}", service="{m.name}"'
        [up] = poll("the agent's `up` of the service at the fleet's Prometheus",
                    lambda: [r for r in query(f'up{{job="vllm", {where}}}') if r["value"][1] == "1"], budget=120)
        assert up["metric"]["served_name"] == m.served_name, up
        rows = poll("the service's vllm:engine_sleep_state at the fleet's Prometheus",
                    lambda: query(f'vllm:engine_sleep_state{{{where}, sleep_state="awake"}}'), budget=120)
        assert {r["value"][1] for r in rows} == {"1"}, rows          # awake: the sleep alert's input is there
    finally:
        for child in reversed(children):          # the agent first: it would retry a central one gone
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(timeout=30)
        for f in logs:
            f.close()
