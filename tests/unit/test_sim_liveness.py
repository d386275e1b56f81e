"""One liveness rule for the simulated GPU host, read with psutil when the Python running the sim
programs has it and from /proc when it has not (`python -S`, like a bare python3 in a container):
the start-time identity is the same both ways, and a zombie or a reused PID holds no GPU memory."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from orchestrator.paths import package_file
from orchestrator.sim import manager

SIM_DIR = package_file("sim", "nvidia_smi.py").parent


def start_time_without_psutil(pid: int) -> float:
    code = (f"import sys; sys.path.insert(0, {str(SIM_DIR)!r}); import nvidia_smi as n; "
            f"assert n.psutil is None; print(n.proc_start_time({pid}))")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return float(out.stdout)


def test_start_time_is_the_same_with_and_without_psutil():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert manager.start_time(proc.pid) == start_time_without_psutil(proc.pid)
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
        with_psutil = subprocess.run([sys.executable, smi, *query], capture_output=True, text=True).stdout
        by_hand = subprocess.run([sys.executable, "-S", smi, *query], capture_output=True, text=True).stdout
        assert with_psutil == by_hand
        assert [line.split(",")[0] for line in with_psutil.splitlines()] == [str(live.pid)]
        assert manager.alive(live.pid, manager.start_time(live.pid))
        assert not manager.alive(zombie.pid) and not manager.alive(live.pid, rows[2][1])
    finally:
        live.kill()
        live.wait()
        zombie.wait()
