"""Open-loop arrival schedules: when each request of a request-rate level is due.

Same model as `vllm bench serve` (vllm/benchmarks/serve.py, get_request): inter-arrival gaps are
gamma-distributed with shape = burstiness and mean 1/rate (burstiness 1: exponential gaps, a
Poisson process; < 1 burstier; > 1 more regular), or constant 1/rate. All gaps are drawn up front
and rescaled so the schedule spans exactly count/rate seconds (vLLM's comment: otherwise the sum
drifts 1-2% between seeds and so does throughput). Sending follows the absolute schedule, so
lateness never accumulates. Rate inf: every request is due at once.

Ramp-up (open loop): the rate rises linearly from 0 to `rate` over ramp_s seconds. The schedule is
drawn in "operational time" (a process of constant rate) and mapped through the inverse of the
cumulative rate, Lambda(t) = rate*t^2/(2R) for t < R and rate*(t - R/2) after, which turns the
same gaps into the ramped process without changing their distribution shape.
"""

from __future__ import annotations

import math
import random


def schedule(rate: float, count: int, *, burstiness: float = 1.0, constant: bool = False,
             ramp_s: float = 0.0, seed: int | str = 0) -> list[float]:
    """count + 1 offsets in seconds: when arrival 0..count-1 is due, then when the schedule ends
    (the instant the next arrival would have been due, so a window [t_W, t_end) holds
    count - W arrivals at the rate asked for)."""
    if count < 0:
        raise ValueError("count must be >= 0")
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * (count + 1)
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive number, got {burstiness}")
    rng = random.Random(f"arrivals:{seed}")
    if constant:
        gaps = [1.0] * count
    else:
        gaps = [rng.gammavariate(burstiness, 1.0 / burstiness) for _ in range(count)]
        total = math.fsum(gaps)
        if total > 0:
            gaps = [g * count / total for g in gaps]    # unit rate: the count gaps sum to count
    out, u = [0.0], 0.0
    for g in gaps:
        u += g
        out.append(u)
    return [warp(u / rate, ramp_s) for u in out]


def warp(s: float, ramp_s: float) -> float:
    """Real time of operational time s under a linear ramp of ramp_s seconds (identity if none)."""
    if ramp_s <= 0:
        return s
    return math.sqrt(2.0 * ramp_s * s) if s < ramp_s / 2 else s + ramp_s / 2


def warmup_arrivals(rate: float, warmup_s: float, ramp_s: float) -> int:
    """Arrivals due before the warm-up ends (it lasts at least as long as the ramp)."""
    if math.isinf(rate):
        return 0
    t = max(warmup_s, ramp_s)
    return round(rate * (t - ramp_s / 2)) if ramp_s > 0 else round(rate * t)
