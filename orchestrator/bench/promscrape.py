"""Turn before/after/during /metrics scrapes of a level into per-level figures.

Why: the server's own counters separate client artefacts from server behaviour - generation tokens
cross-check the client's token count, preemptions and waiting requests explain latency jumps.
Reading /metrics (names, and how vLLM's per-engine series combine: KV usage is a mean over DP
engines, requests and counters are sums) is orchestrator/probe/metrics.py, shared with `status`.
"""

from __future__ import annotations

from orchestrator.probe.metrics import COUNTERS, GAUGES, snapshot

__all__ = ["COUNTERS", "GAUGES", "level_deltas", "snapshot"]


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
    out["engines"] = after.get("engines") or before.get("engines")
    return out
