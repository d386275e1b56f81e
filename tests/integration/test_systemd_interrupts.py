"""A swap interrupted at each point, on a real-systemd SIMULATED host reached over SSH: Ctrl-C,
SIGTERM and SIGHUP during the readiness wait roll back; one during the download changes nothing;
a second Ctrl-C abandons the rollback; a killed run and a lost connection leave a half-done swap
that status shows, deploy refuses and `swap` finishes or undoes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.host.connect import open_host
from orchestrator.host.state import read_active, read_history
from orchestrator.ops.execute import Reporter
from orchestrator.ops.swap import run_swap
from orchestrator.probe import api
from orchestrator.sim import manager
from tests.plugins.sim_hosts import fired, wait_until

from .deployhelp import deploy, opts, tuned, write_models

pytestmark = pytest.mark.systemd
REPO = Path(__file__).resolve().parents[2]
PORT = 8000


@pytest.fixture
def pair(clean_systemd_sim, tmp_path):
    """minimax-m25 serving (enabled at boot), minimax-m25-ep to swap in; the CLI's environment."""
    home, e = clean_systemd_sim
    old = tuned("minimax-m25", PORT)
    new = tuned("minimax-m25-ep", PORT)
    assert deploy(e, old, enable=True).ok
    models = write_models(tmp_path / "models", [old, new])
    env = dict(os.environ, VLLM_ORCH_STATE_HOME=str(home.parent), VLLM_ORCH_MODELS=str(models))
    return home, e, old, new, env


def cli(env, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=str(REPO))


def sigint_default() -> None:
    """A process started in the background by a shell ignores SIGINT, and so would Python (and
    this CLI) then: a test run in the background must still be able to send Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_swap(env, model: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli.main", "swap", model, "--host", "sim"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(REPO),
                            start_new_session=True,       # a signal reaches the CLI only, as `kill` does
                            preexec_fn=sigint_default)


def read_until(proc: subprocess.Popen, marker: str, seen: list[str]) -> None:
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            return
    raise AssertionError(f"the swap ended before {marker!r}:\n" + "".join(seen))


def hangs_taken(home) -> int:
    return len(fired(manager.host_dir("sim", home), "hang"))


def wait_hang_taken(home, before: int) -> None:
    """Until a server has taken the armed hang fault. It reads it as it starts, and on a busy
    machine that came after swap's readiness wait had begun and a fixed second had passed: the
    interrupt then stopped a server that had not taken it, the fault stayed armed, and the test's
    next swap hung on it (a busy full run on a slower machine, pytest's 300 s timeout)."""
    wait_until(lambda: hangs_taken(home) > before, 120.0, "a server took the hang fault")


def serves(e, model) -> bool:
    with open_host(e) as host:
        ep = api.Endpoint(host, PORT)
        return api.health(ep, timeout=3) == 200 and model.served_name in api.served_models(ep, timeout=3)


def unit(e, model, prop: str = "ActiveState") -> str:
    with open_host(e) as host:
        return host.run(["systemctl", "show", "-p", prop, "--value", model.unit_name]).stdout.strip()


def unit_story(e, model) -> str:
    """What systemd says of a unit and its last lines: the message of an assertion on its state."""
    with open_host(e) as host:
        show = host.run(["systemctl", "show", "-p", "ActiveState,SubState,Result,ExecMainStatus,NRestarts",
                         model.unit_name]).stdout
        journal = host.run(["journalctl", "-u", model.unit_name, "-n", "25", "--no-pager", "-o", "short-monotonic"],
                           timeout=30).stdout
    return show + journal


def swap_record(e) -> dict | None:
    with open_host(e) as host:
        data = host.get(f"{e.state_dir}/swap.json")
    return json.loads(data) if data else None


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["ctrl-c", "sigterm", "sighup"])
def test_an_interrupt_in_the_readiness_wait_puts_the_old_model_back(pair, sig):
    home, e, old, new, env = pair
    manager.add_fault("sim", "hang", model=new.name, home=home)      # the new model never gets ready
    before = hangs_taken(home)
    proc, seen = start_swap(env, new.name), []
    read_until(proc, "] ready:", seen)
    wait_hang_taken(home, before)                 # inside the wait, the hang taken
    assert unit(e, old) == "inactive" and unit(e, new) == "activating"
    t0 = time.monotonic()
    proc.send_signal(sig)
    out = proc.communicate(timeout=300)[0]
    back = time.monotonic() - t0
    print(f"{sig.name}: the previous model serves again {back:.1f} s after the signal")
    assert proc.returncode == 130, "".join(seen) + out
    assert "interrupted" in out and "recovery: roll back to minimax-m25" in out
    assert serves(e, old) and unit(e, new) == "inactive"
    with open_host(e) as host:
        assert read_active(host, e).model == old.name
        last = [h.shown() for h in read_history(host, e)[-2:]]
    assert [r["operation"] for r in last] == ["swap", "rollback"] and last[0]["interrupted"] == "ready"
    assert last[1]["ok"] and last[1]["after"] == f"interrupted swap to {new.name}"
    assert swap_record(e) is None                                   # the swap has ended
    assert unit(e, old, "UnitFileState") == "enabled" and unit(e, new, "UnitFileState") == "disabled"


