"""The units' probe (orchestrator/host/remote/unit_probe.py), run here as the host's Python runs it:
`ready` against a simulated vLLM while it loads, crashes or serves; `check`'s counting, its
busy-not-hung rule, and the root part's restart record, with systemctl and HTTP replaced by
stand-ins."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from orchestrator.paths import package_file
from tests.integration.probehelp import head_watch, root_restart, stand_in_env, stand_in_systemctl
from tests.plugins.sim_hosts import SimServer, make_model

SCRIPT = package_file("host", "remote", "unit_probe.py")


def argv(model) -> list[str]:
    return [str(model), "--served-model-name", "kimi", "--trust-remote-code", "-tp", "8", "--max-model-len", "65536"]


def load():
    spec = importlib.util.spec_from_file_location("unit_probe_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ready(port: int, main_pid: int, budget: float = 60, credentials: str | None = None,
          systemctl_dir=None) -> tuple[int, str, float]:
    """The ready probe of unit x.service; with `systemctl_dir`, the stand-in systemctl there
    (probehelp.stand_in_systemctl) says the unit's ControlGroup."""
    t0 = time.monotonic()
    env = dict(stand_in_env(systemctl_dir) if systemctl_dir else os.environ, MAINPID=str(main_pid),
               **({"CREDENTIALS_DIRECTORY": credentials} if credentials else {}))
    proc = subprocess.run([sys.executable, "-I", str(SCRIPT), "ready", "--unit", "x.service", "--port", str(port),
                           "--served-name", "kimi", "--poll", "0.1"], capture_output=True, text=True,
                          timeout=budget, env=env)
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


def test_ready_sends_the_api_key_vllm_wants(sim_host, tmp_path, monkeypatch):
    """From a credential (LoadCredential= of the env file, as systemd lays it out: the health check),
    in any of the three forms the env file writes it, or from its unit's environment (ready)."""
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "service-env").write_text("CUDA_VISIBLE_DEVICES=0\nVLLM_API_KEY=\"k-'1\\$2\"\n")
    model = make_model(sim_host.dir, "kimi-k25-int4", "moonshotai/Kimi-K2.5")
    with SimServer(sim_host, argv(model), env={"VLLM_API_KEY": "k-'1$2"}) as srv:
        # the unit's control group: the one the simulated vLLM runs in (this machine's)
        stand_in_systemctl(tmp_path, own_cgroup(srv.proc.pid))
        code, out, _ = ready(srv.port, srv.proc.pid, credentials=str(creds), systemctl_dir=tmp_path)
        assert code == 0, out
        monkeypatch.setenv("VLLM_API_KEY", "k-'1$2")
        code, out, _ = ready(srv.port, srv.proc.pid, systemctl_dir=tmp_path)
        assert code == 0, out


def own_cgroup(pid: int) -> str:
    lines = open(f"/proc/{pid}/cgroup").read().splitlines()
    return next(line.split(":", 2)[2] for line in lines if line.startswith("0::") or ":name=systemd:" in line)


