"""The health timer's soak (issue 26): the installed probe (unit_probe.py check) against a SIMULATED
Kimi-K2.5 INT4 server under a mix of long and short prompts, at the manifest's defaults (every 30 s,
a 30 s one-token completion, 3 failures in a row), then an injected hang. Prints, does not assert.

  python benchmarks/bench_health_soak.py [--minutes 30] [--interval 30 --timeout 30 --failures 3]
                                         [--probe PATH]   (another unit_probe.py, e.g. an older one)

- The simulator prefills as vLLM V1 does (running requests first, chunked at max_num_batched_tokens,
  at the layout's prefill rate: ~9000 tokens/s): bursts of 120K-token prompts hold the probe's
  one-token completion in the queue for longer than its timeout.
- The timer is emulated here (a simulated process host has no systemd): a check starts every
  `interval` s after the previous one started (OnUnitActiveSec=), or as soon as a longer check ends,
  with a stand-in systemctl saying the unit is active. A check that asks for a restart (exit 75)
  before the hang is a FALSE restart (counted; nothing is restarted, the soak goes on).
- The hang (fault hang-after-ready) fires `--detect-room` s before the end; the time to detect is
  from the hang to the check that asks for the restart.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.paths import package_file  # noqa: E402
from orchestrator.sim import manager  # noqa: E402
from tests.integration.probehelp import stand_in_env, stand_in_systemctl  # noqa: E402
from tests.plugins.sim_hosts import TEST_SPEED, SimHost, SimServer, make_model  # noqa: E402

MODEL = "kimi-k25-int4"


def post(port: int, prompt: str, max_tokens: int, timeout: float) -> bool:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                 data=json.dumps({"model": "kimi", "prompt": prompt,
                                                  "max_tokens": max_tokens}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
        return True
    except OSError:
        return False


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--interval", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--failures", type=int, default=3)
    p.add_argument("--detect-room", type=float, default=240.0, help="seconds left for the hang to be noticed")
    p.add_argument("--long-tokens", type=int, default=120_000)
    p.add_argument("--long-every", type=float, default=30.0, help="seconds between bursts of long prompts")
    p.add_argument("--burst", type=int, default=3, help="most long prompts in a burst")
    p.add_argument("--short-clients", type=int, default=4)
    p.add_argument("--probe", default=str(package_file("host", "remote", "unit_probe.py")))
    p.add_argument("--seed", type=int, default=26)
    a = p.parse_args()
    rng = random.Random(a.seed)
    work = Path(tempfile.mkdtemp(prefix="vllm-orch-soak-"))
    os.environ["VLLM_ORCH_STATE_HOME"] = str(work / "state")
    home = manager.sim_home()
    manager.up(1, speed=TEST_SPEED, home=home)
    total = a.minutes * 60
    hang_after = max(30.0, total - a.detect_room)
    counts = {"ok": 0, "busy": 0, "failed": 0, "false_restarts": 0}
    checks: list[tuple[float, float, int]] = []
    detect_s = None
    long_sent = long_done = short_done = 0
    try:
        entry = json.loads(json.dumps(manager.inventory_hosts(home)["sim"]))
        from orchestrator.host.local import LocalHost
        sim = SimHost("sim", manager.host_dir("sim", home), entry, LocalHost("sim", env=entry["env"]), home)
        model = make_model(sim.dir, MODEL, "moonshotai/Kimi-K2.5", total_size=547e9)
        manager.add_fault("sim", "hang-after-ready", MODEL, home=home, after=hang_after)
        argv = [str(model), "--served-model-name", "kimi", "--trust-remote-code", "-tp", "8",
                "--max-model-len", "131072", "--max-num-batched-tokens", "8192"]
        with SimServer(sim, argv) as srv:
            srv.wait_ready(120)
            t0 = time.monotonic()
            end = t0 + total
            stand_in_systemctl(work)
            env = {k: v for k, v in stand_in_env(work).items() if k not in ("VLLM_API_KEY", "CREDENTIALS_DIRECTORY")}
            stop = threading.Event()
            long_prompt = " ".join(["word"] * a.long_tokens)

            def shorts() -> None:
                nonlocal short_done
                while not stop.is_set():
                    if post(srv.port, "Hello, how are you?", rng.randint(8, 64), 600):
                        short_done += 1
                    time.sleep(rng.uniform(0.2, 2.0))

            def longs() -> None:
                nonlocal long_sent, long_done
                while not stop.wait(rng.uniform(0.5, 1.5) * a.long_every):
                    for _ in range(rng.randint(1, a.burst)):
                        long_sent += 1
                        threading.Thread(target=lambda: post(srv.port, long_prompt, 16, 900) and bump(),
                                         daemon=True).start()

            def bump() -> None:
                nonlocal long_done
                long_done += 1

            for _ in range(a.short_clients):
                threading.Thread(target=shorts, daemon=True).start()
            threading.Thread(target=longs, daemon=True).start()
            fired = sim.dir / "logs" / "faults-fired.jsonl"
            next_at = t0 + a.interval
            while time.monotonic() < end and detect_s is None:
                time.sleep(max(0.0, next_at - time.monotonic()))
                started = time.monotonic()
                next_at = started + a.interval
                r = subprocess.run([sys.executable, "-I", a.probe, "check", "--unit", "vllm-x.service", "--port",
                                    str(srv.port), "--served-name", "kimi", "--model", "x", "--timeout",
                                    str(a.timeout), "--failures", str(a.failures), "--state-dir", str(work / "state")],
                                   capture_output=True, text=True, env=env, timeout=a.timeout * 3 + 60)
                checks.append((started - t0, time.monotonic() - started, r.returncode))
                hung_at = None
                if fired.exists():
                    hung = [json.loads(line) for line in fired.read_text().splitlines() if '"hung"' in line]
                    hung_at = hung[-1]["at"] if hung else None
                if r.returncode == 75:
                    if hung_at is None:
                        counts["false_restarts"] += 1
                        print(f"  FALSE restart asked at {started - t0:.0f}s: {r.stdout.strip()[-200:]}", flush=True)
                    else:
                        detect_s = time.time() - hung_at
                else:
                    try:
                        last = json.loads((work / "state" / "health" / "x.json").read_text()).get("last") or {}
                    except (OSError, ValueError):
                        last = {}
                    kind = "busy" if r.returncode in (0, 76) and last.get("note") else \
                        "ok" if r.returncode in (0, 76) else "failed"
                    counts[kind] += 1
            stop.set()
        waits = sorted(d for _, d, _ in checks)
        print(f"soak: {a.minutes:g} min on the simulator ({MODEL}, prefill "
              f"{__import__('orchestrator.sim.vllm_server', fromlist=['PROFILES']).PROFILES[MODEL]['prefill']:.0f} "
              f"tokens/s, max_num_batched_tokens 8192); health check every {a.interval:g}s, timeout {a.timeout:g}s, "
              f"{a.failures} failures; probe {a.probe}")
        print(f"  load: {long_sent} long prompts of {a.long_tokens:,} tokens in bursts of 1-{a.burst} every "
              f"~{a.long_every:g}s ({long_done} answered), {short_done} short requests answered")
        print(f"  checks: {len(checks)} ({counts['ok'] + counts['busy']} ok, {counts['busy']} of them busy "
              f"(timed out, engine stepping), "
              f"{counts['failed']} failed); longest check {waits[-1]:.1f}s" if waits else "  no checks")
        print(f"  false restarts: {counts['false_restarts']} (target 0)")
        print(f"  injected hang after {hang_after:.0f}s of serving -> restart asked after: "
              + (f"{detect_s:.1f}s (target: no slower than 109 s)" if detect_s is not None else "NOT DETECTED"))
    finally:
        manager.down(home)


if __name__ == "__main__":
    main()
