"""The sweep against the SIMULATED vLLM server reproduces its configured rate profile.

Within 15%: a margin a busy 2-core machine keeps, and still a different profile point apart (the
neighbouring levels differ by ~30%, the INT4 profile by 33% at C=1). How close it really is (about
2%) is a figure: benchmarks/bench_sim_profile.py prints it, docs/figures.md records it."""

from __future__ import annotations

import pytest

from orchestrator.bench.options import BenchOptions
from orchestrator.bench.runner import run_benchmark
from orchestrator.sim import vllm_server as vs
from tests.plugins.sim_hosts import SimServer, make_model


def test_sweep_reproduces_the_nvfp4_profile(sim_host, tmp_path):
    model = make_model(sim_host.dir, "kimi-k25-nvfp4", "nvidia/Kimi-K2.5-NVFP4", total_size=540e9)
    profile = vs.PROFILES["kimi-k25-nvfp4"]
    with SimServer(sim_host, [str(model), "--trust-remote-code", "--max-model-len", "65536", "-tp", "8",
                              "--served-model-name", "kimi", "--reasoning-parser", "kimi_k2"]) as srv:
        srv.wait_ready()
        opts = BenchOptions(concurrency=[1, 32, 128], max_tokens=24, input_tokens=64, warmup_s=0.2,
                            duration_s=0.5, min_requests=4, metrics_interval_s=0.5)
        result = run_benchmark(f"http://127.0.0.1:{srv.port}", "kimi", opts, {"simulated": True},
                               tmp_path / "sim")
    for L in result.levels:
        c = L["concurrency"]
        want = vs.aggregate_rate(profile, c)
        assert L["requests"]["errors"] == 0, L["requests"]
        # the decode rate per user (1000 / median token gap) x C is the profile's aggregate rate at C.
        # (Not 1/TPOT: the sim writes the first token up to ~20 ms behind its own decode schedule,
        # which shortens the first gap; TPOT reports that faithfully.)
        assert 1000.0 / L["latency_ms"]["itl"]["p50"] * c == pytest.approx(want, rel=0.15), (c, L["latency_ms"]["itl"])
        # the steady window's aggregate (tokens counted by arrival time, warm-up and drain excluded)
        assert L["throughput"]["output_tok_s"] == pytest.approx(want, rel=0.15), (c, L["throughput"])
        assert L["tokens"]["completion"]["mean"] == 24
        assert L["server_metrics"]["available"]
        assert abs(L["server_metrics"]["generation_tokens_discrepancy_pct"]) < 1
    print("\n" + "\n".join(
        f"sim NVFP4 C={L['concurrency']}: {L['throughput']['output_tok_s']:.1f} tok/s window, "
        f"{L['per_user']['tok_s_user_median']:.2f} tok/s/user, TTFT p50 {L['latency_ms']['ttft']['p50']:.1f} ms"
        for L in result.levels))
