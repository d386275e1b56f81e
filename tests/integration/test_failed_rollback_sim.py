"""A swap whose new model fails and whose rollback fails too, on the default SIMULATED host: nothing
serves. `status` must not call that fine (it exited 0), and the swap that recovers must not report
`downtime: 0.0s` (nothing served before it)."""

from __future__ import annotations

import json
import subprocess
import sys

from orchestrator.sim import manager

from .deployhelp import SHIPPED, cli_env, deploy, entry, swap, write_models


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_failed_rollback_is_a_status_exit_1_and_the_recovery_reports_no_false_downtime(sim_host, tmp_path):
    old, new = SHIPPED["kimi-k25-int4"], SHIPPED["kimi-k25-nvfp4"]
    e = entry(sim_host)
    assert deploy(e, old).ok
    env = dict(cli_env(sim_host, write_models(tmp_path / "models", [old, new])), NO_COLOR="1", COLUMNS="200")
    assert cli(env, "status", "--host", "sim").returncode == 0
    manager.add_fault("sim", "crash-no-kv-memory", model=new.name, home=sim_host.home)
    manager.add_fault("sim", "crash-no-kv-memory", model=old.name, home=sim_host.home)   # its rollback too
    failed = swap(e, new, {old.name: old, new.name: new})
    assert not failed.ok and failed.extra["rollback"]["ok"] is False, failed.extra

    st = cli(env, "status", "--host", "sim")
    assert st.returncode == 1, st.stdout + st.stderr
    assert "failed" in st.stdout and "needs attention" in st.stderr, st.stderr
    as_json = cli(env, "status", "--host", "sim", "--json")
    assert as_json.returncode == 1 and json.loads(as_json.stdout)[0]["reachable"] is True
    prom = cli(env, "status", "--host", "sim", "--prometheus")        # a textfile collector's cron: the
    assert prom.returncode == 0, prom.stderr                            # state is in the figures, not the exit

    again = cli(env, "swap", new.name, "--host", "sim", "--yes")
    assert again.returncode == 0, again.stdout + again.stderr
    said = " ".join(again.stdout.split())
    assert "downtime: 0.0s" not in said and "nothing served before this swap" in said, again.stdout
    assert cli(env, "status", "--host", "sim").returncode == 0
