"""The bench against the SIMULATED vLLM server: the sweep reproduces its configured rate profile, a
search finds the profile's knee for an SLO, and open-loop rates meet it below the knee.

Profile within 15%: a margin a busy 2-core machine keeps, and still a different profile point apart
(the neighbouring levels differ by ~30%, the INT4 profile by 33% at C=1). How close it really is
(about 2%) is a figure: benchmarks/bench_sim_profile.py prints it, docs/figures.md records it."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from orchestrator.bench.options import BenchOptions
from orchestrator.bench.runner import run_benchmark
from orchestrator.sim import vllm_server as vs
from tests.plugins.sim_hosts import SimServer, make_model

PROFILE = vs.PROFILES["kimi-k25-nvfp4"]


@contextmanager
def nvfp4(sim_host, *extra: str):
    """The simulated Kimi-K2.5 NVFP4 server, ready; yields its URL (served name "kimi")."""
    model = make_model(sim_host.dir, "kimi-k25-nvfp4", "nvidia/Kimi-K2.5-NVFP4", total_size=540e9)
    with SimServer(sim_host, [str(model), "--trust-remote-code", "--max-model-len", "65536", "-tp", "8",
                              "--served-model-name", "kimi", *extra]) as srv:
        srv.wait_ready()
        yield f"http://127.0.0.1:{srv.port}"


def test_sweep_reproduces_the_nvfp4_profile(sim_host, tmp_path):
    with nvfp4(sim_host, "--reasoning-parser", "kimi_k2") as url:
        opts = BenchOptions(concurrency=[1, 32, 128], max_tokens=24, input_tokens=64, warmup_s=0.2,
                            duration_s=0.5, min_requests=4, metrics_interval_s=0.5)
        result = run_benchmark(url, "kimi", opts, {"simulated": True}, tmp_path / "sim")
    for L in result.levels:
        c = L["concurrency"]
        want = vs.aggregate_rate(PROFILE, c)
        assert L["requests"]["errors"] == 0, L["requests"]
        # the decode rate per user x C is the profile's aggregate rate at C. The rate per user is each
        # request's tokens over its decode time (1000 / TPOT), median over requests: a rate, so a
        # starved moment followed by the sim's catch-up (a few short gaps after a long one, its
        # schedule is absolute) does not move it, while it moved the median token gap by 16% (948
        # for 800 tok/s at C=32, one run on a slower 2-core machine).
        rate = L["per_user"]["tok_s_user_median"] * c
        assert rate == pytest.approx(want, rel=0.15), (c, rate, L["latency_ms"]["itl"], L["latency_ms"]["tpot"])
        # the steady window's aggregate (tokens counted by arrival time, warm-up and drain excluded) is
        # a figure of 0.5 s of wall time, which a busy machine moves (one run with a core kept busy
        # measured 40 tok/s at C=1, slices 6.7-71.8): benchmarks/bench_sim_profile.py compares it with
        # the profile; here the window must have counted tokens
        assert L["throughput"]["window_tokens"] > 0 and L["throughput"]["output_tok_s"] > 0, (c, L["throughput"])
        assert L["tokens"]["completion"]["mean"] == 24
        # prompts sized through the sim's /tokenize: the server counted exactly 64 for every request
        assert L["tokens"]["prompt"]["min"] == L["tokens"]["prompt"]["max"] == 64
        assert L["tokens"]["prompt_off_target"] == 0
        assert L["server_metrics"]["available"]
        assert abs(L["server_metrics"]["generation_tokens_discrepancy_pct"]) < 1
    print("\n" + "\n".join(
        f"sim NVFP4 C={L['concurrency']}: {L['throughput']['output_tok_s']:.1f} tok/s window, "
        f"{L['per_user']['tok_s_user_median']:.2f} tok/s/user, TTFT p50 {L['latency_ms']['ttft']['p50']:.1f} ms"
        for L in result.levels))


def test_search_finds_the_highest_concurrency_meeting_a_tpot_slo(sim_host, tmp_path):
    """TPOT <= 50 ms for 90% of requests: the NVFP4 profile's per-stream rate falls below 20 tok/s
    between C=46 (49.7 ms) and C=48 (51.0 ms). The search must bracket that knee within a few levels;
    the bracket is allowed 10% either side, for the precision and a busy machine's noise."""
    with nvfp4(sim_host) as url:
        opts = BenchOptions(concurrency=[1, 128], max_tokens=12, input_tokens=32, warmup_s=0.3,
                            duration_s=0.8, min_requests=8, scrape_metrics=False,
                            slo={"tpot": 50.0}, slo_percentile=90.0, search=True)
        result = run_benchmark(url, "kimi", opts, {"simulated": True}, tmp_path / "search")
    search = result.data["search"]
    tpot = lambda c: 1000.0 / vs.stream_rate(PROFILE, c)  # noqa: E731
    assert search["kind"] == "concurrency" and search["levels_run"] <= 8, search
    assert search["best"] is not None and tpot(search["best"]) <= 50.0 * 1.1, search
    assert search["first_failing"] is not None and tpot(search["first_failing"]) >= 50.0 * 0.9, search
    assert search["first_failing"] / search["best"] <= 1.25, search
    assert result.headline["slo_best"] == search["best"]
    met = {L["concurrency"]: L["slo"]["met"] for L in result.levels}
    assert met[1] and not met[128] and len(met) == search["levels_run"]
    print(f"\nsim NVFP4 search TPOT <= 50 ms: best C={search['best']}, first failing C="
          f"{search['first_failing']}, {search['levels_run']} levels, tried "
          + ", ".join(f"{t['value']:g}{'+' if t['met'] else '-'}" for t in search["tried"]))


def test_open_loop_rates_against_the_simulated_server(sim_host, tmp_path):
    """Rates well below the NVFP4 profile's knee: every request meets TPOT <= 50 ms and the send
    rate is the offered one (the latency against the profile at Little's-law streams is printed)."""
    with nvfp4(sim_host) as url:
        opts = BenchOptions(rates=[4.0, 12.0], max_concurrency=64, max_tokens=12, input_tokens=48,
                            warmup_s=0.5, duration_s=2.5, min_requests=10, metrics_interval_s=0.5,
                            slo={"tpot": 50.0, "ttft": 500.0})
        result = run_benchmark(url, "kimi", opts, {"simulated": True}, tmp_path / "open")
    for L in result.levels:
        rate = L["rate"]
        assert L["mode"] == "open" and L["requests"]["errors"] == 0 and not L["aborted"]
        assert L["requests"]["sent_per_s"] == pytest.approx(rate, rel=0.35)
        assert L["slo"]["met"] and L["slo"]["good_fraction"] >= 0.9, L["slo"]
        assert L["tokens"]["prompt"]["min"] == L["tokens"]["prompt"]["max"] == 48
        # The latency is the profile's at the few streams Little's law predicts: a figure of the
        # machine's speed (a busy slower machine read TPOT 20.1 ms for the 18.9 ms bound at 1+4
        # streams), printed here; the SLO above is what the test holds.
        in_flight = rate * L["latency_ms"]["e2e"]["mean"] / 1000.0
        print(f"open loop {rate:g}/s: TPOT p50 {L['latency_ms']['tpot']['p50']:.1f} ms, the profile's at "
              f"{round(in_flight)} streams {1000.0 / vs.stream_rate(PROFILE, max(1, round(in_flight))):.1f} ms")
        assert L["requests"]["max_in_flight"] < 64
