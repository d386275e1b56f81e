"""A service across two SIMULATED process hosts, through the CLI: the shipped 2-node manifest
(kimi-k25-int4-2node, TP8 x PP2) deployed with `--host sim,sim-2` (the simulated vLLM's ranks meet
over real TCP on the manifest's master port), status shows it once with both nodes, the logs merge,
stop on the worker stops both; a rank crashing while it loads fails the deploy naming that node and
its line, and every node is stopped again; bad selections exit 2 in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from orchestrator.config.inventory import HostEntry
from orchestrator.host.local import LocalHost
from orchestrator.host.services import Service
from orchestrator.host.state import read_history, read_records
from orchestrator.sim import manager
from tests.plugins.sim_hosts import TEST_SPEED, free_port, wait_until

from .deployhelp import SHIPPED, write_models

NAME = "kimi-k25-int4-2node"
ONE = "kimi-k25-int4"
REPO = Path(__file__).parents[2]


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """Two fresh SIMULATED process hosts (sim, sim-2) and a models folder with the shipped 2-node
    manifest on free ports (its HTTP port and master port: other tests' services must not meet it)."""
    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path / "state"))
    home = manager.sim_home()
    manager.up(2, speed=TEST_SPEED, home=home)
    data = SHIPPED[NAME].model_dump()
    data["serving"]["port"] = free_port()
    data["multinode"]["master_port"] = free_port()
    m = type(SHIPPED[NAME]).model_validate(data)
    single = SHIPPED[ONE].model_dump()
    single["serving"]["port"] = data["serving"]["port"]          # the swap's other side, on the same port
    models = write_models(tmp_path / "models", [m, type(m).model_validate(single)])
    env = {**os.environ, "VLLM_ORCH_STATE_HOME": str(tmp_path / "state"), "VLLM_ORCH_MODELS": str(models),
           "COLUMNS": "160"}
    inv = yaml.safe_load(manager.inventory_file(home).read_text())["hosts"]
    entries = {n: HostEntry.model_validate({**inv[n], "name": n}) for n in ("sim", "sim-2")}
    try:
        yield env, entries, m
    finally:
        for e in entries.values():          # whatever a failed assertion left running
            for name in (NAME, ONE):
                Service.for_host(LocalHost(e.name, env=e.env), e, name).run_all(
                    Service.for_host(None, e, name).stop_commands(drain=False), "stop")
        manager.down(home)


def cli(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(REPO))


def running(e: HostEntry, name: str = NAME) -> bool:
    return Service.for_host(LocalHost(e.name, env=e.env), e, name).state().active


