"""Download once per fleet: N hosts ready (their weights downloaded and verified) with one Hub download
plus LAN copies, against N separate downloads through the site's one uplink.

Not a test: prints figures (docs/figures.md). Starts its own SIMULATED process hosts in a tmp state
home. Each simulated host has a Hub mirror of its own, so "N separate downloads through one uplink"
is measured as what a shared uplink makes of them: one after the other (each host at the full
uplink rate, N times); the Hub is rate-limited per connection (hub-slow, --hub-mbps, 8 connections
a host as the download uses), the LAN copies by the holder's fleet_copy_mbps (--lan-mbps, all
copiers together). A host is "ready" when its folder's verified record is complete (polled every
0.05 s); the deploys start the services too, which is not timed.

    .venv/bin/python benchmarks/bench_fleet_download.py --hosts 3 --hub-mbps 8 --lan-mbps 80
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODEL = "kimi-k25-int4"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--hub-mbps", type=float, default=8.0, help="the Hub's rate per connection, Mbit/s")
    ap.add_argument("--lan-mbps", type=float, default=80.0, help="the holder's fleet_copy_mbps, Mbit/s")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-dl-"))
    os.environ["VLLM_ORCH_STATE_HOME"] = str(tmp)
    from orchestrator.config.inventory import HostEntry, load_inventory
    from orchestrator.config.manifest import get_manifest
    from orchestrator.host.connect import open_host
    from orchestrator.ops.deploy import run_deploy
    from orchestrator.ops.execute import Reporter
    from orchestrator.ops.fleet import HostOutcome, outcome_of, run_fleet
    from orchestrator.ops.seed import run_seeded, seeded
    from orchestrator.ops.stop import stop_model
    from orchestrator.plan.run import Options
    from orchestrator.sim import manager
    from orchestrator.sim.fault_file import add_fault
    from orchestrator.sim.sshd import free_port

    models = tmp / "models"
    models.mkdir()
    (models / f"{MODEL}.yaml").write_text((REPO / "models" / f"{MODEL}.yaml").read_text())
    home = tmp / "sim"
    print(f"sim up: {args.hosts} process hosts ...", flush=True)
    manager.up(args.hosts, speed=2000, home=home)
    try:
        hosts = []
        for e in load_inventory().hosts.values():
            data = e.model_dump(exclude={"name"})
            data["overrides"] = {"*": {"serving": {"port": free_port()}}}   # hosts share this machine's ports
            data["fleet_copy_mbps"] = args.lan_mbps
            hosts.append(HostEntry.model_validate({**data, "name": e.name}))
        for e in hosts:
            add_fault(manager.host_dir(e.name, home), "hub-slow", None, rate_bps=int(args.hub_mbps * 125_000))
        m = get_manifest(MODEL, models)[0]
        opts = Options(budget_s=300)

        def folder_of(e: HostEntry) -> Path:
            return Path(e.models_root) / MODEL

        def watch(entries, ready: dict, stop: threading.Event, t0: float) -> None:
            while not stop.is_set():
                for e in entries:
                    rec = folder_of(e) / ".vllm-orch" / "verified.json"
                    if e.name not in ready and rec.exists():
                        try:
                            if json.loads(rec.read_text()).get("complete"):
                                ready[e.name] = time.monotonic() - t0
                        except ValueError:
                            pass
                time.sleep(0.05)

        def reset(entries) -> None:
            def one(e, rep):
                with open_host(e) as h:
                    stop_model(h, e, MODEL)
                    h.run(["rm", "-rf", str(folder_of(e))]).check(e.name)
                return HostOutcome(0)
            run_fleet(entries, one)

        def timed(run) -> dict:
            ready: dict = {}
            stop = threading.Event()
            t0 = time.monotonic()
            w = threading.Thread(target=watch, args=(hosts, ready, stop, t0), daemon=True)
            w.start()
            run()
            time.sleep(0.2)
            stop.set()
            w.join()
            return ready

        began: dict = {}

        def separate() -> None:           # one uplink: the hosts' downloads one after the other
            for e in hosts:
                began[e.name] = time.monotonic()
                r = run_deploy(e, m, opts, Reporter(None, quiet=True), False)
                assert r.ok, r.error

        def once() -> None:
            with seeded(opts, hosts) as fleet_opts:
                rows = run_fleet(hosts, lambda e, rep: run_seeded(fleet_opts, e, lambda: outcome_of(
                    run_deploy(e, m, fleet_opts, rep, False))))
            bad = [r for r in rows if r.code]
            assert not bad, [(r.host, r.cause) for r in bad]

        size = None
        results = {}
        for label, run in (("separate", separate), ("once per fleet", once)):
            print(f"{label}: deploy {MODEL} on {len(hosts)} hosts ...", flush=True)
            t0 = time.monotonic()
            results[label] = timed(run)
            if began:                     # each host's own download time, back to back (the services' starts
                own = {h: t - (began[h] - t0) for h, t in results[label].items()}      # between them left out)
                total, results[label] = 0.0, {}
                for h in sorted(own, key=lambda h: began[h]):
                    total += own[h]
                    results[label][h] = total
                began.clear()
            rec = json.loads((folder_of(hosts[0]) / ".vllm-orch" / "verified.json").read_text())
            size = rec.get("total_bytes")
            reset(hosts)
        print(f"\ndownload once per fleet: {MODEL} ({size / 1e6:.1f} MB simulated), {len(hosts)} hosts, Hub "
              f"{args.hub_mbps:g} Mbit/s per connection (8 a host), LAN copies at most {args.lan_mbps:g} Mbit/s "
              f"from the holder")
        for label, ready in results.items():
            times = ", ".join(f"{h} {t:.2f}s" for h, t in sorted(ready.items(), key=lambda x: x[1]))
            print(f"  {label:15s} all ready at {max(ready.values()):6.2f} s  ({times})")
        a, b = max(results["separate"].values()), max(results["once per fleet"].values())
        first = min(results["separate"].values())
        print(f"  ratio: {b / a:.2f} of {len(hosts)} separate downloads ({b / first:.2f}x one host's Hub time)")
    finally:
        manager.down(home=home)


if __name__ == "__main__":
    main()