def test_an_interrupt_during_the_download_changes_nothing(pair):
    """A swap to another checkpoint (minimax-m25-ep shares minimax-m25's weights: it downloads
    nothing) is stopped in its download."""
    home, e, old, new, env = pair
    new = tuned("kimi-k25-nvfp4", PORT)
    write_models(Path(env["VLLM_ORCH_MODELS"]), [new])
    from orchestrator.sim.fault_file import add_fault
    add_fault(manager.host_dir("sim", home), "hub-slow", None, rate_bps=200_000)
    proc, seen = start_swap(env, new.name), []
    read_until(proc, "] download:", seen)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, "".join(seen) + out
    assert "recovery" not in out                                   # nothing was stopped: nothing to roll back
    assert serves(e, old) and unit(e, new) == "inactive" and swap_record(e) is None


def test_a_second_interrupt_abandons_the_rollback_and_swap_finishes_the_swap(pair):
    home, e, old, new, env = pair
    manager.add_fault("sim", "hang", model=new.name, home=home)
    before = hangs_taken(home)
    proc, seen = start_swap(env, new.name), []
    read_until(proc, "] ready:", seen)
    wait_hang_taken(home, before)                 # inside the wait, the hang taken
    proc.send_signal(signal.SIGINT)
    read_until(proc, "recovery: roll back", seen)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, "".join(seen) + out
    assert "abandoned" in out and f"vllm-orch swap {new.name} --host sim" in out
    half = swap_record(e)
    assert half and half["from"] == old.name and half["to"] == new.name
    status = json.loads(cli(env, "status", "--host", "sim", "--json").stdout)[0]
    assert status["interrupted_swap"]["to"] == new.name
    assert f"vllm-orch swap {new.name} --host sim" in status["interrupted_swap"]["hint"]
    again = cli(env, "swap", new.name, "--host", "sim")             # the hang fault is spent
    assert again.returncode == 0, again.stdout + again.stderr
    assert serves(e, new) and swap_record(e) is None
    with open_host(e) as host:
        assert read_active(host, e).model == new.name
    assert unit(e, new, "UnitFileState") == "enabled" and unit(e, old, "UnitFileState") == "disabled"


