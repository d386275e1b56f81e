"""How long `vllm-orch status` takes for 1 and for 8 SIMULATED hosts, and its round trips per host.

Not a test: prints figures. Starts its own sim home in a tmp folder (8 process hosts, speed 2000),
deploys kimi-k25-int4 on the first host with a free port (so /health, /v1/models and /metrics are
probed there too), then times gather_status() -- the code path of the command -- several times.

    .venv/bin/python benchmarks/bench_status.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-status-"))
    os.environ["VLLM_ORCH_STATE_HOME"] = str(tmp)
    from orchestrator.config.inventory import load_inventory
    from orchestrator.config.manifest import get_manifest
    from orchestrator.host.connect import open_host
    from orchestrator.ops.deploy import run_deploy
    from orchestrator.ops.execute import Reporter
    from orchestrator.ops.status import gather_status
    from orchestrator.ops.stop import stop_model
    from orchestrator.plan.run import Options
    from orchestrator.sim import manager

    models = tmp / "models"
    models.mkdir()
    data = yaml.safe_load((REPO / "models" / "kimi-k25-int4.yaml").read_text())
    data["serving"]["port"] = free_port()
    (models / "kimi-k25-int4.yaml").write_text(yaml.safe_dump(data))
    manager.up(8, speed=2000, home=tmp / "sim")
    try:
        hosts = list(load_inventory().hosts.values())
        m = get_manifest("kimi-k25-int4", models)[0]
        res = run_deploy(hosts[0], m, Options(budget_s=60), Reporter(None, quiet=True), dry_run=False)
        assert res.ok, res.as_dict()
        port_of = lambda name: m.serving.port if name == m.name else None   # noqa: E731
        print(f"status of SIMULATED hosts (LocalHost, process services); {args.repeat} runs each, median")
        for n in (1, 8):
            gather_status(hosts[:n], port_of)          # warm-up (imports, page cache)
            walls, trips = [], []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                results = gather_status(hosts[:n], port_of)
                walls.append(time.perf_counter() - t0)
                trips.append([r.round_trips for r in results])
                assert all(r.reachable for r in results)
            per_host = sorted({t for run in trips for t in run})
            states = ", ".join(f"{r.host}={r.state}" for r in results[:2])
            print(f"  {n} host{'s' if n > 1 else ' '}: {statistics.median(walls) * 1000:6.0f} ms wall "
                  f"(min {min(walls) * 1000:.0f}, max {max(walls) * 1000:.0f}); round trips per host: "
                  f"{per_host} ({states}{', ...' if n > 2 else ''})")
        print("  round trips: 1 (active record + history tail + uptime + lock) + 1 (facts) on every host; "
              "+3 HTTP probes through the host (/health, /v1/models, /metrics) where a model runs")
        entry = hosts[0]
        with open_host(entry) as host:
            stop_model(host, entry, m.name, release_timeout=10)
    finally:
        manager.down(tmp / "sim")


if __name__ == "__main__":
    main()
