#!/usr/bin/env python3
"""Print the bench client's ceiling and its timing accuracy (docs/benchmarking.md, "Client design").

    python benchmarks/bench_client_ceiling.py [--levels 1,2,4,...,128] [--max-tokens 512] [--seconds 3]

1. Ceiling: one client process against the zero-latency mock server (pre-serialised chunks, one
   token per chunk), server and client pinned to different cores. Prints streamed tokens/s and
   requests/s per concurrency. Target: >= 50,000 tokens/s at C=128 (5x the best real deployment).
2. Accuracy: against the known-latency mock (TTFT 200 ms, ITL 10 ms), the measured TTFT and TPOT
   minus the truth, per concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.bench.client import Endpoint
from orchestrator.bench.loadgen import run_level
from orchestrator.sim.mockserver import start_process
from orchestrator.bench.options import BenchOptions
from orchestrator.bench.prompts import RequestFactory
from orchestrator.bench.summary import summarize_level


def level(url: str, c: int, **kw) -> dict:
    opts = BenchOptions(scrape_metrics=False, **kw)
    ep = Endpoint.parse(url)
    run = asyncio.run(run_level(ep, RequestFactory(ep, "m", opts), c, opts))
    return summarize_level(run, opts)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--seconds", type=float, default=3.0, help="window per ceiling level")
    ap.add_argument("--skip-accuracy", action="store_true")
    a = ap.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    cores = sorted(os.sched_getaffinity(0))
    server_core, client_core = (cores[0], cores[-1]) if len(cores) > 1 else (None, None)
    if client_core is not None:
        os.sched_setaffinity(0, {client_core})
    print(f"cores: server {server_core}, client {client_core}; uvloop: "
          f"{'yes' if _has_uvloop() else 'no (asyncio default loop)'}")

    proc, port = start_process(cpu=server_core, model="m")
    try:
        print(f"\nCEILING (zero-latency server, max_tokens {a.max_tokens}, 1 token per chunk, one client process)")
        print(f"{'C':>5} {'tokens/s':>10} {'requests/s':>11} {'client CPU%':>12} {'lag p99 ms':>11}")
        for c in levels:
            L = level(f"http://127.0.0.1:{port}", c, max_tokens=a.max_tokens, warmup_s=0.5,
                      duration_s=a.seconds, min_requests=1)
            print(f"{c:>5} {L['throughput']['output_tok_s']:>10,.0f} {L['throughput']['requests_per_s']:>11,.1f} "
                  f"{L['client']['cpu_pct'] or 0:>12.0f} {L['client']['loop_lag_ms'].get('p99', 0):>11.1f}")
    finally:
        proc.kill()
        proc.wait()

    if a.skip_accuracy:
        return
    proc, port = start_process(cpu=server_core, model="m", ttft_ms=200, itl_ms=10)
    try:
        print("\nACCURACY (server TTFT 200 ms, ITL 10 ms, 32 tokens; error = measured - truth, ms)")
        print(f"{'C':>5} {'n':>5} {'TTFT mean':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT mean':>10} "
              f"{'TPOT p50':>9} {'TPOT p99':>9}")
        for c in levels:
            L = level(f"http://127.0.0.1:{port}", c, max_tokens=32, warmup_s=0.0, duration_s=0.5,
                      min_requests=max(c, 10))
            t, p = L["latency_ms"]["ttft"], L["latency_ms"]["tpot"]
            print(f"{c:>5} {t['n']:>5} {t['mean'] - 200:>+10.3f} {t['p50'] - 200:>+9.3f} {t['p99'] - 200:>+9.3f} "
                  f"{p['mean'] - 10:>+10.4f} {p['p50'] - 10:>+9.4f} {p['p99'] - 10:>+9.4f}")
    finally:
        proc.kill()
        proc.wait()


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
        return True
    except ImportError:
        return False


if __name__ == "__main__":
    main()