def test_a_killed_swap_is_shown_by_status_refused_by_deploy_and_converged_by_swap(pair):
    """SIGKILL leaves the host exactly as a connection lost for good does: nothing on this side
    runs again. The new model hangs, so the re-run swap resumes it, fails it and rolls back."""
    home, e, old, new, env = pair
    # The re-run swap must see the hang for what it is, soon: a short no-progress window, here only
    # (a loaded machine can leave 6 s between two lines of a load that progresses).
    new = tuned("minimax-m25-ep", PORT, startup={"no_progress_seconds": 6})
    write_models(Path(env["VLLM_ORCH_MODELS"]), [old, new])
    manager.add_fault("sim", "hang", model=new.name, home=home, times=2)
    before = hangs_taken(home)
    proc, seen = start_swap(env, new.name), []
    read_until(proc, "] ready:", seen)
    wait_hang_taken(home, before)                 # inside the wait, the hang taken
    proc.kill()
    proc.wait(30)
    assert swap_record(e)["to"] == new.name and unit(e, old) == "inactive"
    status = cli(env, "status", "--host", "sim")
    assert "half-done swap" in status.stdout and f"vllm-orch swap {new.name} --host sim" in status.stdout
    refused = cli(env, "deploy", old.name, "--host", "sim")
    assert refused.returncode == 3 and "a swap from minimax-m25 to minimax-m25-ep" in refused.stderr
    again = cli(env, "swap", new.name, "--host", "sim")
    assert again.returncode == 1, again.stdout + again.stderr      # the new model still hangs ...
    assert "rollback: minimax-m25 serves again" in again.stdout + again.stderr
    assert serves(e, old) and swap_record(e) is None                # ... and the old one is back


def drop_connection_at_ready(monkeypatch, e, unreachable: bool):
    """Cut this process's SSH connection 1 s into the readiness wait (and keep the host out of
    reach when `unreachable`, by taking down its veth)."""
    import orchestrator.ops.session as session_mod

    opened = []
    real_open = session_mod.open_host
    monkeypatch.setattr(session_mod, "open_host", lambda *a, **k: opened.append(real_open(*a, **k)) or opened[-1])
    veth = f"vorch{e.address.split('.')[2]}"

    class Cut(Reporter):
        def step_start(self, index, total, action):
            if action.step == "ready" and not getattr(self, "done", False):
                self.done = True

                def cut():
                    time.sleep(1.0)
                    opened[0].transport().sock.shutdown(socket.SHUT_RDWR)   # the host sees it end
                    if unreachable:
                        time.sleep(0.3)
                        subprocess.run(["ip", "link", "set", veth, "down"], check=True)
                threading.Thread(target=cut, daemon=True).start()

    return Cut(None, quiet=True), veth


def test_a_dropped_connection_reconnects_and_rolls_back(pair, monkeypatch):
    home, e, old, new, env = pair
    manager.add_fault("sim", "hang", model=new.name, home=home)
    reporter, _ = drop_connection_at_ready(monkeypatch, e, unreachable=False)
    result = run_swap(e, new, {old.name: old, new.name: new}, opts(budget_s=600), reporter, dry_run=False)
    assert not result.ok and "lost the connection" in str(result.error)
    assert result.extra["rollback"]["ok"], result.extra
    assert serves(e, old) and swap_record(e) is None


@pytest.mark.timeout(480)      # the wait for the stale lock below (up to ~70 s) comes on top of two swaps
def test_a_host_out_of_reach_keeps_the_swap_half_done_until_swap_goes_back(pair, monkeypatch):
    home, e, old, new, env = pair
    manager.add_fault("sim", "hang", model=new.name, home=home)
    reporter, veth = drop_connection_at_ready(monkeypatch, e, unreachable=True)
    try:
        result = run_swap(e, new, {old.name: old, new.name: new}, opts(budget_s=600), reporter, dry_run=False)
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=True)
    assert not result.ok and result.extra.get("half_done")
    assert f"vllm-orch swap {old.name} --host sim" in result.error.hint
    assert swap_record(e)["from"] == old.name                       # written before the stop, still there
    # Undo it: stop the new one, start the old. The cut run's lock process on the host never saw its
    # connection end (no reset crossed the downed link): it frees the lock once a minute passes
    # without a heartbeat, and until then swap says who holds it.
    deadline = time.monotonic() + 150
    while "another operation holds the deploy lock" in (back := cli(env, "swap", old.name, "--host", "sim")).stderr:
        assert time.monotonic() < deadline, back.stderr
        time.sleep(5)
    assert back.returncode == 0, back.stdout + back.stderr
    assert serves(e, old) and swap_record(e) is None
    assert unit(e, new) == "inactive", back.stdout + unit_story(e, new)
    with open_host(e) as host:
        assert read_active(host, e).model == old.name
