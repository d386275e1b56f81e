"""Percentile method, weighted summaries, the compare noise rule and /metrics parsing."""

from __future__ import annotations

import pytest

from orchestrator.bench.compare import compare, judge
from orchestrator.bench.promscrape import level_deltas, snapshot
from orchestrator.bench.stats import percentile, summarize, summarize_weighted


def test_percentile_is_linear_interpolation_type7():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0


def test_summary_flags_low_n_p99_and_ignores_none():
    s = summarize([3.0, None, 1.0, 2.0])
    assert s["n"] == 3 and s["p99_low_n"] and s["mean"] == 2.0 and s["max"] == 3.0
    assert summarize(range(101))["p95"] == 95.0 and summarize(range(101))["p90"] == 90.0
    assert summarize(range(200))["p99_low_n"] is False
    assert summarize([]) == {"n": 0}


def test_weighted_summary_counts_tokens():
    s = summarize_weighted([10.0, 30.0], [3.0, 1.0])
    assert s["mean"] == 15.0 and s["p50"] == 10.0 and s["p90"] == 30.0 and s["tokens"] == 4.0
    assert s["p95"] == 30.0


def test_noise_rule_needs_both_relative_and_statistical_change():
    assert judge(100.0, 1.0, 110.0, 1.0, True) == "better"
    assert judge(100.0, 1.0, 104.0, 0.1, True) == ""          # < 5 %
    assert judge(100.0, 10.0, 110.0, 10.0, True) == ""        # within 2 x combined SE
    assert judge(100.0, 1.0, 120.0, 1.0, False) == "worse"    # latency up
    assert judge(100.0, None, 108.0, None, False) == ""       # percentile: needs > 10 %
    assert judge(100.0, None, 115.0, None, False) == "worse"


def _level(c, tok_s, se, ttft_mean, n=200, std=5.0):
    lat = {"ttft": {"n": n, "mean": ttft_mean, "std": std, "p99": ttft_mean * 2},
           "tpot": {"n": n, "mean": 10.0, "std": 0.1, "p99": 11.0},
           "e2e": {"n": n, "mean": 5000.0, "std": 10.0}}
    return {"concurrency": c, "throughput": {"output_tok_s": tok_s, "output_tok_s_se": se},
            "per_user": {"tok_s_user_median": 100.0}, "latency_ms": lat, "requests": {"errors": 0}}


def test_compare_flags_per_level():
    a = {"levels": [_level(1, 100.0, 1.0, 50.0), _level(32, 1000.0, 5.0, 200.0)]}
    b = {"levels": [_level(1, 101.0, 1.0, 50.2), _level(32, 800.0, 5.0, 300.0)]}
    rows = {(r["level"], r["metric"]): r["verdicts"][0] for r in compare([a, b])}
    assert rows[("C=1", "output tok/s")] == "" and rows[("C=1", "TTFT mean ms")] == ""
    assert rows[("C=32", "output tok/s")] == "worse" and rows[("C=32", "TTFT mean ms")] == "worse"


def test_compare_matches_levels_by_name_across_modes_and_old_results():
    """Results of schema 1 have no "level" name: they match by concurrency; rate levels by rate."""
    old = {"levels": [_level(8, 100.0, 1.0, 50.0)]}
    new = {"levels": [{**_level(8, 100.0, 1.0, 50.0), "level": "C=8", "mode": "closed"},
                      {**_level(None, 90.0, 1.0, 60.0), "level": "rate=4/s", "mode": "open", "rate": 4.0}]}
    rows = compare([old, new])
    assert [r["level"] for r in rows if r["metric"] == "output tok/s"] == ["C=8", "rate=4/s"]
    assert next(r for r in rows if r["level"] == "rate=4/s")["values"][0] is None


METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
vllm:generation_tokens_total{engine="0",model_name="m"} 1500.0
vllm:request_success_total{finished_reason="length",model_name="m"} 4.0
vllm:request_success_total{finished_reason="stop",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 5.0
"""


def test_level_deltas():
    before = snapshot(METRICS)
    after = dict(before, generation_tokens=2500.0, running=0.0)
    d = level_deltas(before, after, [dict(before, running=8.0), dict(before, running=4.0)])
    assert d["generation_tokens_delta"] == 1000.0
    assert d["running"] == {"before": 5.0, "after": 0.0, "mean_during": 6.0, "max_during": 8.0}
    assert d["kv_cache_usage_perc"]["before"] == pytest.approx(0.6) and d["engines"] == 2
    assert level_deltas(None, after, []) == {"available": False}


def test_docs_carry_every_formula_verbatim():
    """docs/benchmarking.md lists the definitions written into every result.json; keep them equal."""
    from pathlib import Path

    from orchestrator.bench.formulas import FORMULAS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "benchmarking.md").read_text()
    missing = [k for k, v in FORMULAS.items() if f"- **{k}**: {v}" not in doc]
    assert not missing, f"update docs/benchmarking.md for: {missing}"
