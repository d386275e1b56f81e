"""Fleet figures: a fleet deploy of N hosts in wall time relative to one host, and a rolling swap of
4 hosts watched by a probe loop (how many hosts answer /health 200 at every probe).

Not a test: prints figures (docs/figures.md). Starts its own SIMULATED hosts in a tmp state home
(`sim up`, speed 2000): process-flavour hosts on this machine (each model on its own port through a
per-host override), or with --systemd real-systemd containers reached over SSH (root only). Every
host first downloads the model once (a deploy and a stop), so the timed deploys are starts from a
stopped service: session, preflight, GPU check, install, start, readiness gates, record.

    .venv/bin/python benchmarks/bench_fleet.py --hosts 1,4,8            # process flavour
    .venv/bin/python benchmarks/bench_fleet.py --systemd --hosts 1,4    # real systemd over SSH
    .venv/bin/python benchmarks/bench_fleet.py --swap-only --hosts 4    # the rolling-swap probe only
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OLD, NEW = "kimi-k25-int4", "kimi-k25-nvfp4"


def machine_busy_s() -> float:
    """CPU seconds this machine has spent busy (every process, every core) since boot: /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", default="1,4,8", help="fleet sizes to time, e.g. 1,4,8")
    ap.add_argument("--systemd", action="store_true", help="real-systemd containers over SSH (root)")
    ap.add_argument("--repeat", type=int, default=2, help="timed deploys per size (the median is shown)")
    ap.add_argument("--swap-only", action="store_true", help="only the rolling swap probe")
    args = ap.parse_args()
    sizes = [int(x) for x in args.hosts.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    os.environ["VLLM_ORCH_STATE_HOME"] = str(tmp)
    from orchestrator.config.inventory import HostEntry, load_inventory
    from orchestrator.config.manifest import get_manifest
    from orchestrator.ops.deploy import run_deploy
    from orchestrator.ops.fleet import outcome_of, run_fleet
    from orchestrator.ops.swap import run_swap
    from orchestrator.plan.run import Options
    from orchestrator.sim import manager
    from orchestrator.sim.sshd import free_port

    n = max(sizes) if not args.swap_only else 4
    models = tmp / "models"
    models.mkdir()
    for name in (OLD, NEW):
        (models / f"{name}.yaml").write_text((REPO / "models" / f"{name}.yaml").read_text())
    print(f"sim up: {n} {'systemd' if args.systemd else 'process'} hosts ...", flush=True)
    manager.up(n, speed=2000, systemd=args.systemd, home=tmp / "sim")
    try:
        raw = list(load_inventory().hosts.values())
        hosts = []
        for e in raw:
            data = e.model_dump(exclude={"name"})
            if not args.systemd:      # process hosts share this machine's ports: one port per host
                data["overrides"] = {"*": {"serving": {"port": free_port()}}}
            hosts.append(HostEntry.model_validate({**data, "name": e.name}))
        m_old, m_new = (get_manifest(x, models)[0] for x in (OLD, NEW))
        manifests = {OLD: m_old, NEW: m_new}
        opts = Options(budget_s=300)

        def deploy_all(entries, m=m_old):
            t0, c0, b0 = time.monotonic(), time.process_time(), machine_busy_s()
            rows = run_fleet(entries, lambda e, rep: outcome_of(run_deploy(e, m, opts, rep, False)))
            bad = [r for r in rows if r.code]
            assert not bad, [(r.host, r.cause) for r in bad]
            cpu[len(entries)] = time.process_time() - c0       # the controller's own CPU (every thread)
            busy[len(entries)] = machine_busy_s() - b0         # everything: hosts' servers and scripts too
            return time.monotonic() - t0, rows

        cpu: dict[int, float] = {}
        busy: dict[int, float] = {}

        def stop_all(entries, model=OLD):
            from orchestrator.host.connect import open_host
            from orchestrator.ops.fleet import HostOutcome
            from orchestrator.ops.stop import stop_model

            def one(e, rep):
                with open_host(e) as h:
                    res = stop_model(h, e, model)
                return HostOutcome(0 if res.ok else 1, res.error)
            run_fleet(entries, one)

        print("first deploy on every host (downloads; not timed) ...", flush=True)
        deploy_all(hosts)
        if not args.swap_only:
            stop_all(hosts)
            timings: dict[int, list[float]] = {}
            for size in sizes:
                for _ in range(args.repeat):
                    wall, rows = deploy_all(hosts[:size])
                    timings.setdefault(size, []).append(wall)
                    per_host = sorted(r.seconds for r in rows)
                    print(f"  deploy x{size}: {wall:.2f} s wall (per host {per_host[0]:.2f}-{per_host[-1]:.2f} s; "
                          f"controller CPU {cpu[size]:.2f} s = {cpu[size] / size:.2f} s per host; machine busy "
                          f"{busy[size]:.1f} CPU-s = {busy[size] / wall:.2f} of {os.cpu_count()} cores)", flush=True)
                    stop_all(hosts[:size])
            base = sorted(timings[sizes[0]])[len(timings[sizes[0]]) // 2]
            print(f"\nfleet deploy, {'systemd over SSH' if args.systemd else 'process'} hosts "
                  f"(median of {args.repeat}; cores here: {os.cpu_count()})")
            for size in sizes:
                med = sorted(timings[size])[len(timings[size]) // 2]
                print(f"  {size} host{'s' if size > 1 else ' '}: {med:6.2f} s  = {med / base:.2f}x one host")
            deploy_all(hosts[:4])
        rolling_probe(hosts[:4], m_new, manifests, run_swap, run_fleet, outcome_of, Options(budget_s=300))
    finally:
        manager.down(home=tmp / "sim")


def rolling_probe(hosts, m_new, manifests, run_swap, run_fleet, outcome_of, opts) -> None:
    """A rolling swap (one host at a time) of hosts serving OLD to NEW, with a probe loop counting
    the hosts that answer /health 200 through the whole rollout."""
    from orchestrator.config.effective import effective
    from orchestrator.host.connect import open_host
    from orchestrator.probe.api import Endpoint, health

    ports = [effective(m_new, e).manifest.serving.port for e in hosts]
    conns = [open_host(e) for e in hosts]
    counts: list[tuple[float, int]] = []
    done = threading.Event()

    def loop() -> None:
        while not done.is_set():
            counts.append((time.monotonic(), sum(health(Endpoint(c, p), timeout=10) == 200
                                                 for c, p in zip(conns, ports))))

    t = threading.Thread(target=loop, daemon=True)
    t0 = time.monotonic()
    t.start()
    rows = run_fleet(hosts, lambda e, rep: outcome_of(run_swap(e, m_new, manifests, opts, rep, False)), parallel=1,
                     stop_on_failure=True)
    wall = time.monotonic() - t0
    time.sleep(1.0)
    done.set()
    t.join(30)
    for c in conns:
        c.close()
    values = [c for _, c in counts]
    below = sum(1 for v in values if v < len(hosts))
    print(f"\nrolling swap of {len(hosts)} hosts {OLD} -> {NEW}, --max-unavailable 1: {wall:.1f} s; "
          f"results: {', '.join(r.result for r in rows)}")
    print(f"  probe loop: {len(values)} probes of all {len(hosts)} hosts; hosts serving: min {min(values)}, "
          f"max {max(values)}; {below} probes saw one host swapping; last: {values[-1]}")
    downs = [r.data.get('downtime_s') for r in rows]
    print("  per-host downtime (old stopped -> new ready): " + ", ".join(
        f"{d:.1f} s" if isinstance(d, (int, float)) else "-" for d in downs))


if __name__ == "__main__":
    main()
