"""Root never blocks on what the service user puts in its `health/` folder: a FIFO there (the
service user owns the folder) hung root's readers, which opened with O_NOFOLLOW but without
O_NONBLOCK: the units' root part (`unit_probe.py restart`, reading the check's restart reason) and
the status facts (`facts_script.py`, reading every health/*.json). Both now open non-blocking and
read only a regular file: the FIFO is left out, the rest goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from orchestrator.paths import package_file

from .probehelp import root_restart, stand_in_systemctl


def plant_fifo(state_dir) -> None:
    health = state_dir / "health"
    health.mkdir(parents=True)
    os.mkfifo(health / "x.json")             # no writer ever opens it: a blocking open waits forever
    (health / "y.json").write_text(json.dumps({"ok": True, "at": 1.0}))


def test_a_fifo_for_the_health_state_never_hangs_the_root_part(tmp_path):
    stand_in_systemctl(tmp_path)
    plant_fifo(tmp_path / "state")
    done = root_restart(tmp_path, 75, "health-restart", "x")         # bounded: 60 s
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "systemctl.log").read_text().splitlines()[-1] == "restart --no-block vllm-x.service"
    records = [json.loads(line) for line in (tmp_path / "state" / "history.jsonl").read_text().splitlines()]
    assert records[-1]["operation"] == "health-restart"
    assert records[-1]["reason"] == "the health check asked for a restart"     # the FIFO read as no notes


def test_a_fifo_in_the_health_folder_never_hangs_the_status_facts(tmp_path):
    plant_fifo(tmp_path / "state")
    args = {"ports": [], "models_root": str(tmp_path / "models"), "state_dir": str(tmp_path / "state"),
            "nvidia_smi": "nvidia-smi-absent", "vllm": "/nonexistent/vllm", "manager": "process",
            "models": [], "gpu_query": ["nvidia-smi-absent"], "apps_query": ["nvidia-smi-absent"],
            "status": {"history_tail": 5}}
    out = subprocess.run([sys.executable, "-c", package_file("host", "remote", "facts_script.py").read_text(),
                          json.dumps(args)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["status"]["health"] == {"y": {"ok": True, "at": 1.0}}