ATTACKER = r"""
import json, socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(16)
print("listening", flush=True)
while True:
    c, _ = s.accept()
    data = c.recv(65536).decode(errors="replace")
    with open(sys.argv[2], "a") as f:
        f.write(data.replace("\r\n", "\n") + "\n--\n")
    body = json.dumps({"data": [{"id": "kimi"}], "choices": [{"text": "x"}]}).encode()
    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
              b"Connection: close\r\n\r\n%s" % (len(body), body))
    c.close()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the port is held by another user")
def test_ready_never_sends_the_key_to_another_user_holding_the_port(tmp_path, open_dir_for_nobody):
    """While vLLM loads, its socket is bound but not listening (vLLM binds early, listens once the
    engine is up): another local user can listen on 127.0.0.1 at the same port, answer /health
    and /v1/models, and was sent `Bearer <key>`. The probe now sends the key only to a process of
    its unit's control group: the stranger gets no key, the probe says so and keeps waiting."""
    import pwd

    vllm_sock = socket.socket()                       # the service's socket: bound, not listening
    vllm_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    vllm_sock.bind(("0.0.0.0", 0))
    port = vllm_sock.getsockname()[1]
    seen = open_dir_for_nobody / "requests"
    nobody = pwd.getpwnam("nobody")
    attacker = subprocess.Popen(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
                                 "/usr/bin/python3", "-c", ATTACKER, str(port), str(seen)], stdout=subprocess.PIPE,
                                text=True, cwd="/")   # the system Python: this venv lies under /root (0700)
    (tmp_path / "creds").mkdir()
    (tmp_path / "creds" / "service-env").write_text("VLLM_API_KEY=sk-not-for-you\n")
    stand_in_systemctl(tmp_path)                      # the unit's group: /system.slice/vllm-x.service
    try:
        assert attacker.stdout.readline().strip() == "listening"
        env = dict(stand_in_env(tmp_path), MAINPID=str(os.getpid()), CREDENTIALS_DIRECTORY=str(tmp_path / "creds"),
                   VLLM_API_KEY="sk-not-for-you")      # the readiness probe has it from its unit's environment
        probe = subprocess.Popen([sys.executable, "-I", str(SCRIPT), "ready", "--unit", "x.service", "--port", str(port),
                                  "--served-name", "kimi", "--poll", "0.2"], stdout=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + 30
        while "GET /health" not in (seen.read_text() if seen.exists() else "") or seen.read_text().count("--") < 3:
            assert time.monotonic() < deadline and probe.poll() is None, "the probe never asked the stranger"
            time.sleep(0.1)
        probe.terminate()
        out, _ = probe.communicate(timeout=10)
        asked = seen.read_text()
        assert "GET /health" in asked and "sk-not-for-you" not in asked and "Authorization" not in asked, asked
        assert f"the process listening on port {port} is not x.service's: the API key was not sent" in out, out
    finally:
        attacker.kill()
        vllm_sock.close()


@pytest.fixture
def open_dir_for_nobody():
    """A folder in /tmp another user can write into (pytest's tmp_path sits under a 0700 folder)."""
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="vllm-orch-stranger-", dir="/tmp")
    os.chmod(path, 0o777)
    yield __import__("pathlib").Path(path)
    shutil.rmtree(path)


def test_a_credential_is_the_only_source_of_the_key_when_the_unit_has_one(monkeypatch, tmp_path):
    """The health check runs without the service's environment, its key comes from its credential;
    with a credential nothing of the environment counts (the readiness probe, a command of the
    service's own unit, has no credential: its unit's environment is the service's)."""
    mod = load()
    monkeypatch.setenv("VLLM_API_KEY", "from-the-environment")
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    assert mod.api_key() == "from-the-environment"
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    assert mod.api_key() is None                    # a credential without the key: no key, not the env's
    (tmp_path / "service-env").write_text("HF_TOKEN='x y'\nVLLM_API_KEY=plain\n")
    assert mod.api_key() == "plain"


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
        monkeypatch.setattr(mod, "engine_progress", lambda port: next(seq))
        args = ["check", "--unit", "vllm-m.service", "--port", "1", "--served-name", "m", "--model", "m",
                "--failures", str(failures), "--timeout", "2", "--state-dir", str(tmp_path)]
        return mod.main(args)

    def state():
        return json.loads((tmp_path / "health" / "m.json").read_text())

    def history():
        path = tmp_path / "history.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    run.module = mod
    run.state_dir = tmp_path
    return run, state, history, calls


def restart_part(check, exit_status: int):
    """The health unit's root part (ExecStopPost=+) after the check exited `exit_status`."""
    run, *_ = check
    mod = run.module
    os.environ["EXIT_STATUS"] = str(exit_status)
    # the restart ignores SIGTERM for the rest of its process (its own, on a host): here that is
    # the pytest worker's, whose later subprocesses would inherit it (tests/plugins/isolation.py)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        return mod.main(["restart", "--unit", "vllm-m.service", "--model", "m", "--state-dir",
                         str(run.state_dir), "--operation", "health-restart", "--by", "vllm-m-health.timer"])
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        del os.environ["EXIT_STATUS"]


