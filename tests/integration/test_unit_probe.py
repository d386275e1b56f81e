"""The units' probe (orchestrator/host/remote/unit_probe.py), run here as the host's Python runs it:
`ready` against a simulated vLLM while it loads, crashes or serves; `check`'s counting, its
busy-not-hung rule and its restart record with systemctl and HTTP replaced by stand-ins."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from orchestrator.paths import package_file
from tests.integration.probehelp import head_watch
from tests.plugins.sim_hosts import SimServer, make_model

SCRIPT = package_file("host", "remote", "unit_probe.py")


def argv(model) -> list[str]:
    return [str(model), "--served-model-name", "kimi", "--trust-remote-code", "-tp", "8", "--max-model-len", "65536"]


def load():
    spec = importlib.util.spec_from_file_location("unit_probe_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ready(port: int, main_pid: int, budget: float = 60) -> tuple[int, str, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT), "ready", "--unit", "x.service", "--port", str(port),
                           "--served-name", "kimi", "--poll", "0.1"], capture_output=True, text=True,
                          timeout=budget, env=dict(os.environ, MAINPID=str(main_pid)))
    return proc.returncode, proc.stdout, time.monotonic() - t0


def test_ready_waits_for_the_model_to_answer(sim_host):
    from orchestrator.sim import manager

    model = make_model(sim_host.dir, "kimi-k25-int4", "moonshotai/Kimi-K2.5", total_size=547e9)
    manager.add_fault("sim", "slow-start", "kimi-k25-int4", home=sim_host.home)        # ~5 s load
    with SimServer(sim_host, argv(model)) as srv:
        code, out, took = ready(srv.port, srv.proc.pid)
        assert code == 0, out + srv.log[-2000:]
        assert "Application startup complete." in srv.log      # it waited for the whole load
        assert "ready after" in out and "a one-token completion answered" in out


def test_ready_gives_up_only_when_the_main_process_is_gone(sim_host):
    from orchestrator.sim import manager

    model = make_model(sim_host.dir, "kimi-k25-int4", "moonshotai/Kimi-K2.5", total_size=547e9)
    manager.add_fault("sim", "crash-flashinfer", "kimi-k25-int4", home=sim_host.home)
    with SimServer(sim_host, argv(model)) as srv:
        code, out, took = ready(srv.port, srv.proc.pid)
        assert srv.proc.poll() is not None and code == 1
        assert f"main process (PID {srv.proc.pid}) exited before it was ready" in out


def test_ready_sends_the_api_key_vllm_wants(sim_host, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "k-123")        # the unit's EnvironmentFile gives it to both
    model = make_model(sim_host.dir, "kimi-k25-int4", "moonshotai/Kimi-K2.5")
    with SimServer(sim_host, argv(model), env={"VLLM_API_KEY": "k-123"}) as srv:
        code, out, _ = ready(srv.port, srv.proc.pid)
        assert code == 0, out


@pytest.fixture
def check(tmp_path, monkeypatch):
    """cmd_check with a unit that is `active`, HTTP answers and systemctl replaced."""
    mod = load()
    calls: list = []
    monkeypatch.setattr(mod, "unit_show", lambda unit, prop: "active")
    monkeypatch.setattr(mod.subprocess, "run", lambda argv, **kw: calls.append(argv) or
                        subprocess.CompletedProcess(argv, 0, b""))

    def run(answer, tokens=(None, None), failures=2):
        seq = iter(tokens)
        monkeypatch.setattr(mod, "probe", lambda *a, **k: answer)
        monkeypatch.setattr(mod, "generated_tokens", lambda port: next(seq))
        args = ["check", "--unit", "vllm-m.service", "--port", "1", "--served-name", "m", "--model", "m",
                "--failures", str(failures), "--timeout", "2", "--state-dir", str(tmp_path)]
        return mod.main(args)

    def state():
        return json.loads((tmp_path / "health" / "m.json").read_text())

    def history():
        path = tmp_path / "history.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    run.module = mod
    return run, state, history, calls


def test_check_counts_failures_and_restarts_after_n_in_a_row(check):
    run, state, history, calls = check
    hung = (False, "a one-token completion did not answer within 2s")
    assert run(hung, (100.0, 100.0)) == 1 and state()["failures"] == 1 and not calls
    assert run((True, "")) == 0 and state()["failures"] == 0            # a success resets the count
    run(hung, (100.0, 100.0))
    run(hung, (100.0, 100.0))                                           # the second in a row
    assert calls == [["systemctl", "restart", "--no-block", "vllm-m.service"]]
    rec = history()[-1]
    assert rec["operation"] == "health-restart" and rec["model"] == "m" and rec["ok"] is True
    assert rec["reason"] == "2 health checks failed in a row, the last: " + hung[1]
    assert state()["failures"] == 0 and state()["restarts"] == 1


def test_a_busy_server_is_not_a_hung_one(check):
    run, state, history, calls = check
    slow = (False, "a one-token completion did not answer within 2s")
    assert run(slow, (100.0, 164.0), failures=1) == 0                   # tokens flowed meanwhile
    assert state()["last"]["ok"] is True and "64 tokens were generated" in state()["last"]["note"]
    assert not calls and not history()
    assert run((False, "/health answered 503 (the engine is dead)"), failures=1) == 1
    assert calls and history()[-1]["reason"].endswith("(the engine is dead)")


def test_check_leaves_a_unit_that_is_not_active_alone(check, monkeypatch):
    run, state, history, calls = check
    monkeypatch.setattr(run.module, "unit_show", lambda unit, prop: "activating")     # still loading
    assert run((False, "/health gave no answer (ConnectionRefusedError)"), failures=1) == 0
    assert state()["failures"] == 0 and "not probed" in state()["last"]["note"]
    assert not calls and not history()


class Store:
    """A stand-in for the head's rendezvous store: a listening port that accepts every connection
    (in a thread) and can drop them while it keeps listening, or close for good."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            self.accepted += 1

    def wait_accepted(self, count: int) -> None:
        deadline = time.monotonic() + 30
        while self.accepted < count:
            assert time.monotonic() < deadline, "the watch never connected"
            time.sleep(0.05)

    def drop(self) -> None:
        for conn in self.conns:
            conn.close()
        self.conns.clear()

    def close(self) -> None:
        self.sock.close()
        self.drop()


