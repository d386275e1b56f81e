"""The units' probe in watch-head mode as systemd runs it on a headless node, with a stand-in
`systemctl`: `show` answers the unit's ActiveState and MainPID from files the test writes
(<dir>/unit-state, <dir>/unit-pid), anything else is logged to <dir>/systemctl.log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from orchestrator.paths import package_file


def head_watch(address: str, port: int, tmp_path: Path) -> subprocess.Popen:
    """`vllm-orch-probe.py watch-head` for unit vllm-x.service (active, MainPID 4242 unless the test
    writes otherwise), its state folder <tmp_path>/state."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (tmp_path / "unit-state").write_text("active\n")
    (tmp_path / "unit-pid").write_text("4242\n")
    (bindir / "systemctl").write_text(f"""#!/bin/sh
case "$1" in
  show) [ "$3" = ActiveState ] && cat {tmp_path / "unit-state"} || cat {tmp_path / "unit-pid"} ;;
  *) echo "$@" >> {tmp_path / "systemctl.log"} ;;
esac
""")
    (bindir / "systemctl").chmod(0o755)
    return subprocess.Popen(
        [sys.executable, str(package_file("host", "remote", "unit_probe.py")), "watch-head", "--unit", "vllm-x.service",
         "--model", "x", "--address", address, "--port", str(port), "--poll", "0.2",
         "--state-dir", str(tmp_path / "state")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"})
