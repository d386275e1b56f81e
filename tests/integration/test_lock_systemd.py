"""The lock means something, on a real-systemd host reached over real SSH: when the connection of a
deploy that holds the host lock drops, the host frees the lock (its flock process reads EOF); a
second deploy may then take it. The first one must not go on unlocked: before each further step
(and before any recovery step) it proves it still holds the lock, or re-takes it and proves nobody
held it meanwhile; here someone did, so it stops and changes nothing more."""

from __future__ import annotations

import json
import threading
import time

import pytest

from orchestrator.host.connect import open_host
from orchestrator.host.state import lock_holder, read_json
from orchestrator.ops import session as session_mod
from orchestrator.ops.deploy import run_deploy
from orchestrator.ops.execute import Reporter
from orchestrator.ops.stop import stop_model
from orchestrator.plan.run import Options

from .deployhelp import on_port

pytestmark = pytest.mark.systemd


class Steps(Reporter):
    """Records (time, step, status) of every step and recovery step."""

    def __init__(self):
        super().__init__(None, quiet=True)
        self.log: list[tuple[float, str, str]] = []
        self.current: str | None = None

    def step_start(self, index, total, action):
        self.current = action.step
        self.log.append((time.monotonic(), action.step, "start"))

    def step_end(self, res):
        self.log.append((time.monotonic(), res.step, res.status))


def wait(predicate, budget: float, what: str):
    deadline = time.monotonic() + budget
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what} not within {budget} s"
        time.sleep(0.1)
    return value


def test_a_dropped_connection_never_lets_two_deploys_run_at_once(systemd_sim_host, monkeypatch):
    entry, _, hdir = systemd_sim_host
    m = on_port("minimax-m25")
    opts = Options(budget_s=90, no_progress_s=60, poll_s=0.2, gpu_release_timeout_s=20)
    hosts = []
    real_open = session_mod.open_host

    def spy(e, accept=False):
        hosts.append(real_open(e, accept))
        return hosts[-1]

    monkeypatch.setattr(session_mod, "open_host", spy)
    paused = threading.Event()
    resume = threading.Event()
    results = {}
    a_steps, b_steps = Steps(), Steps()

    def deploy(name, reporter):
        results[name] = run_deploy(entry, m, opts, reporter, dry_run=False)

    a = threading.Thread(target=deploy, args=("a", a_steps))
    a.start()
    wait(lambda: a_steps.current == "ready" or not a.is_alive(), 240, "deploy A reaching its ready step")
    assert a.is_alive(), results.get("a") and results["a"].error
    host_a = hosts[0]
    real_transport = host_a.transport

    def gated():                      # A's controller stalls (e.g. a laptop suspended) ...
        if paused.is_set():
            resume.wait(120)
        return real_transport()

    host_a.transport = gated
    paused.set()
    with open_host(entry) as probe:
        token_a = read_json(probe, f"{entry.state_dir}/deploy.lock.json")["token"]
        host_a._client.get_transport().close()          # ... and its connection drops
        wait(lambda: lock_holder(probe, entry) is None, 30, "the host freeing the lock of the dropped connection")
        dropped_at = time.monotonic()
        b = threading.Thread(target=deploy, args=("b", b_steps))
        b.start()
        wait(lambda: (read_json(probe, f"{entry.state_dir}/deploy.lock.json") or {}).get("token") not in
             (None, token_a) and lock_holder(probe, entry), 60, "deploy B holding the lock")
        resume.set()                                     # A wakes up, reconnects, goes on
        a.join(300)
        b.join(300)
        active = probe.run(["systemctl", "is-active", f"vllm-{m.name}.service"]).stdout.strip()
        history = [json.loads(line) for line in (probe.get(f"{entry.state_dir}/history.jsonl") or b"").splitlines()]
    ra, rb = results["a"], results["b"]
    with open_host(entry) as host:                       # leave the shared host's GPUs free
        stop_model(host, entry, m.name, m.serving.visible_devices)
    # A did nothing after its connection dropped: no step (nor recovery step) of it finished after.
    after = [(step, status) for t, step, status in a_steps.log if t > dropped_at and status == "done"]
    assert after in ([], [("ready", "done")]), a_steps.log          # the read-only wait may finish
    assert not ra.ok and "deploy lock" in str(ra.error) + str(ra.outcome.recovery and ra.outcome.recovery.error)
    if ra.outcome.recovery is not None:
        assert not [r for r in ra.outcome.recovery.results if r.status == "done"], ra.outcome.recovery.results
    # B held the lock and ran its plan; A's service was not stopped under it by A's recovery.
    assert [s for _, s, st in b_steps.log if st == "done"][:1] == ["lock"], b_steps.log
    assert active == "active", (active, rb.error)
    # Only B wrote its deploy to the history: A, without the lock, writes nothing more.
    assert len([h for h in history if h.get("operation") == "deploy" and h.get("model") == m.name]) == 1, history
