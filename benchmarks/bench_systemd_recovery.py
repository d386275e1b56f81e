"""Figures for interruptions and hangs on a real-systemd SIMULATED host (issue 12). Prints, does
not assert. Needs root and systemd-nspawn (like `vllm-orch sim up --systemd`).

  python benchmarks/bench_systemd_recovery.py [--runs 3] [--interval 30 --failures 3 --timeout 30]

- Ctrl-C during a swap's readiness wait -> the previous model serves again (the rollback: stop
  the new service, GPUs released, start the old one, its gates, `unit active`), next to the old
  model's own start -> serving time on this host for comparison
- the health timer: the engine hangs (fault hang-after-ready: /health stays 200, requests never
  finish) -> `health-restart` recorded -> the service serves again
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from orchestrator.config.inventory import HostEntry  # noqa: E402
from orchestrator.host.connect import open_host  # noqa: E402
from orchestrator.host.state import read_history  # noqa: E402
from orchestrator.sim import manager  # noqa: E402
from tests.integration.deployhelp import deploy, tuned, write_models  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PORT = 8000


def active_state(e: HostEntry, unit: str) -> tuple[str, str]:
    """(ActiveState, MainPID); systemctl prints properties in its own order, not the one asked for."""
    with open_host(e) as host:
        out = host.run(["systemctl", "show", "-p", "ActiveState,MainPID", unit]).stdout
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return props.get("ActiveState", ""), props.get("MainPID", "")


def wait(predicate, budget: float) -> None:
    deadline = time.monotonic() + budget
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.1)


def cold_start(e: HostEntry, unit: str) -> float:
    """systemctl restart -> the unit `active` (its probe passed): the model's own start on this host."""
    with open_host(e) as host:
        host.run(["systemctl", "stop", unit]).check(e.name)
        t0 = time.monotonic()
        host.run(["systemctl", "start", "--no-block", unit]).check(e.name)
    wait(lambda: active_state(e, unit)[0] == "active", 300)
    return time.monotonic() - t0


def sigint_default() -> None:
    """Ctrl-C must reach the CLI even when this script runs in the background (SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ctrl_c_during_swap(e, home, env, old, new) -> float:
    manager.add_fault("sim", "hang", model=new.name, home=home)
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.main", "swap", new.name, "--host", "sim"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(REPO),
                            start_new_session=True, preexec_fn=sigint_default)
    for line in proc.stdout:
        if "] ready:" in line:
            break
    time.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=600)
    took = time.monotonic() - t0
    if proc.returncode != 130 or active_state(e, old.unit_name)[0] != "active":
        raise SystemExit(f"the rollback did not bring {old.name} back (exit {proc.returncode})")
    return took


def hang_to_restart(e, home, m) -> tuple[float, float]:
    manager.add_fault("sim", "hang-after-ready", model=m.name, home=home, after=10)
    assert deploy(e, m).ok
    _, pid = active_state(e, m.unit_name)
    fired = manager.host_dir("sim", home) / "logs" / "faults-fired.jsonl"

    def restarted():
        with open_host(e) as host:
            return [r for r in read_history(host, e) if r.operation == "health-restart"]
    wait(restarted, 1800)
    record = restarted()[-1]
    wait(lambda: active_state(e, m.unit_name) != ("active", pid) and active_state(e, m.unit_name)[0] == "active",
         600)
    serving = time.time()
    hung = [json.loads(line) for line in fired.read_text().splitlines() if '"phase": "hung"' in line][-1]["at"]
    return datetime.fromisoformat(record.at or "").timestamp() - hung, serving - hung


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--speed", type=float, default=2000.0)
    ap.add_argument("--interval", type=int, default=30, help="probes.health_interval_seconds")
    ap.add_argument("--failures", type=int, default=3, help="probes.health_failures")
    ap.add_argument("--timeout", type=int, default=30, help="probes.health_timeout_seconds")
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-sd-")) / "sim"
    os.environ["VLLM_ORCH_STATE_HOME"] = str(home.parent)
    manager.up(1, speed=a.speed, systemd=True, home=home)
    raw = manager.inventory_hosts(home)["sim"]
    e = HostEntry.model_validate({**raw, "name": "sim"})
    try:
        old = tuned("minimax-m25", PORT)
        new = tuned("minimax-m25-ep", PORT, startup={"no_progress_seconds": 6})
        models = write_models(Path(tempfile.mkdtemp(prefix="bench-models-")), [old, new])
        env = dict(os.environ, VLLM_ORCH_MODELS=str(models))
        assert deploy(e, old).ok
        cold = [cold_start(e, old.unit_name) for _ in range(a.runs)]
        back = [ctrl_c_during_swap(e, home, env, old, new) for _ in range(a.runs)]
        print(f"speed {a.speed:g}: {old.name} start -> unit active: median {statistics.median(cold):.2f}s "
              f"({', '.join(f'{x:.2f}' for x in cold)})")
        print(f"Ctrl-C in the readiness wait of a swap -> {old.name} serving again (exit 130): median "
              f"{statistics.median(back):.2f}s ({', '.join(f'{x:.2f}' for x in back)})")
        with open_host(e) as host:
            host.run(["systemctl", "stop", old.unit_name]).check(e.name)
        m = tuned("minimax-m25", PORT, probes={"health_interval_seconds": a.interval, "health_failures": a.failures,
                                               "health_timeout_seconds": a.timeout})
        detect, serving = hang_to_restart(e, home, m)
        print(f"health timer (every {a.interval}s, {a.failures} failures, timeout {a.timeout}s): hang -> "
              f"health-restart recorded {detect:.1f}s, -> serving again {serving:.1f}s")
    finally:
        manager.down(home)


if __name__ == "__main__":
    main()