def test_deploy_status_logs_and_stop_of_a_two_node_service(cluster):
    env, entries, m = cluster
    dry = cli(env, "deploy", NAME, "--host", "sim,sim-2", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "start[sim-2]" in dry.stdout and "verify-same" in dry.stdout and "download " in dry.stdout
    assert dry.stdout.index("start[sim-2]") < dry.stdout.index("start[sim] ")      # workers first

    r = cli(env, "deploy", NAME, "--host", "sim,sim-2", "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["ok"] and out["nodes"] == ["sim", "sim-2"]
    done = {s["step"]: s["status"] for s in out["steps"]}
    assert done["verify-same"] == "done" and done["start[sim-2]"] == done["start[sim]"] == "done"
    assert done["ready[sim]"] == "done" and done["record[sim-2]"] == "done"
    for e in entries.values():                    # a record and a history line on every node
        host = LocalHost(e.name, env=e.env)
        rec = read_records(host, e)[NAME].shown()
        assert rec["nodes"] == ["sim", "sim-2"] and rec["head"] == "sim" and rec["rank"] == (e.name == "sim-2")
        last = read_history(host, e)[-1].shown()
        assert last["operation"] == "deploy" and last["ok"] and last["nodes"] == ["sim", "sim-2"]
        assert running(e)

    st = cli(env, "status", "--json")
    assert st.returncode == 0, st.stderr
    rows = {row["host"]: row for row in json.loads(st.stdout)}
    head = [s for s in rows["sim"]["services"] if s["name"] == NAME]
    assert len(head) == 1 and head[0]["state"] == "ready"
    assert [(n["host"], n["rank"], n["state"]) for n in head[0]["nodes"]] == [("sim", 0, "ready"),
                                                                             ("sim-2", 1, "running")]
    assert not [s for s in rows["sim-2"]["services"] if s["name"] == NAME]          # shown once
    assert rows["sim-2"]["node_of"][0]["service"] == NAME and rows["sim-2"]["node_of"][0]["head"] == "sim"
    text = cli(env, "status", "--host", "sim")         # the worker not selected: asked all the same
    assert text.returncode == 0 and "node sim-2 (rank 1): running" in text.stdout, text.stdout

    logs = cli(env, "logs", NAME, "--host", "sim", "--nodes", "-n", "50")
    assert logs.returncode == 0, logs.stderr
    lines = logs.stdout.splitlines()
    assert any(line.startswith("[sim] ") for line in lines) and any(line.startswith("[sim-2] ") for line in lines)
    assert any("headless" in line for line in lines if line.startswith("[sim-2] "))

    stop = cli(env, "stop", NAME, "--host", "sim-2", "--json")     # the worker named: both stop
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert sorted(row["host"] for row in json.loads(stop.stdout)) == ["sim", "sim-2"]
    for e in entries.values():
        host = LocalHost(e.name, env=e.env)
        assert not running(e) and NAME not in read_records(host, e)


@pytest.mark.parametrize("fault, line", [("rank-crash-loading", "illegal memory access"),
                                         ("wrong-revision", "Attempted to load weight")])
def test_a_rank_failing_while_loading_fails_the_deploy_naming_its_node(cluster, fault, line):
    """A rank on sim-2 crashes while loading, or sim-2's weights do not fit the model (the
    simulator's wrong-revision: files the deploy could not tell apart, since both nodes verified
    the same ones): the head dies of the lost rank, and the deploy names sim-2 and its line."""
    env, entries, _m = cluster
    assert cli(env, "sim", "fault", "sim-2", fault).returncode == 0
    r = cli(env, "deploy", NAME, "--host", "sim,sim-2")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "error: sim-2: ready:" in r.stderr and "on node sim-2" in r.stderr
    assert "root cause:" in r.stderr and line in r.stderr
    for e in entries.values():                    # the recovery stopped every node
        assert not running(e)
        last = read_history(LocalHost(e.name, env=e.env), e)[-1].shown()
        assert last["operation"] == "deploy" and not last["ok"] and last["recovery"]["ok"]


@pytest.mark.parametrize("hosts, says", [
    ("sim", "runs on 2 nodes (multinode.nodes) but 1 host was given: sim"),
    ("sim,sim-2,local", "but 3 hosts were given"),
])
def test_a_selection_that_does_not_fit_the_layout_is_bad_input(cluster, hosts, says):
    env, entries, _m = cluster
    for command in ("deploy", "check"):
        r = cli(env, command, NAME, "--host", hosts)
        assert r.returncode == 2 and says in r.stderr.splitlines()[0], r.stderr
        assert not any(running(e) for e in entries.values())


@pytest.mark.long
def test_swap_from_one_node_to_two_and_back_with_a_rollback_on_every_node(cluster):
    """The new service is downloaded and verified on both nodes before the old one stops; a rank
    crash on sim-2 rolls back (the 2-node service stopped on both, kimi-k25-int4 serving on sim
    again); then 1 -> 2 nodes and 2 -> 1 node both go through."""
    env, entries, _m = cluster
    sim, sim2 = entries["sim"], entries["sim-2"]
    r = cli(env, "deploy", ONE, "--host", "sim")
    assert r.returncode == 0, r.stderr[-3000:]

    assert cli(env, "sim", "fault", "sim-2", "rank-crash-loading").returncode == 0
    r = cli(env, "swap", NAME, "--host", "sim,sim-2", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 1 and not out["ok"] and "sim-2: ready:" in out["error"], r.stdout[-3000:]
    steps = [s["step"] for s in out["steps"] if s["status"] == "done"]
    assert steps.index("verify-same") < steps.index("stop[sim]")      # downloaded everywhere first
    assert out["recovery"]["ok"] and [s["step"] for s in out["recovery"]["steps"]][:2] == ["stop[sim-2]", "stop[sim]"]
    assert running(sim, ONE) and not running(sim) and not running(sim2)
    assert ONE in read_records(LocalHost("sim", env=sim.env), sim)

    r = cli(env, "swap", NAME, "--host", "sim,sim-2", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["ok"] and out["downtime_s"] > 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert running(sim) and running(sim2) and not running(sim, ONE)
    recs = {e.name: read_records(LocalHost(e.name, env=e.env), e) for e in entries.values()}
    assert set(recs["sim"]) == {NAME} and set(recs["sim-2"]) == {NAME}      # the old record went with the swap

    r = cli(env, "swap", ONE, "--host", "sim", "--json")           # the old service's records name sim-2
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["ok"], r.stdout[-3000:] + r.stderr[-2000:]
    assert running(sim, ONE) and not running(sim) and not running(sim2)
    assert set(read_records(LocalHost("sim-2", env=sim2.env), sim2)) == set()
    last = read_history(LocalHost("sim-2", env=sim2.env), sim2)[-1].shown()
    assert last["operation"] == "swap" and last["ok"] and last["from_nodes"] == ["sim", "sim-2"]


def test_a_node_that_cannot_reach_the_head_is_named_after_the_join_wait(cluster):
    """sim-2's ranks never reach the head's master port (`sim fault sim-2 unreachable-head`): after
    vllm-orch's own join wait (10 s here: multinode.join_timeout_seconds; vLLM's process group
    timeout, --distributed-timeout-seconds, is the collective timeout, 600 s) the deploy fails
    naming sim-2, whose ranks never said they joined, and stops both nodes."""
    from orchestrator.config.manifest import Manifest
    from orchestrator.ops.deploy import run_deploy
    from orchestrator.ops.execute import Reporter
    from orchestrator.plan.run import Options

    env, entries, m = cluster
    data = m.model_dump()
    data["multinode"]["join_timeout_seconds"] = 10
    m = Manifest.model_validate(data)
    nodes = list(entries.values())
    assert cli(env, "sim", "fault", "sim-2", "unreachable-head").returncode == 0
    res = run_deploy(nodes, m, Options(poll_s=0.2), Reporter(None, quiet=True), False)
    assert not res.ok and res.error is not None and res.error.host == "sim-2", res.error
    assert res.error.kind == "join", res.error
    assert "node sim-2 did not join the head within 10s (vllm-orch's join wait" in res.error.message
    assert not any(running(e) for e in entries.values())


def service_row(env: dict, attention: bool = False) -> dict:
    """The service's row of `status --json`; status exits 1 when a service needs attention."""
    st = cli(env, "status", "--json")
    assert st.returncode == (1 if attention else 0), st.stderr
    rows = {row["host"]: row for row in json.loads(st.stdout)}
    return next(s for s in rows["sim"]["services"] if s["name"] == NAME)


def kill_main(e: HostEntry) -> None:
    """SIGKILL of the node's vLLM main process (a crash, an OOM kill), then wait until it is gone."""
    pid = Service.for_host(LocalHost(e.name, env=e.env), e, NAME).state().main_pid
    assert pid
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not running(e), 30, what=f"{e.name}'s vLLM gone")


def test_a_node_lost_while_serving_fails_status_and_a_redeploy_or_stop_acts_on_every_node(cluster):
    """What the real vLLM does once serving (docs/multi-node.md), through the CLI: a lost worker node
    is not noticed by the idle head (its /health stays 200), so status judges the service by every
    node's unit: failed, naming the node, and `deploy` restarts every node. A lost head leaves its
    headless node running, holding its GPUs: status says so and `stop` stops it."""
    env, entries, m = cluster
    r = cli(env, "deploy", NAME, "--host", "sim,sim-2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    kill_main(entries["sim-2"])
    time.sleep(1)
    assert running(entries["sim"])
    with urllib.request.urlopen(f"http://127.0.0.1:{m.serving.port}/health", timeout=5) as h:
        assert h.status == 200                      # the head does not know
    row = service_row(env, attention=True)
    assert row["state"] == "failed", row
    assert row["state_reason"].startswith("node sim-2 not running: the head still answers /health")
    assert f"`vllm-orch deploy {NAME} --host sim,sim-2` restarts every node" in row["state_reason"]

    again = cli(env, "deploy", NAME, "--host", "sim,sim-2", "--json")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    done = {s["step"]: s["status"] for s in json.loads(again.stdout)["steps"]}
    assert done["start[sim-2]"] == done["start[sim]"] == done["ready[sim]"] == "done"
    assert service_row(env)["state"] == "ready"

    kill_main(entries["sim"])
    time.sleep(1)
    assert running(entries["sim-2"])                # a headless vLLM outlives its head
    row = service_row(env, attention=True)
    assert row["state"] == "failed", row
    assert "node sim-2 still running without the head, holding its GPUs" in row["state_reason"]
    assert f"`vllm-orch stop {NAME}` stops every node" in row["state_reason"]

    stop = cli(env, "stop", NAME, "--host", "sim")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert not running(entries["sim-2"])


def test_the_heads_gateway_keeps_the_endpoint_through_a_swap_from_two_nodes_to_one(cluster, tmp_path):
    """A gateway on the head (sim) routes the 2-node service's name to the head's port; a swap to the
    one-node manifest of that served name (GPUs of sim only) drains the head, routes the new one and
    holds its requests while it loads: a load through the gateway sees no failure."""
    import shutil
    import tempfile
    import threading
    from collections import Counter

    import openai

    env, entries, m = cluster
    home = manager.sim_home()
    port = free_port()
    run_dir = tempfile.mkdtemp(prefix="gw-", dir="/tmp")
    data = yaml.safe_load(manager.inventory_file(home).read_text())
    data["hosts"]["sim"]["gateway"] = {"port": port, "run_dir": run_dir, "hold_seconds": 60, "drain_seconds": 20}
    manager.inventory_file(home).write_text(yaml.safe_dump(data))
    env = {**env, "VLLM_ORCH_GATEWAY_KEYS": "gw-key-0123456789abcdef"}
    try:
        r = cli(env, "deploy", NAME, "--host", "sim,sim-2")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        r = cli(env, "gateway", "up", "--host", "sim")
        assert r.returncode == 0 and f"127.0.0.1:{m.serving.port}" in r.stdout, r.stdout + r.stderr
        dry = cli(env, "swap", ONE, "--host", "sim", "--dry-run")
        assert dry.returncode == 0 and f"drain {NAME} at the gateway" in dry.stdout, dry.stdout + dry.stderr
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="gw-key-0123456789abcdef", timeout=120)
        stop, outcome = threading.Event(), Counter()

        def load():
            while not stop.is_set():
                try:
                    chunks = list(c.chat.completions.create(model=m.serving.served_model_name, max_tokens=8,
                                                            stream=True, messages=[{"role": "user", "content": "hi"}],
                                                            extra_body={"ignore_eos": True}))
                    outcome["whole" if chunks[-1].choices[0].finish_reason == "length" else "cut"] += 1
                except openai.APIError as exc:
                    outcome[f"{type(exc).__name__}: {exc}"[:160]] += 1

        threads = [threading.Thread(target=load) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            time.sleep(1)
            r = cli(env, "swap", ONE, "--host", "sim", "--json")
            time.sleep(1)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        out = json.loads(r.stdout)
        assert r.returncode == 0 and out["ok"], r.stdout[-3000:] + r.stderr[-2000:]
        gateway = [s.get("result") or "" for s in out["steps"] if s["step"] == "gateway"]
        assert any(f"no request of {NAME} in flight" in g for g in gateway), gateway
        assert not [g for g in gateway if "could not" in g], gateway
        assert set(outcome) == {"whole"} and outcome["whole"] > 4, outcome
    finally:
        cli(env, "gateway", "down", "--host", "sim")
        shutil.rmtree(run_dir, ignore_errors=True)
