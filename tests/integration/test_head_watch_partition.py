"""Issue 26, finding 3: the head watch (unit_probe.py watch-head) after a network blip. Only a refusal
from the head's host (its process is gone, the port closed with it) counts as "gone"; a head that
does not answer at all (a partition, a switch reload, a bond failover: connects time out, no route)
is probed until it answers again, and nothing is restarted. And the root part restarts only under
the host's deploy lock: when vllm-orch holds it, it acts on the unit itself.

The partition is made on the loopback: the head's port is moved to a listener whose accept queue is
full, so the kernel drops every new SYN (connects time out, as across a dead link), then back."""

from __future__ import annotations

import errno
import fcntl
import socket
import time

from tests.integration.probehelp import head_watch, root_restart, stand_in_systemctl
from tests.integration.test_unit_probe import load

from .test_unit_probe import history


def listener(port: int, backlog: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen(backlog)
    return s


class Head:
    """The head's store on the loopback: accepts (a thread-free accept on demand), and can be cut
    off (connects time out) and healed without its port ever refusing."""

    def __init__(self):
        self.sock = listener(0, 8)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.fillers: list[socket.socket] = []
        self.blackhole: socket.socket | None = None

    def accept_one(self, timeout: float = 30) -> None:
        self.sock.settimeout(timeout)
        conn, _ = self.sock.accept()
        self.held.append(conn)

    def partition(self) -> None:
        self.blackhole = listener(self.port, 0)
        self.sock.close()
        for conn in self.held:                       # the held connection breaks (keepalive, a reset)
            conn.close()
        self.held.clear()
        for _ in range(3):                           # fill the one-slot accept queue: SYNs are dropped
            c = socket.socket()
            c.settimeout(0.5)
            try:
                c.connect(("127.0.0.1", self.port))
            except OSError:
                pass
            self.fillers.append(c)

    def heal(self) -> None:
        self.sock = listener(self.port, 8)
        assert self.blackhole is not None
        self.blackhole.close()
        for c in self.fillers:
            c.close()
        self.fillers.clear()


def test_a_partition_is_probed_through_and_nothing_is_restarted(tmp_path):
    head = Head()
    watch = head_watch("127.0.0.1", head.port, tmp_path)
    try:
        head.accept_one()
        head.partition()
        deadline = time.monotonic() + 40
        out = ""
        while "cannot be reached" not in out:
            assert watch.poll() is None, watch.communicate()[0]
            assert time.monotonic() < deadline, "the watch never said the head was unreachable"
            out += watch.stdout.readline()
        time.sleep(6)                                # a few more probes into the partition
        assert watch.poll() is None, watch.communicate()[0]
        head.heal()
        head.accept_one()                            # the watch holds a connection again
        # it says so once its probe's connection is closed: read up to that line before the kill (a
        # kill right after the accept once came first on a loaded machine)
        deadline = time.monotonic() + 40
        while "answers again" not in out:
            assert watch.poll() is None, watch.communicate()[0]
            assert time.monotonic() < deadline, "the watch never said the head answers again"
            out += watch.stdout.readline()
        assert watch.poll() is None
    finally:
        watch.kill()
        rest, _ = watch.communicate()
    out += rest
    assert "not a sign that it is gone" in out and "answers again" in out, out
    assert not (tmp_path / "systemctl.log").exists() and history(tmp_path) == []


def test_only_a_refusal_counts_as_gone(monkeypatch):
    mod = load()

    def raising(exc):
        def create_connection(*_a, **_k):
            raise exc
        return create_connection
    monkeypatch.setattr(mod.socket, "create_connection", raising(ConnectionRefusedError()))
    assert mod.reach("10.0.0.1", 29500, 1) == (None, "refused")
    for exc in (OSError(errno.EHOSTUNREACH, "x"), OSError(errno.ENETUNREACH, "x"), TimeoutError()):
        monkeypatch.setattr(mod.socket, "create_connection", raising(exc))
        sock, why = mod.reach("10.0.0.1", 29500, 1)
        assert sock is None and why != "refused", (exc, why)


def test_the_root_part_restarts_only_under_the_hosts_lock(tmp_path):
    stand_in_systemctl(tmp_path)
    (tmp_path / "state" / "lock").mkdir(parents=True)
    lock = open(tmp_path / "state" / "lock" / "deploy.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)                 # vllm-orch is stopping or redeploying every node
    done = root_restart(tmp_path, 75, "head-lost-restart", "x", "--address", "127.0.0.1", "--port", "1")
    assert done.returncode == 0 and "vllm-orch holds this host's lock" in done.stdout, done.stdout
    assert not (tmp_path / "systemctl.log").exists() and history(tmp_path) == []
    lock.close()
    (tmp_path / "unit-state").write_text("inactive\n")      # stopped meanwhile: nothing to restart
    done = root_restart(tmp_path, 75, "head-lost-restart", "x", "--address", "127.0.0.1", "--port", "1")
    assert done.returncode == 0 and "is inactive: nothing to restart" in done.stdout
    assert not (tmp_path / "systemctl.log").exists()
    (tmp_path / "unit-state").write_text("active\n")
    done = root_restart(tmp_path, 75, "head-lost-restart", "x", "--address", "127.0.0.1", "--port", "1")
    assert done.returncode == 0 and (tmp_path / "systemctl.log").read_text().splitlines()[-1] == \
        "restart --no-block vllm-x.service"
    assert history(tmp_path)[-1]["operation"] == "head-lost-restart"