def history(tmp_path) -> list[dict]:
    path = tmp_path / "state" / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_watch_head_reconnects_a_dropped_connection_and_restarts_when_the_head_is_gone(tmp_path):
    store = Store()
    watch = head_watch("127.0.0.1", store.port, tmp_path)
    try:
        store.wait_accepted(1)
        store.drop()                             # the store drops the idle connection but still listens
        time.sleep(2)                            # ... so the watch checks it for a second, then reconnects
        assert watch.poll() is None and not (tmp_path / "systemctl.log").exists()
        assert store.conns                       # held again
        store.close()                            # the head's vLLM exits: its port closes with it
        out, _ = watch.communicate(timeout=30)
    finally:
        watch.kill()
    assert watch.returncode == 0, out
    assert "closed this connection but still accepts: reconnecting" in out
    assert (tmp_path / "systemctl.log").read_text().split() == ["restart", "--no-block", "vllm-x.service"]
    [record] = history(tmp_path)
    assert record["operation"] == "head-lost-restart" and record["model"] == "x" and record["ok"]
    assert record["by"] == "vllm-x-headwatch.service"


def test_watch_head_leaves_a_node_to_vllm_orch_while_it_holds_the_lock(tmp_path):
    import fcntl

    store = Store()
    (tmp_path / "state").mkdir()
    lock = open(tmp_path / "state" / "deploy.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)              # vllm-orch is stopping or redeploying every node
    watch = head_watch("127.0.0.1", store.port, tmp_path)
    try:
        store.wait_accepted(1)
        store.close()
        time.sleep(2)
        assert watch.poll() is None                  # waits for the lock
        (tmp_path / "unit-pid").write_text("5151\n")   # vllm-orch restarted the unit itself
        lock.close()
        out, _ = watch.communicate(timeout=30)
    finally:
        watch.kill()
    assert watch.returncode == 0, out
    assert "vllm-orch holds this host's lock: waiting for it" in out
    assert "vllm-orch stopped or restarted vllm-x.service itself" in out
    assert not (tmp_path / "systemctl.log").exists() and history(tmp_path) == []


def test_watch_head_does_not_restart_a_unit_that_is_not_running(tmp_path):
    store = Store()
    watch = head_watch("127.0.0.1", store.port, tmp_path)
    try:
        store.wait_accepted(1)
        (tmp_path / "unit-state").write_text("deactivating\n")
        store.close()
        out, _ = watch.communicate(timeout=30)
    finally:
        watch.kill()
    assert watch.returncode == 0 and "is deactivating: nothing to restart" in out, out
    assert not (tmp_path / "systemctl.log").exists()
