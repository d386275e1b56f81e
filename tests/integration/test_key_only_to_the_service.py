"""The API key goes only to the service's own listener. vLLM binds its port early and listens only
once its engine is up (vllm/entrypoints/launchers/launcher.py: create_server_socket at start-up,
the HTTP server later), and the SIMULATED vLLM does the same: for the whole load (and any
restart) another local user can listen on 127.0.0.1 at the same port (SO_REUSEADDR beside a
socket that is bound but not listening), answer /health and /v1/models, and collect what the
readiness gates send. vllm-orch's gates send the key only once the host facts show every process
bound to the port is the service's (the ownership rule: its process group here, its cgroup on
systemd hosts); so do the other callers that send it (deploy/swap/regen/check asking whether the
service already serves, while its unit is `activating`; `status`) through the one rule,
orchestrator/probe/keyed.py, and /health is never sent the key. The units' own probe checks the
peer of each connection (tests/integration/test_unit_probe.py)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from orchestrator.host.connect import open_host
from orchestrator.host.services import Service
from orchestrator.ops.status import host_status
from orchestrator.secret import Secret
from orchestrator.sim import manager

from .deployhelp import cli_env, deploy, entry, tuned, write_models
from .test_unit_probe import ATTACKER

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the port is held by another user")


def bound(log: Path) -> bool:
    """The simulated vLLM of the last start has bound its port (its log's line right before the
    bind, as the real one's engine set-up follows create_server_socket): a socket bound but not
    listening is in no table of /proc/net/tcp."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return "Chunked prefill is enabled" in text.rpartition("--- vllm-orch start")[2]


def squat(port: int, seen: Path) -> subprocess.Popen:
    """User nobody listening on 127.0.0.1:port beside the service's bound socket, answering every
    request 200 and writing down what it was sent."""
    nobody = pwd.getpwnam("nobody")
    stranger = subprocess.Popen(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}",
                                 "--clear-groups", "/usr/bin/python3", "-c", ATTACKER, str(port), str(seen)],
                                stdout=subprocess.PIPE, text=True, cwd="/")
    assert stranger.stdout.readline().strip() == "listening"
    return stranger


def test_the_gates_never_send_the_key_to_another_user_listening_while_vllm_loads(sim_host, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "sk-only-for-vllm")
    m = tuned("minimax-m25", serving={"secret_env": ["VLLM_API_KEY"]})
    manager.add_fault("sim", "slow-start", model=m.name, home=sim_host.home, factor=25)   # a load of seconds
    shared = Path(tempfile.mkdtemp(prefix="vllm-orch-stranger-", dir="/tmp"))
    shared.chmod(0o777)
    seen = shared / "requests"
    done: dict = {}
    run = threading.Thread(target=lambda: done.update(result=deploy(entry(sim_host), m, budget_s=120)))
    run.start()
    stranger = None
    try:
        deadline = time.monotonic() + 120
        log = Path(entry(sim_host).log_dir) / f"vllm-{m.name}.log"
        while not bound(log):
            assert time.monotonic() < deadline and run.is_alive(), done.get("result") and done["result"].error
            time.sleep(0.05)
        stranger = squat(m.serving.port, seen)
        run.join(timeout=240)
        result = done["result"]
        asked = seen.read_text() if seen.exists() else ""
        assert "sk-only-for-vllm" not in asked and "Authorization" not in asked, asked
        assert not result.ok and getattr(result.error, "kind", None) == "port", result.error
        assert "the API key was not sent" in str(result.error) and "user nobody" in str(result.error)
        assert "GET /health" in asked                       # it did answer /health: no key needed there
    finally:
        if stranger is not None:
            stranger.kill()
        run.join(timeout=240)
        shutil.rmtree(shared)


def test_a_deploy_status_and_bench_send_no_key_to_another_user_listening_while_the_unit_is_activating(
        sim_host, monkeypatch, tmp_path):
    """The service serves; then it restarts (its unit `activating`: vLLM loading, its socket bound but
    not listening) and user nobody listens on 127.0.0.1 at its port. A deploy (here its plan, which
    asks whether the service already serves: ops/gather.serving_now, as swap, regen and check do)
    and `status` ask /health without the key, and /v1/models only of a listener proven the
    service's: nobody's is not, so nobody is sent no key, and status says who holds the port.
    `bench --host` with a key is refused (exit 3) before its first request."""
    monkeypatch.setenv("VLLM_API_KEY", "sk-only-for-vllm")
    m = tuned("minimax-m25", serving={"secret_env": ["VLLM_API_KEY"]})
    e = entry(sim_host)
    first = deploy(e, m, budget_s=120)
    assert first.ok, first.error
    manager.add_fault("sim", "slow-start", model=m.name, home=sim_host.home, factor=200)   # a load of minutes
    host = open_host(e)
    service = Service.for_host(host, e, m.name)
    service.run_all(service.stop_commands(False), f"stop {m.name}", timeout=120)
    service.run_all(service.start_commands(), f"start {m.name}", timeout=120)
    shared = Path(tempfile.mkdtemp(prefix="vllm-orch-stranger-", dir="/tmp"))
    shared.chmod(0o777)
    seen = shared / "requests"
    stranger = None
    try:
        log = Path(e.log_dir) / f"vllm-{m.name}.log"
        deadline = time.monotonic() + 120
        while not bound(log):
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
            time.sleep(0.05)
        stranger = squat(m.serving.port, seen)
        plan = deploy(e, m, dry_run=True)
        asked = seen.read_text() if seen.exists() else ""
        assert "GET /health" in asked, (plan.error, asked)    # the deploy asked whether it serves
        assert "sk-only-for-vllm" not in asked and "Authorization" not in asked, asked
        st = host_status(e, api_key_of=lambda _name: Secret("sk-only-for-vllm"))
        asked = seen.read_text()
        assert "sk-only-for-vllm" not in asked and "Authorization" not in asked, asked
        [row] = [s for s in st.services if s.name == m.name]
        assert "the API key was not sent" in row.state_reason and "user nobody" in row.state_reason, \
            row.state_reason
        bench = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "bench", "--host", "sim", "-c", "1",
                                "--out", str(tmp_path / "bench")], capture_output=True, text=True, timeout=300,
                               env=cli_env(sim_host, write_models(tmp_path / "models", [m])))
        assert bench.returncode == 3 and "the API key was not sent" in bench.stderr, bench.stdout + bench.stderr
        asked = seen.read_text()
        assert "sk-only-for-vllm" not in asked and "Authorization" not in asked, asked
    finally:
        if stranger is not None:
            stranger.kill()
        host.close()
        shutil.rmtree(shared)
