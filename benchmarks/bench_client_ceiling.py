#!/usr/bin/env python3
"""Print the bench client's ceiling and its timing accuracy (docs/benchmarking.md, "Client design").

    python benchmarks/bench_client_ceiling.py [--levels 1,2,4,...,128] [--max-tokens 512] [--seconds 3]

1. Ceiling: one client process against the zero-latency mock server (pre-serialised chunks, one
   token per chunk), server and client pinned to different cores. Prints streamed tokens/s and
   requests/s per concurrency. Target: >= 50,000 tokens/s at C=128 (5x the best real deployment).
2. Accuracy: against the known-latency mock (TTFT 200 ms, ITL 10 ms, 3 reasoning tokens), the
   measured TTFT, TTFC and TPOT minus the truth, per concurrency, net of the mock's own measured
   lateness. Target on an otherwise idle machine, at every level: TTFT p50 and TPOT mean within
   1 ms, TTFC p50 within 1.5 ms. The test suite checks the same quantities with margins a busy machine keeps
   (tests/integration/test_bench_mock.py); this prints the tight figure for docs/figures.md.
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
from orchestrator.bench.options import BenchOptions
from orchestrator.bench.prompts import RequestFactory
from orchestrator.bench.summary import summarize_level
from orchestrator.sim.mockserver import start_process


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
    proc, port = start_process(cpu=server_core, model="m", ttft_ms=200, itl_ms=10, reasoning_tokens=3)
    url = f"http://127.0.0.1:{port}"
    try:
        print("\nACCURACY (server TTFT 200 ms, ITL 10 ms, 3 reasoning tokens, 32 tokens; error = measured - "
              "truth - the mock's own mean lateness, ms)")
        print(f"{'C':>5} {'n':>5} {'mock late':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TTFC p50':>9} "
              f"{'TPOT mean':>10} {'TPOT p50':>9} {'TPOT p99':>9}  on target")
        for c in levels:
            s0, n0 = _mock_lateness_ms(url)
            L = level(url, c, max_tokens=32, warmup_s=0.0, duration_s=0.5, min_requests=max(c, 10))
            s1, n1 = _mock_lateness_ms(url)
            late = (s1 - s0) / max(1, n1 - n0)
            t, f, p = (L["latency_ms"][k] for k in ("ttft", "ttfc", "tpot"))
            errs = (t["p50"] - 200 - late, f["p50"] - 230 - late, p["mean"] - 10)
            print(f"{c:>5} {t['n']:>5} {late:>9.3f} {errs[0]:>+9.3f} {t['p99'] - 200 - late:>+9.3f} "
                  f"{errs[1]:>+9.3f} {errs[2]:>+10.4f} {p['p50'] - 10:>+9.4f} {p['p99'] - 10:>+9.4f}  "
                  f"{'yes' if all(abs(e) < lim for e, lim in zip(errs, (1.0, 1.5, 1.0))) else 'NO'}")
    finally:
        proc.kill()
        proc.wait()


def _mock_lateness_ms(url: str) -> tuple[float, int]:
    """(sum ms, count) of how late the mock wrote first tokens: its own scheduling error."""
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    vals = dict(line.split() for line in text.splitlines() if line.startswith("mock:first_token"))
    return (float(vals["mock:first_token_lateness_seconds_sum"]) * 1000,
            int(vals["mock:first_token_lateness_seconds_count"]))


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
        return True
    except ImportError:
        return False


if __name__ == "__main__":
    main()
