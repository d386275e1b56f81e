"""How closely the SIMULATED vLLM server keeps its rate profile, as a client measures it. Prints figures.

    python benchmarks/bench_sim_profile.py [--profile kimi-k25-nvfp4] [--levels 1,32,128] [--duration 2]

A simulated host in a temporary state home; the simulated server with the profile's model; then
1. raw streams (one thread per stream, stdlib HTTP): single-stream tok/s and the C=32 aggregate,
   from first to last token of each stream;
2. `vllm-orch bench` levels: the decode rate per user (1000 / median token gap) x C and the steady
   window's aggregate output tok/s, each against the profile's aggregate rate at C;
3. the deploy's perf step (probe/perf.py, through the host) against the Kimi-K2.5 INT4 DCP 8 layout:
   single stream and C=8 aggregate against the layout's 62 and 335 tok/s.
Target on an otherwise idle machine: within 2%. The test suite checks the same quantities with
margins a busy machine keeps (tests/integration/test_bench_sim.py, test_sim_server.py); this prints
the tight figures for docs/figures.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.bench.options import BenchOptions  # noqa: E402
from orchestrator.bench.runner import run_benchmark  # noqa: E402
from orchestrator.host.local import LocalHost  # noqa: E402
from orchestrator.sim import manager  # noqa: E402
from orchestrator.sim import vllm_server as vs  # noqa: E402
from tests.plugins.sim_hosts import TEST_SPEED, SimHost, SimServer, make_model  # noqa: E402

REPOS = {"kimi-k25-nvfp4": "nvidia/Kimi-K2.5-NVFP4", "kimi-k25-int4": "moonshotai/Kimi-K2.5"}


def stream_rate(port: int, tokens: int) -> float:
    """tok/s of one stream, first to last token (the sim writes one token per chunk)."""
    body = json.dumps({"model": "kimi", "max_tokens": tokens, "ignore_eos": True, "stream": True,
                       "messages": [{"role": "user", "content": "Tell me a story."}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    times = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta", {})
            if "role" not in delta and (delta.get("content") or delta.get("reasoning_content")) is not None:
                times.append(time.monotonic())
    return (len(times) - 1) / (times[-1] - times[0])


def perf_step(sim: SimHost) -> None:
    """What a deploy's perf step measures against the DCP 8 layout (62 tok/s single, 335 at C=8)."""
    from orchestrator.probe.api import Endpoint
    from orchestrator.probe.perf import measure

    model = make_model(sim.dir, "kimi-k25-int4", REPOS["kimi-k25-int4"])
    with SimServer(sim, [str(model), "--trust-remote-code", "--max-model-len", "65536", "-tp", "8",
                         "--decode-context-parallel-size", "8", "--kv-cache-dtype", "fp8",
                         "--served-model-name", "kimi"]) as srv:
        srv.wait_ready(60)
        got = measure(Endpoint(sim.host, srv.port), "kimi", max_tokens=64, single=True, concurrency=8, timeout=60)
        single, agg = got.single_stream_tok_s or 0.0, got.concurrency_tok_s or 0.0
        print(f"\nperf step (DCP 8): single stream {single:.1f} tok/s (layout 62, {single / 62 - 1:+.1%}), "
              f"C=8 {agg:.0f} tok/s (layout 335, {agg / 335 - 1:+.1%}), problems {got.problems or 'none'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="kimi-k25-nvfp4", choices=sorted(REPOS))
    ap.add_argument("--levels", default="1,32,128")
    ap.add_argument("--duration", type=float, default=2.0, help="bench window per level, seconds")
    a = ap.parse_args()
    profile = vs.PROFILES[a.profile]
    state = Path(tempfile.mkdtemp(prefix="bench-sim-profile-"))
    os.environ["VLLM_ORCH_STATE_HOME"] = str(state)
    home = manager.sim_home()
    manager.up(1, speed=TEST_SPEED, home=home)
    try:
        entry = manager.inventory_hosts(home)["sim"]
        sim = SimHost("sim", manager.host_dir("sim", home), entry, LocalHost("sim", env=entry["env"]), home)
        model = make_model(sim.dir, a.profile, REPOS[a.profile], total_size=profile["size"])
        with SimServer(sim, [str(model), "--trust-remote-code", "--max-model-len", "65536", "-tp", "8",
                             "--served-model-name", "kimi", "--reasoning-parser", "kimi_k2"]) as srv:
            srv.wait_ready(60)
            print(f"SIMULATED {a.profile}: profile {dict(profile['agg'])} tok/s aggregate")
            single = stream_rate(srv.port, 62)
            want = vs.aggregate_rate(profile, 1)
            print(f"\nraw streams: single stream {single:.1f} tok/s (profile {want:g}, {single / want - 1:+.1%})")
            rates: dict[int, float] = {}
            threads = [threading.Thread(target=lambda i=i: rates.__setitem__(i, stream_rate(srv.port, 40)))
                       for i in range(32)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            agg, want = sum(rates.values()), vs.aggregate_rate(profile, 32)
            print(f"raw streams: C=32 aggregate {agg:.0f} tok/s (profile {want:g}, {agg / want - 1:+.1%})")

            levels = [int(x) for x in a.levels.split(",")]
            opts = BenchOptions(concurrency=levels, max_tokens=24, input_tokens=64, warmup_s=0.5,
                                duration_s=a.duration, min_requests=4, metrics_interval_s=0.5)
            result = run_benchmark(f"http://127.0.0.1:{srv.port}", "kimi", opts, {"host_label": "SIMULATED"},
                                   state / "bench")
            print(f"\n{'C':>5} {'profile':>8} {'decode x C':>11} {'':>7} {'window':>9} {'':>7}")
            for L in result.levels:
                c = L["concurrency"]
                want = vs.aggregate_rate(profile, c)
                decode = 1000.0 / L["latency_ms"]["itl"]["p50"] * c
                window = L["throughput"]["output_tok_s"]
                print(f"{c:>5} {want:>8.1f} {decode:>11.1f} {decode / want - 1:>+7.1%} {window:>9.1f} "
                      f"{window / want - 1:>+7.1%}")
        perf_step(sim)
    finally:
        manager.down(home)


if __name__ == "__main__":
    main()
