"""Issue 26, finding 2, on a real systemd (a SIMULATED GPU host in a systemd-nspawn container): the
health timer's restarts do not use up the unit's start limit. systemd counts every start against
StartLimitBurst=, `systemctl restart` too (systemd.unit(5)): with StartLimitBurst=3, a deploy and
two health restarts inside the window had the third restart refused (start-limit-hit) and the
service down. The root part now flushes the counter first (`systemctl reset-failed`, systemctl(1)),
so three deliberate restarts leave the unit startable; a crash loop is still bounded by systemd
(tests/integration/test_systemd_units.py, a failure late in every load)."""

from __future__ import annotations

import time

import pytest

from orchestrator.host.connect import open_host
from orchestrator.host.state import read_history
from orchestrator.ops.status import host_status
from orchestrator.sim import manager

from .deployhelp import deploy, tuned

pytestmark = pytest.mark.systemd
PORT = 8000


def show(host, unit: str) -> dict:
    r = host.run(["systemctl", "show", unit, "-p", "ActiveState,SubState,Result,NRestarts,MainPID"])
    return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)


def test_three_health_restarts_inside_the_window_leave_the_unit_startable(clean_systemd_sim):
    home, e = clean_systemd_sim
    m = tuned("minimax-m25", PORT, startup={"start_attempts": 3, "restart_delay_seconds": 1},
              probes={"health_interval_seconds": 2, "health_failures": 2, "health_timeout_seconds": 2},
              vllm={"shutdown_timeout": 2})           # a hung server cannot drain: do not wait 30 s for it
    # each of the next three starts serves for 20 s (the deploy's gates pass), then its engine hangs:
    # three health restarts
    manager.add_fault("sim", "hang-after-ready", model=m.name, home=home, after=20, times=3)
    t0 = time.monotonic()
    assert deploy(e, m).ok                                         # start 1 (of StartLimitBurst=3)
    with open_host(e) as host:
        deadline = time.monotonic() + 400
        while True:
            restarts = [r for r in read_history(host, e) if r.operation == "health-restart"]
            st = show(host, m.unit_name)
            if len(restarts) >= 3 and st["ActiveState"] == "active":
                break
            assert st["ActiveState"] != "failed", (st, [r.shown() for r in restarts])
            assert time.monotonic() < deadline, (st, [r.shown() for r in restarts])
            time.sleep(1)
        # the fourth start (after three deliberate restarts) serves, and stays up: no more hangs armed
        time.sleep(8)
        st = show(host, m.unit_name)
        journal = host.run(["journalctl", "-u", m.unit_name, "-o", "cat", "-n", "400"]).stdout
    print(f"three health restarts, then serving: {time.monotonic() - t0:.0f} s")
    assert st["ActiveState"] == "active", st
    assert "Start request repeated too quickly" not in journal
    assert all(r.shown()["ok"] for r in restarts[:3])
    status = host_status(e, lambda _m: PORT)
    assert status.state == "ready", status.state_reason
