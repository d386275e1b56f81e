"""Cooperative cancellation over SSH (orchestrator/host/cancel.py): Ctrl-C during a blocking remote
command kills the command's process group on the host and closes its channel; the connection stays
usable (against a real OpenSSH sshd on loopback, fixture ssh_host)."""

from __future__ import annotations

import threading
import time

import pytest

from orchestrator.host import cancel
from orchestrator.host.base import Script

pytestmark = pytest.mark.ssh


def test_a_cancel_ends_a_blocking_remote_command_and_its_children(ssh_host):
    with cancel.cancellation() as token:
        threading.Timer(0.5, token.cancel).start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            ssh_host.run(Script("sleep 32.71 & sleep 32.72"), timeout=60)
        assert time.monotonic() - t0 < 20
    deadline = time.monotonic() + 10
    while ssh_host.run(["pgrep", "-f", "^sleep 32.7"]).exit_code == 0:      # the group is gone
        assert time.monotonic() < deadline, "the remote command outlived the cancel"
        time.sleep(0.1)
    assert ssh_host.run(["echo", "still here"]).stdout == "still here\n"       # the connection is usable


def test_a_cancel_that_comes_before_the_commands_pid_mark_is_read_still_ends_it(ssh_host, monkeypatch):
    """The cancel comes before vllm-orch has read the PID mark the remote shell sends first (a loaded
    machine: a Ctrl-C 0.5 s after the start left both sleeps running once their channel closed). Here
    stderr reads as empty until the cancel: the kill must read the mark itself, not give up."""
    import paramiko

    real = paramiko.Channel.recv_stderr_ready
    with cancel.cancellation() as token:
        monkeypatch.setattr(paramiko.Channel, "recv_stderr_ready", lambda self: token.requested and real(self))
        threading.Timer(0.5, token.cancel).start()
        with pytest.raises(KeyboardInterrupt):
            ssh_host.run(Script("sleep 32.81 & sleep 32.82"), timeout=60)
    monkeypatch.undo()
    deadline = time.monotonic() + 10
    while ssh_host.run(["pgrep", "-f", "^sleep 32.8"]).exit_code == 0:      # the group is gone
        assert time.monotonic() < deadline, "the remote command outlived the cancel"
        time.sleep(0.1)
