"""One liveness rule for the simulated GPU host, read from /proc by the sim programs (stdlib only: a
bare python3 in a container runs them too, and importing psutil was most of each nvidia-smi call):
the start-time identity is what psutil reads, and a zombie or a reused PID holds no GPU memory."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil

from orchestrator.sim import manager


def test_start_time_is_what_psutil_reads():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        p = psutil.Process(proc.pid)
        assert manager.start_time(proc.pid) == round(p.create_time() - psutil.boot_time(), 2)
    finally:
        proc.kill()
        proc.wait()


def test_zombies_and_reused_pids_hold_no_gpu_memory(sim_host):
    live = subprocess.Popen(["sleep", "60"])
    zombie = subprocess.Popen(["true"])
    while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.02)
    procs = sim_host.dir / "gpu-procs"
    rows = [(live.pid, manager.start_time(live.pid), 0),          # counts
            (zombie.pid, manager.start_time(zombie.pid), 1),      # exited, not reaped
            (live.pid, manager.start_time(live.pid) - 5.0, 2)]    # "the same PID", another process
    for pid, st, gpu in rows:
        (procs / f"{pid}-{gpu}.json").write_text(json.dumps(
            {"pid": pid, "process_name": "VLLM::Worker_TP0", "gpu_index": gpu, "used_mib": 1000,
             "start_time": st}))
    smi = str(sim_host.dir / "bin" / "nvidia-smi")
    query = ["--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"]
    try:
        venv = subprocess.run([sys.executable, smi, *query], capture_output=True, text=True).stdout
        bare = subprocess.run([sys.executable, "-S", smi, *query], capture_output=True, text=True).stdout
        assert venv == bare                                    # no site-packages needed
        assert [line.split(",")[0] for line in venv.splitlines()] == [str(live.pid)]
        assert manager.alive(live.pid, manager.start_time(live.pid))
        assert not manager.alive(zombie.pid) and not manager.alive(live.pid, rows[2][1])
    finally:
        live.kill()
        live.wait()
        zombie.wait()
