"""Read vLLM's Prometheus /metrics and turn before/after/during scrapes into per-level deltas.

Why: the server's own counters separate client artefacts from server behaviour - generation tokens
cross-check the client's token count, preemptions and waiting requests explain latency jumps.
Names from vLLM's metrics docs (https://docs.vllm.ai/en/latest/usage/metrics/); the old `gpu_cache_usage_perc`
is read when `kv_cache_usage_perc` is absent. Samples with several label sets (engines, finish
reasons) are summed, except the KV-cache percentage, which is averaged across engines.
"""

from __future__ import annotations

import re

GAUGES = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
COUNTERS = {
    "generation_tokens": ("vllm:generation_tokens_total", "vllm:generation_tokens"),
    "prompt_tokens": ("vllm:prompt_tokens_total", "vllm:prompt_tokens"),
    "preemptions": ("vllm:num_preemptions_total", "vllm:num_preemptions"),
    "request_success": ("vllm:request_success_total",),
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total",),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total",),
    "spec_decode_draft_tokens": ("vllm:spec_decode_num_draft_tokens_total",),
    "spec_decode_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens_total",),
}
_AVERAGED = {"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"}
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse(text: str) -> dict[str, float]:
    """{metric name: value} with label sets combined (summed, or averaged for KV usage)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        name = m.group(1)
        sums[name] = sums.get(name, 0.0) + v
        counts[name] = counts.get(name, 0) + 1
    for name in _AVERAGED & sums.keys():
        sums[name] /= counts[name]
    return sums


def pick(parsed: dict[str, float], names: tuple[str, ...]) -> float | None:
    for n in names:
        if n in parsed:
            return parsed[n]
    return None


def snapshot(text: str) -> dict[str, float | None]:
    p = parse(text)
    return {k: pick(p, names) for k, names in {**GAUGES, **COUNTERS}.items()}


def level_deltas(before: dict | None, after: dict | None, during: list[dict]) -> dict:
    """Counters: after - before. Gauges: before, after, and mean/max of the in-window samples."""
    if not before or not after:
        return {"available": False}
    out: dict = {"available": True, "samples_during": len(during)}
    for k in COUNTERS:
        a, b = after.get(k), before.get(k)
        out[f"{k}_delta"] = (a - b) if a is not None and b is not None else None
    for k in GAUGES:
        vals = [s[k] for s in during if s.get(k) is not None]
        out[k] = {"before": before.get(k), "after": after.get(k),
                  "mean_during": sum(vals) / len(vals) if vals else None,
                  "max_during": max(vals) if vals else None}
    return out
