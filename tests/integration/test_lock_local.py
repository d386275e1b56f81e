"""The host lock's own guarantees, on this machine (LocalHost, real flock): a controller that stops
sending heartbeats frees the host within IDLE_S; after its lock process is gone, a run re-takes the
lock only if nobody held it meanwhile (the token in deploy.lock.json), else it gets LockLost."""

from __future__ import annotations

import time

import pytest

from orchestrator.config.inventory import HostEntry
from orchestrator.host.local import LocalHost
from orchestrator.host.state import HostLock, LockLost, lock_holder
from tests.plugins.sim_hosts import wait_until


@pytest.fixture
def place(tmp_path):
    entry = HostEntry(name="h", address="local", state_dir=str(tmp_path / "state"),
                      models_root=str(tmp_path / "models"))
    return LocalHost("h"), entry


def wait_free(host, entry, budget: float) -> float:
    t0 = time.monotonic()
    while lock_holder(host, entry) is not None:
        assert time.monotonic() - t0 < budget, "the lock was not freed"
        time.sleep(0.1)
    return time.monotonic() - t0


def wait_gone(lock: HostLock, budget: float) -> None:
    """Until the lock's own process has exited. The kernel frees the flock when that process closes
    its files, a moment before the process is a zombie that poll() sees: a free lock alone does not
    yet mean `ensure()` sees its process gone (CI hit that moment once)."""
    wait_until(lambda: lock._proc is None or not lock._proc.alive(), budget, "the lock process exited")


def test_a_silent_controller_frees_the_lock(place, monkeypatch):
    host, entry = place
    monkeypatch.setattr(HostLock, "IDLE_S", 2)
    monkeypatch.setattr(HostLock, "PING_S", 3600.0)      # a controller stuck (or a dead link): no heartbeat
    lock = HostLock(host, entry, "deploy x")
    lock.acquire()
    assert lock_holder(host, entry)["token"] == lock.token
    assert wait_free(host, entry, 15) < 15
    lock.release()


def test_heartbeats_keep_it(place, monkeypatch):
    host, entry = place
    monkeypatch.setattr(HostLock, "IDLE_S", 2)
    monkeypatch.setattr(HostLock, "PING_S", 0.3)
    with HostLock(host, entry, "deploy x") as lock:
        time.sleep(5)
        assert lock_holder(host, entry)["token"] == lock.token and lock.ensure() is None


def test_retake_only_when_nobody_held_it_meanwhile(place, monkeypatch):
    host, entry = place
    monkeypatch.setattr(HostLock, "IDLE_S", 1)
    monkeypatch.setattr(HostLock, "PING_S", 3600.0)
    first = HostLock(host, entry, "deploy a")
    first.acquire()
    wait_free(host, entry, 15)                           # its lock process is gone: nobody else came
    wait_gone(first, 15)
    assert "re-took" in first.ensure()
    assert lock_holder(host, entry)["token"] == first.token
    first.release()
    wait_free(host, entry, 15)

    first = HostLock(host, entry, "deploy a")
    first.acquire()
    wait_free(host, entry, 15)
    second = HostLock(host, entry, "deploy b")           # someone took it meanwhile, and left again
    second.acquire()
    second.release()
    wait_free(host, entry, 15)
    wait_gone(first, 15)
    with pytest.raises(LockLost, match="held it meanwhile"):
        first.ensure()
    monkeypatch.setattr(HostLock, "PING_S", 0.3)        # deploy c keeps its lock through first's wait
    with HostLock(host, entry, "deploy c"):              # ... or holds it now
        with pytest.raises(LockLost, match="holds it now"):
            first.ensure()


def test_a_watchers_brief_hold_is_waited_out_and_a_long_one_refused(place):
    """The health check's root part takes the lock for the second its restart takes; a deploy that
    starts then waits it out instead of refusing with the last run's record as the holder."""
    import subprocess

    from orchestrator.errors import RefusedError
    host, entry = place
    with HostLock(host, entry, "deploy a"):      # a first run leaves its record in deploy.lock.json
        pass
    path = f"{entry.state_dir}/deploy.lock"
    brief = subprocess.Popen(["flock", "-n", path, "sh", "-c", "echo held; sleep 1"], stdout=subprocess.PIPE, text=True)
    assert brief.stdout.readline().strip() == "held"
    with HostLock(host, entry, "deploy b") as lock:
        assert lock_holder(host, entry)["token"] == lock.token
    brief.wait()
    long = subprocess.Popen(["flock", "-n", path, "sh", "-c", "echo held; sleep 30"], stdout=subprocess.PIPE, text=True)
    try:
        assert long.stdout.readline().strip() == "held"
        with pytest.raises(RefusedError, match="another operation holds the deploy lock"):
            HostLock(host, entry, "deploy c").acquire()
    finally:
        long.kill()
        long.wait()
