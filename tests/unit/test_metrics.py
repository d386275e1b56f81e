"""The one Prometheus reader (orchestrator/probe/metrics.py) on /metrics text recorded from vLLM
0.33.0's own metrics code (tests/fixtures/vllm-metrics/record.py says how): a DP8 service in the
multi-API-server registry vLLM uses for DP, and a single-engine (TP) service."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from orchestrator.probe import metrics

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-metrics"


def recorded(name: str) -> str:
    return gzip.decompress((FIXTURES / name).read_bytes()).decode()


def test_dp8_kv_usage_is_the_per_engine_mean_never_the_sum():
    text = recorded("dp8-multiproc.prom.gz")
    s = metrics.parse(text)
    assert s.engines() == [str(i) for i in range(8)]
    per_engine = s.values("vllm:kv_cache_usage_perc")
    assert sum(per_engine) == pytest.approx(4.0)          # what summing every series said: 400%
    snap = metrics.snapshot(text)
    assert snap["kv_cache_usage_perc"] == pytest.approx(0.5)
    assert snap["kv_cache_usage_perc_max"] == pytest.approx(0.75)
    assert snap["engines"] == 8


def test_dp8_requests_and_counters_are_sums_over_engines():
    snap = metrics.snapshot(recorded("dp8-multiproc.prom.gz"))
    assert snap["running"] == sum(3 + e for e in range(8))
    assert snap["waiting"] == 4
    assert snap["generation_tokens"] == sum(100 * (e + 1) for e in range(8))
    assert snap["prompt_tokens"] == 8 * 40
    assert snap["request_success"] == 8                  # summed over engines and finished_reason
    assert snap["prefix_cache_queries"] == 8000
    assert snap["preemptions"] == 0
    assert snap["spec_decode_draft_tokens"] is None      # no speculative decoding configured


def test_single_engine_registry_with_created_series():
    text = recorded("tp8-single.prom.gz")
    assert "vllm:generation_tokens_created{" in text     # timestamps, not to be summed
    snap = metrics.snapshot(text)
    assert snap["engines"] == 1
    assert snap["kv_cache_usage_perc"] == snap["kv_cache_usage_perc_max"] == 0.5
    assert (snap["running"], snap["waiting"], snap["generation_tokens"]) == (3, 0, 100)


def test_untyped_samples_and_the_pre_0_12_kv_name():
    text = ('vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
            'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
            'vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.7\n'
            'vllm:request_success_total{finished_reason="length",model_name="m"} 4.0\n'
            'vllm:request_success_total{finished_reason="stop",model_name="m"} 1.0\n')
    snap = metrics.snapshot(text)
    assert snap["running"] == 5.0 and snap["request_success"] == 5.0 and snap["waiting"] is None
    assert snap["kv_cache_usage_perc"] == pytest.approx(0.6)
    assert snap["kv_cache_usage_perc_max"] == pytest.approx(0.7)
    assert snap["engines"] == 2


def test_not_prometheus_text_is_one_error():
    with pytest.raises(metrics.MetricsError):
        metrics.parse('vllm:num_requests_running{engine="0" 3.0\n')
    with pytest.raises(metrics.MetricsError):
        metrics.parse("<html>502 Bad Gateway</html>\n")
    assert metrics.snapshot("")["engines"] is None


def test_the_mean_of_equal_engines_is_never_above_their_max():
    """Eight engines at the same usage: the float sum divided by 8 landed one ulp above the value,
    so status said mean > max (seen in a --quick run)."""
    v = 0.3274793388429752
    assert sum([v] * 8) / 8 > v                            # the float arithmetic that did it
    text = "".join(f'vllm:kv_cache_usage_perc{{engine="{i}",model_name="m"}} {v!r}\n' for i in range(8))
    snap = metrics.snapshot("# TYPE vllm:kv_cache_usage_perc gauge\n" + text)
    assert snap["kv_cache_usage_perc"] == v == snap["kv_cache_usage_perc_max"]
