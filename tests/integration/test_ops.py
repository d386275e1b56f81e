"""status / history / logs / stop / gc on the default SIMULATED host (LocalHost, process services).

Every test deploys with manifests copied to a tmp folder with a free port each, so tests never
meet another run's simulated vLLM on the shipped port 8000.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import get_manifest
from orchestrator.errors import RefusedError
from orchestrator.host.local import LocalHost
from orchestrator.host.services import Service
from orchestrator.host.state import HostLock, read_active, read_history
from orchestrator.ops.execute import Reporter
from orchestrator.ops.status import gather_status, host_status
from orchestrator.ops.stop import stop_model
from orchestrator.plan.run import Options
from orchestrator.sim import manager
from tests.plugins.sim_hosts import TEST_SPEED, free_port, wait_until

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    """The shipped manifests with a free port each ($VLLM_ORCH_MODELS points here)."""
    d = tmp_path / "models"
    d.mkdir()
    for name in ("kimi-k25-int4", "minimax-m25"):
        data = yaml.safe_load((REPO / "models" / f"{name}.yaml").read_text())
        data["serving"]["port"] = free_port()
        (d / f"{name}.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.setenv("VLLM_ORCH_MODELS", str(d))
    return d


def entry_of(sim, name: str = "sim") -> HostEntry:
    data = yaml.safe_load(manager.inventory_file(sim.home).read_text())["hosts"][name]
    return HostEntry(name=name, **data)


def deploy(entry: HostEntry, models_dir: Path, model: str):
    from orchestrator.ops.deploy import run_deploy

    m = get_manifest(model, models_dir)[0]
    res = run_deploy(entry, m, Options(budget_s=30, no_progress_s=10, gpu_release_timeout_s=10, poll_s=0.1),
                     Reporter(None, quiet=True), dry_run=False)
    assert res.ok, res.as_dict()
    return m


def cli(*args: str, input: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], capture_output=True, text=True,
                          timeout=120, input=input, env={**os.environ, **(env or {}), "COLUMNS": "120"},
                          cwd=str(REPO))


def pidfile(entry: HostEntry, model: str) -> Path:
    return Path(entry.state_dir) / "run" / f"vllm-{model}.pid"


def holders(sim) -> list[dict]:
    out = []
    for f in (sim.dir / "gpu-procs").glob("*.json"):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            pass
    return [h for h in out if manager.alive(int(h["pid"]), h.get("start_time"))]


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_status_walks_through_ready_failed_stopped_loading(sim_host, models_dir):
    entry = entry_of(sim_host)
    st = host_status(entry)
    assert (st.state, st.active_model, st.reachable) == ("stopped", None, True)
    assert len(st.gpus) == 8 and st.disk["free"] > 0

    m = deploy(entry, models_dir, "kimi-k25-int4")
    st = host_status(entry)
    assert (st.state, st.active_model, st.port) == ("ready", "kimi-k25-int4", m.serving.port)
    assert st.kv_cache_usage is not None and st.requests_running == 0 and st.requests_waiting == 0
    assert st.uptime_s is not None and 0 <= st.uptime_s < 60
    assert sum(1 for p in st.gpu_processes if p["owner"] == "kimi-k25-int4") == 8
    assert st.last_deploy["result"] == "ok" and st.last_deploy["model"] == "kimi-k25-int4"
    assert [d["name"] for d in st.models] == ["kimi-k25-int4"] and st.models[0]["active"]
    assert st.round_trips <= 6, st.round_trips       # extras + facts + 3 probes (+ tunnels)

    # kill -9 of the main process: the service is failed and its workers are left behind.
    pid = int(pidfile(entry, "kimi-k25-int4").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: host_status(entry).state == "failed")
    st = host_status(entry)
    assert {p["kind"] for p in st.gpu_processes} == {"left behind"}

    host = LocalHost("sim", env=entry.env)
    res = stop_model(host, entry, "kimi-k25-int4", release_timeout=10, poll=0.1)
    assert res.ok and res.was == "failed" and len(res.orphans) == 8 and res.cleared_active
    assert not holders(sim_host)
    st = host_status(entry)
    assert (st.state, st.active_model) == ("stopped", None)

    # A start that hangs while loading: the process runs and the port never answers.
    manager.add_fault("sim", "hang", "kimi-k25-int4", home=sim_host.home)
    svc = Service.for_host(host, entry, "kimi-k25-int4")
    svc.run_all(svc.start_commands(), "start")
    try:
        wait_until(lambda: host_status(entry).state == "loading")
        st = host_status(entry)
        assert st.active_model == "kimi-k25-int4" and "does not answer" in st.state_reason
    finally:
        res = stop_model(host, entry, "kimi-k25-int4", release_timeout=10, poll=0.1)
    assert res.ok and res.was == "running" and not holders(sim_host)


def test_status_of_several_hosts_in_parallel_with_one_unreachable(sim_host, models_dir, tmp_path):
    manager.up(3, speed=TEST_SPEED, home=sim_host.home)
    deploy(entry_of(sim_host, "sim-2"), models_dir, "minimax-m25")
    inventory = tmp_path / "hosts.yaml"
    closed = free_port()
    inventory.write_text(yaml.safe_dump({"hosts": {"gone": {
        "address": "127.0.0.1", "port": closed, "user": "nobody", "connect_timeout": 2,
        "known_hosts_file": str(tmp_path / "kh")}}}))
    t0 = time.monotonic()
    r = cli("--inventory", str(inventory), "status", "--json")
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stderr          # one host unreachable
    rows = {row["host"]: row for row in json.loads(r.stdout)}
    assert set(rows) == {"sim", "sim-2", "sim-3", "gone"}
    assert rows["sim-2"]["state"] == "ready" and rows["sim-2"]["active_model"] == "minimax-m25"
    assert rows["sim"]["state"] == rows["sim-3"]["state"] == "stopped"
    assert rows["gone"]["state"] == "unreachable" and rows["gone"]["error"]
    assert rows["gone"]["active_model"] is None
    assert took < 15

    text = cli("--inventory", str(inventory), "status")
    assert "unreachable" in text.stdout and "minimax-m25" in text.stdout and "ready" in text.stdout
    entries = [entry_of(sim_host, n) for n in ("sim", "sim-2", "sim-3")]
    assert [s.host for s in gather_status(entries)] == ["sim", "sim-2", "sim-3"]    # in the order given
    stop_model(LocalHost("sim-2", env=entries[1].env), entries[1], "minimax-m25", release_timeout=10)



def test_status_asks_the_hosts_at_the_same_time(tmp_path, monkeypatch):
    """Four hosts that each keep vllm-orch waiting 1 s (a port that accepts but never speaks SSH):
    asked together, every host's wait overlaps every other's. Each call's interval is recorded
    (nothing about the machine's speed is asserted): the last to start started before the first
    to end ended. One after the other, no two would overlap."""
    import socket

    from orchestrator.ops import status as status_mod

    spans: list[tuple[float, float]] = []
    real = status_mod.host_status

    def timed(*args, **kwargs):
        t0 = time.monotonic()
        try:
            return real(*args, **kwargs)
        finally:
            spans.append((t0, time.monotonic()))

    monkeypatch.setattr(status_mod, "host_status", timed)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    entries = [HostEntry(name=f"hung-{i}", address="127.0.0.1", port=silent.getsockname()[1], user="nobody",
                         connect_timeout=1, known_hosts_file=str(tmp_path / "kh")) for i in range(4)]
    try:
        t0 = time.monotonic()
        results = gather_status(entries)
        print(f"4 hosts that each wait 1 s, asked together: {time.monotonic() - t0:.2f} s")
    finally:
        silent.close()
    assert [s.host for s in results] == [e.name for e in entries]
    assert all(s.state == "unreachable" and "timed out" in s.error for s in results), results
    assert len(spans) == 4
    assert max(start for start, _ in spans) < min(end for _, end in spans), spans


def test_stop_kills_its_orphaned_workers_on_its_gpus_only(sim_host, models_dir):
    """The model's workers outlive a SIGKILLed parent AND its PID file is gone (state lost): stop
    still finds them as unowned vLLM workers on its GPUs. A vLLM worker on another GPU and a
    foreign process are left alone."""
    entry = entry_of(sim_host)
    deploy(entry, models_dir, "minimax-m25")           # GPUs 0-3
    pid = int(pidfile(entry, "minimax-m25").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)
    pidfile(entry, "minimax-m25").unlink()
    workers = {h["pid"] for h in holders(sim_host)}
    assert len(workers) == 4
    # A vLLM worker on GPU 6 (someone else's) and a foreign process on GPU 7.
    other = subprocess.Popen([sys.executable, str(sim_host.dir / "bin" / "vllm"), "__sim_gpu_holder__"],
                             env={**os.environ, "VLLM_SIM_HOLDER_TITLE": "VLLM::Worker_TP0",
                                  "VLLM_SIM_HOST_DIR": str(sim_host.dir)})
    foreign = subprocess.Popen(["sleep", "60"])
    try:
        for p, gpu, name in ((other, 6, "VLLM::Worker_TP0"), (foreign, 7, "sleep")):
            (sim_host.dir / "gpu-procs" / f"{p.pid}-{gpu}.json").write_text(json.dumps(
                {"pid": p.pid, "process_name": name, "gpu_index": gpu, "used_mib": 4000,
                 "start_time": manager.start_time(p.pid)}))
        r = cli("stop", "minimax-m25", "--host", "sim", "--json", "--gpu-timeout", "10")
        assert r.returncode == 0, r.stdout + r.stderr
        res = json.loads(r.stdout)
        assert {k["pid"] for k in res["killed"]} == workers
        assert res["gpus"] == [0, 1, 2, 3] and "free" in res["gpus_free"]
        assert other.poll() is None and foreign.poll() is None
        assert {h["pid"] for h in holders(sim_host)} == {other.pid, foreign.pid}
        assert read_active(LocalHost("sim"), entry) is None
        last = read_history(LocalHost("sim"), entry)[-1].shown()
        assert last["operation"] == "stop" and len(last["killed"]) == 4
        again = cli("stop", "minimax-m25", "--host", "sim")
        assert again.returncode == 0 and "already stopped" in again.stdout
    finally:
        for p in (other, foreign):
            p.kill()
            p.wait()
        kill_group(pid)                                  # the engine process of the orphaned group


def test_stop_refuses_while_the_lock_is_held(sim_host, models_dir):
    entry = entry_of(sim_host)
    host = LocalHost("sim", env=entry.env)
    with HostLock(host, entry, "deploy kimi-k25-int4"):
        r = cli("stop", "kimi-k25-int4", "--host", "sim")
        assert r.returncode == 3, r.stdout + r.stderr
        assert "deploy kimi-k25-int4" in r.stderr and "lock" in r.stderr
        g = cli("gc", "--host", "sim", "--yes")
        assert g.returncode == 3 and "lock" in g.stderr
        with pytest.raises(RefusedError):
            stop_model_locked(entry)


def stop_model_locked(entry: HostEntry) -> None:
    from orchestrator.ops.session import session

    with session(entry, "stop kimi-k25-int4", False) as s:
        stop_model(s.host, entry, "kimi-k25-int4")


def test_gc_deletes_only_inactive_folders_and_nothing_outside(sim_host, models_dir, tmp_path):
    entry = entry_of(sim_host)
    deploy(entry, models_dir, "kimi-k25-int4")
    root = Path(entry.models_root)
    old = root / "old-model"
    (old / ".vllm-orch").mkdir(parents=True)
    (old / ".vllm-orch" / "verified.json").write_text('{"repo": "a/b", "files": {}, "complete": true}')
    (old / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 5000)
    theirs = root / "alice-notes"                    # not made by vllm-orch: never a candidate
    theirs.mkdir()
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data").write_text("keep me")
    (root / "sneaky").symlink_to(outside)            # looks like a model folder, points outside
    beside = root.parent / "beside-models"
    beside.mkdir()

    dry = cli("gc", "--host", "sim", "--dry-run")
    assert dry.returncode == 0 and "old-model" in dry.stdout and "kimi-k25-int4: the active model" in dry.stdout
    assert old.exists()
    refused = cli("gc", "--host", "sim", input="")     # no TTY, no --yes
    assert refused.returncode == 3 and "--yes" in refused.stderr
    assert old.exists()

    r = cli("gc", "--host", "sim", "--yes", "--json")
    res = json.loads(r.stdout)
    assert [d["name"] for d in res["deleted"]] == ["old-model"] and res["kept"] == []
    keep = dict(map(tuple, res["keep"]))
    assert "not made by vllm-orch" in keep["sneaky"] and "not made by vllm-orch" in keep["alice-notes"]
    assert r.returncode == 0
    assert not old.exists() and (outside / "data").read_text() == "keep me" and beside.is_dir()
    assert theirs.is_dir()
    assert (root / "kimi-k25-int4" / "config.json").exists()
    assert read_history(LocalHost("sim"), entry)[-1].shown()["operation"] == "gc"
    hist = cli("history", "--host", "sim", "--json")
    ops = [rec["operation"] for rec in json.loads(hist.stdout)]
    assert ops == ["deploy", "gc"], ops
    table = cli("history", "--host", "sim")
    assert " gc " in table.stdout and "deleted" in table.stdout, table.stdout[-3000:]
    stop_model(LocalHost("sim", env=entry.env), entry, "kimi-k25-int4", release_timeout=10)


def test_logs_since_deploy_shows_only_the_last_start(sim_host, models_dir):
    entry = entry_of(sim_host)
    host = LocalHost("sim", env=entry.env)
    deploy(entry, models_dir, "kimi-k25-int4")
    stop_model(host, entry, "kimi-k25-int4", release_timeout=10)
    deploy(entry, models_dir, "kimi-k25-int4")
    try:
        full = cli("logs", "kimi-k25-int4", "--host", "sim", "-n", "100000")
        assert full.returncode == 0
        assert full.stdout.count("Application startup complete.") == 2
        since = cli("logs", "kimi-k25-int4", "--host", "sim", "--since-deploy")
        assert since.stdout.count("Application startup complete.") == 1
        assert since.stdout.startswith("--- vllm-orch start")
        tail = cli("logs", "kimi-k25-int4", "--host", "sim", "-n", "3")
        assert len(tail.stdout.splitlines()) == 3
        missing = cli("logs", "minimax-m25", "--host", "sim")
        assert missing.returncode == 2 and "installed: kimi-k25-int4" in missing.stderr
        # -f streams new lines as they come and stops with the process (Ctrl-C in a terminal).
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.main", "logs", "kimi-k25-int4", "--host",
                                 "sim", "-f", "-n", "1"], stdout=subprocess.PIPE, text=True, cwd=str(REPO))
        try:
            proc.stdout.readline()
            with open(Path(entry.log_dir) / "vllm-kimi-k25-int4.log", "a") as f:
                f.write("a new line for the follower\n")
            deadline = time.monotonic() + 10
            seen = ""
            while "a new line for the follower" not in seen and time.monotonic() < deadline:
                seen += proc.stdout.readline()
            assert "a new line for the follower" in seen
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(10)
    finally:
        stop_model(host, entry, "kimi-k25-int4", release_timeout=10)
