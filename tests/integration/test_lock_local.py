"""The host lock's own guarantees, on this machine (LocalHost, real flock): a controller that stops
sending heartbeats frees the host within IDLE_S; after its lock process is gone, a run re-takes the
lock only if nobody held it meanwhile (the token in deploy.lock.json), else it gets LockLost."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from orchestrator.config.inventory import HostEntry
from orchestrator.host.local import LocalHost
from orchestrator.host.state import HostLock, LockLost, lock_holder
from orchestrator.paths import package_file
from tests.plugins.sim_hosts import wait_until


def lock_file(entry: HostEntry) -> str:
    """The lock's file: 0600 in state_dir/lock/ (host/state.py lock_path)."""
    return f"{entry.state_dir}/lock/deploy.lock"


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
    path = lock_file(entry)
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


# -- the lock's file: another local user can neither open nor hold it --------------------------------
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")


def as_nobody(*argv: str, **kw) -> subprocess.Popen:
    nobody = pwd.getpwnam("nobody")
    return subprocess.Popen(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
                             *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


@pytest.fixture
def open_place():
    """A state_dir every user can reach (a 0755 folder under /tmp), as /var/lib/vllm-orch is."""
    base = tempfile.mkdtemp(prefix="vllm-orch-lock-")
    os.chmod(base, 0o755)
    entry = HostEntry(name="h", address="local", state_dir=f"{base}/state", models_root=f"{base}/models")
    try:
        yield LocalHost("h"), entry
    finally:
        shutil.rmtree(base)


def nobody_holds(path: str) -> subprocess.Popen | None:
    """`flock PATH` as nobody (the attack: a read-only descriptor suffices for flock): the holder
    process once it holds the lock, or None when it could not open the file."""
    holder = as_nobody("flock", "-n", path, "sh", "-c", "echo held; sleep 60")
    line = holder.stdout.readline().strip()
    if line == "held":
        return holder
    holder.wait(timeout=30)
    return None


@needs_root
def test_another_user_can_neither_open_nor_hold_the_lock(open_place):
    """The lock file was 0644 in the readable state_dir: `flock` on a read-only descriptor let any
    local user hold it (deploys refused, the health checks' restarts switched off)."""
    host, entry = open_place
    with HostLock(host, entry, "deploy a"):
        pass
    legacy = f"{entry.state_dir}/deploy.lock"
    for path in (legacy, lock_file(entry)):
        holder = nobody_holds(path)
        if holder is not None:
            holder.kill()
            holder.wait()
        assert holder is None, f"nobody holds {path}"
        opened = as_nobody(sys.executable, "-I", "-c", f"open({path!r})")
        assert opened.wait(timeout=30) != 0 and "Permission denied" in opened.stdout.read()
    folder, file = os.stat(os.path.dirname(lock_file(entry))), os.stat(lock_file(entry))
    assert (folder.st_uid, stat.S_IMODE(folder.st_mode)) == (0, 0o711)
    assert (file.st_uid, stat.S_IMODE(file.st_mode)) == (0, 0o600)
    with HostLock(host, entry, "deploy b") as lock:           # nobody could hold it: free
        assert lock_holder(host, entry)["token"] == lock.token


@needs_root
def test_a_host_with_the_previous_lock_file_is_moved_and_excludes_older_runs(open_place):
    """state_dir/deploy.lock of an older vllm-orch, held by another user (anyone could): ignored, and
    made a link to the new lock, so an older vllm-orch run (which flocks that path as root) and a
    new one exclude each other. Held by root (an older vllm-orch at work): the lock is busy."""
    from orchestrator.errors import RefusedError

    host, entry = open_place
    legacy = f"{entry.state_dir}/deploy.lock"
    os.makedirs(entry.state_dir)
    with open(legacy, "w") as f:
        os.fchmod(f.fileno(), 0o644)
    squatter = nobody_holds(legacy)
    assert squatter is not None                               # the old file: anyone could hold it
    try:
        with HostLock(host, entry, "deploy a") as lock:
            assert os.readlink(legacy) == "lock/deploy.lock"
            assert lock_holder(host, entry)["token"] == lock.token
            old_run = subprocess.run(["flock", "-n", legacy, "true"], timeout=30)
            assert old_run.returncode != 0                    # an older vllm-orch waits for this run
    finally:
        squatter.kill()
        squatter.wait()
    os.unlink(legacy)                                         # an older vllm-orch made its file again...
    old_run = subprocess.Popen(["flock", "-n", legacy, "sh", "-c", "echo held; sleep 60"], stdout=subprocess.PIPE,
                               text=True)                     # ... and holds it, as root
    try:
        assert old_run.stdout.readline().strip() == "held"
        with pytest.raises(RefusedError, match="another operation holds the deploy lock"):
            HostLock(host, entry, "deploy b").acquire()
        assert lock_holder(host, entry) is not None
    finally:
        old_run.kill()
        old_run.wait()
    with HostLock(host, entry, "deploy c"):
        assert os.readlink(legacy) == "lock/deploy.lock"


@needs_root
def test_the_unit_probe_sees_the_lock_held_without_opening_it(open_place, tmp_path):
    """The head watch runs as the service user, who cannot open the 0600 lock: it reads the flock
    from /proc/locks. The root part takes it without waiting."""
    host, entry = open_place
    probe = os.path.join(os.path.dirname(entry.state_dir), "probe.py")
    shutil.copy(package_file("host", "remote", "unit_probe.py"), probe)
    os.chmod(probe, 0o644)
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('p', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "print(m.lock_held(sys.argv[2]), m.lock_nb(sys.argv[2]) is False)")

    def probe_says(user_nobody: bool) -> str:
        argv = [sys.executable, "-I", "-S", "-c", code, probe, entry.state_dir]
        p = as_nobody(*argv) if user_nobody else subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        out, _ = p.communicate(timeout=60)
        return out.strip()

    assert probe_says(True) == "False False"                 # no lock file yet: free
    with HostLock(host, entry, "deploy a"):
        assert probe_says(True) == "True False"              # nobody: held (lock_nb cannot open it)
        assert probe_says(False) == "True True"              # root: held, not taken
    assert probe_says(True) == "False False" and probe_says(False) == "False False"
