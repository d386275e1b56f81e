"""Remote commands do not outlive the controller for long: a command started over SSH runs under
the host's `timeout` with its budget, so when the controller vanishes mid-command (no pty: sshd
sends no SIGHUP, and nobody is left to kill it) it still ends when its budget is spent."""

from __future__ import annotations

import threading
import time

from orchestrator.errors import ConnectError
from orchestrator.host.base import Script
from orchestrator.host.ssh import SshHost


def connect(sshd_local) -> SshHost:
    return SshHost("sshd-local", sshd_local.address, port=sshd_local.port, user=sshd_local.user,
                   identity_file=sshd_local.identity_file, known_hosts_file=sshd_local.known_hosts_file,
                   connect_timeout=5, ssh_config=None)


def test_a_command_ends_with_its_budget_when_the_controller_is_gone(sshd_local):
    gone = connect(sshd_local)
    raised: list[BaseException] = []

    def run_until_cut() -> None:
        try:
            gone.run(Script("sleep 47.31; true"), timeout=2)
        except ConnectError as exc:            # the controller's side: the cut link is a lost connection
            raised.append(exc)

    t = threading.Thread(target=run_until_cut, daemon=True)
    t.start()
    with connect(sshd_local) as probe:
        deadline = time.monotonic() + 10
        while probe.run(["pgrep", "-f", "^sleep 47.31"]).exit_code != 0:
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.05)
        gone._client.get_transport().sock.close()        # the controller's link is cut, not closed cleanly
        started = time.monotonic()
        while probe.run(["pgrep", "-f", "^sleep 47.31"]).exit_code == 0:
            assert time.monotonic() - started < 25, "the command outlived its budget with nobody to stop it"
            time.sleep(0.2)
    t.join(timeout=60)
    assert raised and "lost the connection" in str(raised[0]), raised
