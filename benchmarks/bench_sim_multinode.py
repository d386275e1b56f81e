"""Figures for the SIMULATED vLLM's multi-node modes (issue 14), on local processes (each node its
own simulated host, all on 127.0.0.1). Prints, does not assert.

  python benchmarks/bench_sim_multinode.py [--runs 3] [--speed 2000]

- start -> serving of Kimi-K2.5 INT4 at TP8 x PP2 over two nodes (both started together), next to
  TP8 on one node: what the rendezvous and the wait for every node's load add
- a rank on the second node crashes while loading (fault rank-crash-loading) -> the head's log has
  the fatal line (what the orchestrator's log follower reacts to) / the head process has exited
- the headless node is killed while serving: the head does not notice (as the real vLLM) until its
  next request, which fails after VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (set to 1 s here; PP across
  nodes) -> how long that request took
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from orchestrator.host.local import LocalHost  # noqa: E402
from orchestrator.sim import manager  # noqa: E402
from tests.plugins.sim_hosts import SimHost, SimServer, free_port, make_model  # noqa: E402

ARGV = ["--served-model-name", "kimi-k25", "--trust-remote-code", "--kv-cache-dtype", "fp8",
        "--max-model-len", "65536", "--gpu-memory-utilization", "0.93", "--tensor-parallel-size", "8"]


def node_argv(host: SimHost, rank: int, port: int) -> list:
    return [str(host.dir / "models" / "kimi"), *ARGV, "--pipeline-parallel-size", "2", "--nnodes", "2",
            "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
            *(["--headless"] if rank else [])]


def exited_at(srv: SimServer, timeout: float = 120) -> float:
    srv.wait_exit(timeout)
    return time.time()


def crashed_at(host: SimHost) -> float:
    for line in (host.dir / "logs" / "faults-fired.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry.get("phase") == "crashed":
            return float(entry["at"])
    raise RuntimeError("no crash recorded")


def failed_request(port: int) -> float:
    """Seconds until a one-token completion at the head failed (it must fail)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                 data=json.dumps({"model": "kimi-k25", "prompt": "Hi", "max_tokens": 1}).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.monotonic()
    try:
        urllib.request.urlopen(req, timeout=60).close()
    except urllib.error.HTTPError:
        return time.monotonic() - t0
    raise SystemExit("the head answered a request although one of its nodes was killed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--speed", type=float, default=2000.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["VLLM_ORCH_STATE_HOME"] = str(Path(tmp) / "state")
        home = manager.sim_home()
        manager.up(2, speed=args.speed, home=home)
        try:
            inv = manager.inventory_hosts(home)
            hosts = [SimHost(n, manager.host_dir(n, home), inv[n], LocalHost(n, env=inv[n]["env"]), home)
                     for n in ("sim", "sim-2")]
            for h in hosts:
                make_model(h.dir, "kimi", "moonshotai/Kimi-K2.5", shards=64, total_size=547e9)
            one, two, crash, crash_exit, lost = [], [], [], [], []
            for _ in range(args.runs):
                t0 = time.monotonic()
                with SimServer(hosts[0], [str(hosts[0].dir / "models" / "kimi"), *ARGV]) as srv:
                    srv.wait_ready(120)
                    one.append(time.monotonic() - t0)
                port = free_port()
                t0 = time.monotonic()
                with SimServer(hosts[1], node_argv(hosts[1], 1, port)) as w, \
                        SimServer(hosts[0], node_argv(hosts[0], 0, port),
                                  env={"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1"}) as head:
                    head.wait_ready(120)
                    two.append(time.monotonic() - t0)
                    w.proc.kill()
                    w.proc.wait()
                    time.sleep(0.5)
                    lost.append(failed_request(head.port))
                for h in hosts:
                    (h.dir / "logs" / "faults-fired.jsonl").unlink(missing_ok=True)
                manager.add_fault("sim-2", "rank-crash-loading", home=home)
                port = free_port()
                with SimServer(hosts[1], node_argv(hosts[1], 1, port)) as w, \
                        SimServer(hosts[0], node_argv(hosts[0], 0, port)) as head:
                    while "Connection closed by peer" not in head.log and head.proc.poll() is None:
                        time.sleep(0.02)
                    seen = time.time()
                    end = exited_at(head)
                    crash.append(seen - crashed_at(hosts[1]))
                    crash_exit.append(end - crashed_at(hosts[1]))

            def med(xs):
                return f"median {statistics.median(xs):.2f} s (runs: {', '.join(f'{x:.2f}' for x in xs)})"
            print(f"speed {args.speed:g}, Kimi-K2.5 INT4 (547 GB), {args.runs} runs")
            print(f"start -> serving, TP8 on one node:            {med(one)}")
            print(f"start -> serving, TP8 x PP2 over two nodes:   {med(two)}")
            print(f"rank crash while loading -> head's fatal line: {med(crash)}")
            print(f"rank crash while loading -> head exited:      {med(crash_exit)}")
            print(f"headless killed, idle head's next request failed after: {med(lost)}")
        finally:
            manager.down(home)
    return 0


if __name__ == "__main__":
    sys.exit(main())
