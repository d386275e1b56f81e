"""The units' probe in watch-head mode as systemd runs it on a headless node, with a stand-in
`systemctl`: `show` answers the unit's ActiveState and MainPID from files the test writes
(<dir>/unit-state, <dir>/unit-pid), anything else is logged to <dir>/systemctl.log; and its root
part (`restart`), as the unit's ExecStopPost=+ runs it after the watch, with that stand-in too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from orchestrator.paths import package_file


def stand_in_env(tmp_path: Path) -> dict:
    return {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}


def root_restart(tmp_path: Path, exit_status: int, operation: str = "head-lost-restart", model: str = "x",
                 *extra: str) -> subprocess.CompletedProcess:
    """The unit's root part after the probe exited `exit_status` ($EXIT_STATUS, as systemd sets it
    for ExecStopPost=), for unit vllm-MODEL.service with the stand-in systemctl of head_watch."""
    by = f"vllm-{model}-headwatch.service" if operation == "head-lost-restart" else f"vllm-{model}-health.timer"
    return subprocess.run(
        [sys.executable, "-I", "-S", str(package_file("host", "remote", "unit_probe.py")), "restart", "--unit",
         f"vllm-{model}.service", "--model", model, "--state-dir", str(tmp_path / "state"), "--operation", operation,
         "--by", by, *extra], capture_output=True, text=True, timeout=60,
        env={**stand_in_env(tmp_path), "EXIT_STATUS": str(exit_status)})


def stand_in_systemctl(tmp_path: Path, control_group: str = "/system.slice/vllm-x.service") -> None:
    """<tmp_path>/bin/systemctl: `show -p ActiveState|MainPID|ControlGroup` from <tmp_path>/unit-state,
    unit-pid, unit-cgroup; anything else logged to <tmp_path>/systemctl.log."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (tmp_path / "unit-state").write_text("active\n")
    (tmp_path / "unit-pid").write_text("4242\n")
    (tmp_path / "unit-cgroup").write_text(control_group + "\n")
    (bindir / "systemctl").write_text(f"""#!/bin/sh
case "$1 $3" in
  "show ActiveState") cat {tmp_path / "unit-state"} ;;
  "show ControlGroup") cat {tmp_path / "unit-cgroup"} ;;
  show*) cat {tmp_path / "unit-pid"} ;;
  *) echo "$@" >> {tmp_path / "systemctl.log"} ;;
esac
""")
    (bindir / "systemctl").chmod(0o755)


def head_watch(address: str, port: int, tmp_path: Path) -> subprocess.Popen:
    """`vllm-orch-probe.py watch-head` for unit vllm-x.service (active, MainPID 4242 unless the test
    writes otherwise), its state folder <tmp_path>/state."""
    stand_in_systemctl(tmp_path)
    return subprocess.Popen(
        [sys.executable, "-I", str(package_file("host", "remote", "unit_probe.py")), "watch-head", "--unit",
         "vllm-x.service", "--model", "x", "--address", address, "--port", str(port), "--poll", "0.2",
         "--state-dir", str(tmp_path / "state")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=stand_in_env(tmp_path))
