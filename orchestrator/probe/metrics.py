"""The one reader of vLLM's Prometheus `/metrics`, used by `status` and by bench.

Parsing is prometheus_client's text parser (vLLM serves this text with prometheus_client itself),
so label escaping, NaN/+Inf, histograms and `_created` series are read by the reference code.

vLLM labels every series with `model_name` and `engine`; a data-parallel service has one engine
per DP rank (vllm/v1/metrics/loggers.py: `labelnames = ["model_name", "engine"]`), so a DP8
service reports eight series of each metric. How they combine is explicit, per quantity:
  - KV-cache usage is a per-engine gauge of a per-engine cache: the service's figure is the MEAN
    over engines, and the fullest engine is the MAX. Never a sum (eight engines at 50% are 50%,
    not 400%).
  - requests running / waiting: SUM (each request sits in exactly one engine).
  - counters (tokens, preemptions, finished requests, prefix-cache queries/hits): SUM over every
    label set (engines, finished_reason).
Metric names: vllm `docs/usage/metrics.md`; `gpu_cache_usage_perc` (removed in 0.12) is read when
`kv_cache_usage_perc` is absent, and counters are found with or without the `_total` suffix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

SUM, MEAN, MAX = "sum", "mean", "max"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")

# The series vLLM 0.33 exports under these names (vllm/v1/metrics/loggers.py), every one labelled
# `model_name` and `engine` (one series per DP engine). `vllm-orch monitor`'s rules read these.
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_CACHE = KV_USAGE[0]
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
TTFT = "vllm:time_to_first_token_seconds"                   # histogram (TIME_TO_FIRST_TOKEN_BUCKETS)
TPOT = "vllm:request_time_per_output_token_seconds"         # histogram, per finished request
SLEEP_STATE = "vllm:engine_sleep_state"                     # gauge, label sleep_state: awake 1/0


@dataclass(frozen=True)
class Quantity:
    key: str                       # the name used in snapshots (status, bench result.json)
    names: tuple[str, ...]         # sample names, preferred first
    how: str                       # SUM, MEAN or MAX across label sets (engines)
    kind: str                      # "gauge" (a level) or "counter" (cumulative)


QUANTITIES = (
    Quantity("running", (RUNNING,), SUM, "gauge"),
    Quantity("waiting", (WAITING,), SUM, "gauge"),
    Quantity("kv_cache_usage_perc", KV_USAGE, MEAN, "gauge"),
    Quantity("kv_cache_usage_perc_max", KV_USAGE, MAX, "gauge"),
    Quantity("generation_tokens", (GENERATION_TOKENS, "vllm:generation_tokens"), SUM, "counter"),
    Quantity("prompt_tokens", (PROMPT_TOKENS, "vllm:prompt_tokens"), SUM, "counter"),
    Quantity("preemptions", ("vllm:num_preemptions_total", "vllm:num_preemptions"), SUM, "counter"),
    Quantity("request_success", ("vllm:request_success_total",), SUM, "counter"),
    Quantity("prefix_cache_queries", ("vllm:prefix_cache_queries_total",), SUM, "counter"),
    Quantity("prefix_cache_hits", ("vllm:prefix_cache_hits_total",), SUM, "counter"),
    Quantity("spec_decode_draft_tokens", ("vllm:spec_decode_num_draft_tokens_total",), SUM,
             "counter"),
    Quantity("spec_decode_accepted_tokens", ("vllm:spec_decode_num_accepted_tokens_total",), SUM,
             "counter"),
)
GAUGES = tuple(q.key for q in QUANTITIES if q.kind == "gauge")
COUNTERS = tuple(q.key for q in QUANTITIES if q.kind == "counter")


class MetricsError(ValueError):
    """The text is not Prometheus exposition format."""


@dataclass(frozen=True)
class Samples:
    """Every sample of a /metrics text: sample name -> [(labels, value)]."""

    by_name: dict[str, list[tuple[dict[str, str], float]]]

    def values(self, name: str) -> list[float]:
        return [v for _, v in self.by_name.get(name, ()) if not math.isnan(v)]

    def first_present(self, names: tuple[str, ...]) -> str | None:
        return next((n for n in names if n in self.by_name), None)

    def engines(self) -> list[str]:
        """The engine label values of vLLM's series ("0".."N-1" for a DP-N service)."""
        seen = {labels["engine"] for name, rows in self.by_name.items() if name.startswith("vllm:")
                for labels, _ in rows if "engine" in labels}
        return sorted(seen, key=lambda e: (len(e), e))

    def combine(self, names: tuple[str, ...], how: str) -> float | None:
        """The first present name's samples combined across label sets (None: no such metric)."""
        name = self.first_present(names)
        if name is None:
            return None
        vals = self.values(name)
        if not vals:
            return None
        if how == SUM:
            return sum(vals)
        if how == MEAN:
            # within [min, max]: a float sum of equal values, divided, can land one ulp above them
            # (eight engines at 0.3274793388429752 gave 0.32747933884297525)
            return min(max(vals), max(min(vals), sum(vals) / len(vals)))
        if how == MAX:
            return max(vals)
        raise ValueError(f"unknown aggregation {how!r}")


def parse(text: str) -> Samples:
    """All samples of a Prometheus text exposition; MetricsError if it is not one."""
    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                by_name.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise MetricsError(f"not Prometheus text: {exc}") from None
    return Samples(by_name)


def aborted(text: str) -> float | None:
    """Requests that ended aborted, over every engine: vllm:request_success_total with
    finished_reason="abort" (vllm/v1/metrics/loggers.py labels it by the FinishReason); None when
    the server exports no such series."""
    rows = parse(text).by_name.get("vllm:request_success_total")
    if rows is None:
        return None
    return sum(v for labels, v in rows if labels.get("finished_reason") == "abort" and not math.isnan(v))


def snapshot(text: str) -> dict[str, float | None]:
    """{quantity key: value or None} for every QUANTITIES entry, aggregated as documented above,
    plus "engines": how many engines report (1 for a server without the label)."""
    s = parse(text)
    out: dict[str, float | None] = {q.key: s.combine(q.names, q.how) for q in QUANTITIES}
    out["engines"] = float(len(s.engines()) or (1 if s.first_present(KV_USAGE) else 0)) or None
    return out
