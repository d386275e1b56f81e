"""Only our processes, on the SIMULATED `process` host: what deploy, stop and swap may kill.

- A hand-started `vllm serve` whose API server is SIGKILLed leaves its workers behind (abandoned):
  deploy kills them and starts, though vllm-orch never started that server.
- Someone's live vLLM server, or a script whose path merely contains "vllm", on the model's GPUs
  is foreign: deploy refuses (naming PID and user) unless --kill-foreign; stop leaves it alive.
- A stale process record (another boot, a reused PID) never makes stop kill a process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from orchestrator.errors import RefusedError
from orchestrator.host.services import Service
from orchestrator.host.state import read_history
from orchestrator.ops.stop import stop_model
from orchestrator.sim import manager
from tests.plugins.sim_hosts import SimServer, wait_until

from .deployhelp import deploy, entry, on_port
from .test_sim_server import make_model

BOOT_ID = open("/proc/sys/kernel/random/boot_id").read().strip()


def hand_started_server(sim_host, gpus: str) -> SimServer:
    """`vllm serve` on GPUs `gpus`, started by hand (its own process group), not by vllm-orch."""
    model = make_model(sim_host.dir, "by-hand", "MiniMaxAI/MiniMax-M2.5", total_size=230e9)
    srv = SimServer(sim_host, [str(model), "--trust-remote-code", "--max-model-len", "65536", "-tp", "4"],
                    env={"CUDA_VISIBLE_DEVICES": gpus}, new_session=True)
    srv.wait_ready(timeout=60)
    return srv


def holder_pids(sim_host) -> set[int]:
    out = set()
    for f in (sim_host.dir / "gpu-procs").glob("*.json"):
        try:
            out.add(json.loads(f.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            pass
    return out


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in "ZX"


def test_workers_of_a_killed_hand_started_server_are_abandoned_and_killed(sim_host):
    srv = hand_started_server(sim_host, "0,1,2,3")
    try:
        workers = holder_pids(sim_host)
        assert len(workers) == 4
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
        wait_until(lambda: all(alive(p) for p in workers), what="the workers to outlive their server")
        e, m = entry(sim_host), on_port("minimax-m25")            # GPUs 0-3, like the server's
        result = deploy(e, m)
        assert result.ok, result.error
        gpus = next(a for a in result.plan.actions if a.step == "gpus")
        assert gpus.summary.startswith("kill 4 leftover processes")
        assert all("API server is gone" in d for d in gpus.details), gpus.details
        wait_until(lambda: not any(alive(p) for p in workers), what="the abandoned workers to die")
    finally:
        srv.stop()
        for pid in holder_pids(sim_host):
            manager.stop_pid(pid, None, timeout=3)


def test_someone_elses_live_server_is_foreign_refused_and_never_stopped(sim_host):
    srv = hand_started_server(sim_host, "4,5,6,7")
    try:
        workers = holder_pids(sim_host)
        e, m = entry(sim_host), on_port("kimi-k25-int4")          # GPUs 0-7 overlap the server's
        refused = deploy(e, m)
        assert isinstance(refused.error, RefusedError) and refused.error.step == "preflight"
        assert "does not manage" in str(refused.error)
        check = next(a for a in refused.plan.actions if a.step == "preflight")
        user = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
        assert any(f"user {user}" in d and "foreign" in d for d in check.details), check.details
        assert all(alive(p) for p in workers) and srv.proc.poll() is None

        # A model on the other GPUs deploys, and its stop never touches the server next door.
        mm = on_port("minimax-m25")                               # GPUs 0-3
        assert deploy(e, mm).ok
        res = stop_model(sim_host.host, e, mm.name, mm.serving.visible_devices, release_timeout=20, poll=0.1)
        assert res.ok and all(alive(p) for p in workers) and srv.proc.poll() is None
    finally:
        srv.stop()


def test_a_script_whose_path_mentions_vllm_is_foreign(sim_host, tmp_path):
    folder = tmp_path / "home" / "alice" / "vllm-eval"
    folder.mkdir(parents=True)
    (folder / "train.py").write_text("import time\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, str(folder / "train.py")], start_new_session=True)
    try:
        (sim_host.dir / "gpu-procs" / f"{proc.pid}-2.json").write_text(json.dumps(
            {"pid": proc.pid, "process_name": sys.executable, "gpu_index": 2, "used_mib": 30000,
             "start_time": manager.start_time(proc.pid)}))
        e, m = entry(sim_host), on_port("minimax-m25")
        refused = deploy(e, m)
        assert isinstance(refused.error, RefusedError) and str(proc.pid) in str(refused.error)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_stale_record_never_makes_stop_kill_a_process_group(sim_host):
    e, m = entry(sim_host), on_port("minimax-m25")
    assert deploy(e, m).ok
    assert stop_model(sim_host.host, e, m.name, m.serving.visible_devices, release_timeout=20, poll=0.1).ok
    record = sim_host.dir / "state" / "run" / f"vllm-{m.name}.pid"
    bystander = subprocess.Popen(["sleep", "120"], start_new_session=True)    # someone else's group
    try:
        stat = open(f"/proc/{bystander.pid}/stat").read()
        ticks = stat[stat.rindex(")") + 2:].split()[19]
        for stale in (f"{bystander.pid} 00000000-another-boot {ticks}",       # written before a reboot
                      f"{bystander.pid} {BOOT_ID} {int(ticks) - 7}",          # the PID was reused since
                      f"{bystander.pid}"):                                     # an older vllm-orch's file
            record.write_text(stale + "\n")
            svc = Service.for_host(sim_host.host, e, m.name)
            assert not svc.state().active                  # the stale record names no running service
            svc.run_all(svc.stop_commands(), "stop")       # the shell guard of the stop command itself
            assert bystander.poll() is None, f"the stop command killed an unrelated group ({stale})"
            record.write_text(stale + "\n")
            res = stop_model(sim_host.host, e, m.name, m.serving.visible_devices, release_timeout=20, poll=0.1)
            assert res.ok, res.error
            time.sleep(0.2)
            assert bystander.poll() is None, f"stop killed an unrelated process group ({stale})"
        last = read_history(sim_host.host, e)[-1].shown()
        assert last["operation"] == "stop" and last["killed"] == []
    finally:
        bystander.kill()
        bystander.wait()