def test_check_counts_failures_and_asks_for_a_restart_after_n_in_a_row(check):
    """The check (the service user's) only counts and notes; the restart and its history record are
    the root part's, which acts only when the check exited RESTART_EXIT."""
    run, state, history, calls = check
    hung = (False, "a one-token completion did not answer within 2s")
    frozen = {"0": {"generation_tokens": 100.0, "running": 1.0}}
    assert run(hung, (frozen, frozen)) == 1 and state()["failures"] == 1 and not calls
    assert restart_part(check, 1) == 0 and not calls and not history()     # a failed check: nothing to do
    assert run((True, "")) == 0 and state()["failures"] == 0            # a success resets the count
    run(hung, (frozen, frozen))
    assert run(hung, (frozen, frozen)) == 75 and not calls and not history()   # the second in a row
    assert state()["failures"] == 0 and state()["restarts"] == 1
    assert restart_part(check, 75) == 0
    assert calls == [["systemctl", "reset-failed", "vllm-m.service"], ["systemctl", "restart", "--no-block", "vllm-m.service"]]
    rec = history()[-1]
    assert rec["operation"] == "health-restart" and rec["model"] == "m" and rec["ok"] is True
    assert rec["reason"] == "2 health checks failed in a row, the last: " + hung[1] and rec["failures"] == 2
    assert rec["by"] == "vllm-m-health.timer"


def test_a_busy_server_is_not_a_hung_one(check):
    run, state, history, calls = check
    slow = (False, "a one-token completion did not answer within 2s")
    before, after = {"0": {"generation_tokens": 100.0}}, {"0": {"generation_tokens": 164.0}}
    assert run(slow, (before, after), failures=1) == 76                  # tokens flowed meanwhile
    assert state()["last"]["ok"] is True and "vllm:generation_tokens +64" in state()["last"]["note"]
    assert run(slow, (after, {"0": {"generation_tokens": 200.0}}), failures=1) == 0   # the same run of busy checks
    assert state()["busy_checks"] == 2
    assert not calls and not history()
    assert run((False, "/health answered 503 (the engine is dead)"), failures=1) == 75
    assert restart_part(check, 75) == 0
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
    assert watch.returncode == 75, out           # the watch (the service user's) asks; root restarts
    assert "closed this connection but still accepts: reconnecting" in out
    assert not (tmp_path / "systemctl.log").exists() and history(tmp_path) == []
    done = root_restart(tmp_path, watch.returncode, "head-lost-restart", "x", "--address", "127.0.0.1",
                        "--port", str(store.port))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "systemctl.log").read_text().split() == ["reset-failed", "vllm-x.service", "restart", "--no-block",
                                                                 "vllm-x.service"]
    [record] = history(tmp_path)
    assert record["operation"] == "head-lost-restart" and record["model"] == "x" and record["ok"]
    assert record["by"] == "vllm-x-headwatch.service"


def test_watch_head_leaves_a_node_to_vllm_orch_while_it_holds_the_lock(tmp_path):
    import fcntl

    store = Store()
    (tmp_path / "state" / "lock").mkdir(parents=True)
    lock = open(tmp_path / "state" / "lock" / "deploy.lock", "w")
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


def test_the_root_part_reads_the_service_users_state_file_as_data_only(check, tmp_path):
    """health/NAME.json is the service user's: the root part never follows a link there (to read a
    root-only file into the world-readable history) and takes only a bounded reason string."""
    run, state, history, calls = check
    secret = tmp_path / "root-only.json"
    secret.write_text(json.dumps({"restart_reason": "the content of a root-only file"}))
    (tmp_path / "health").mkdir(exist_ok=True)
    (tmp_path / "health" / "m.json").symlink_to(secret)
    assert restart_part(check, 75) == 0
    assert history()[-1]["reason"] == "the health check asked for a restart"
