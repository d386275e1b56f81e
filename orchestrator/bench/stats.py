"""Summary statistics with a stated method, so numbers are comparable across runs and tools.

Percentiles: linear interpolation between closest ranks (Hyndman & Fan type 7, numpy's default
`linear`): for sorted x[0..n-1] and q in [0,100], h = (n-1)*q/100, value = x[floor h] +
(h - floor h) * (x[floor h + 1] - x[floor h]). Weighted variant (for token-weighted ITL): the
value at which the cumulative weight first reaches q% of the total (weighted nearest rank).
A p99 from fewer than 100 samples is mostly the max: it is reported with `p99_low_n: true`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

P99_MIN_N = 100
PERCENTILE_METHOD = ("linear interpolation between closest ranks (Hyndman-Fan type 7, numpy "
                     "'linear'); token-weighted ITL uses weighted nearest rank")


def percentile(sorted_x: Sequence[float], q: float) -> float:
    n = len(sorted_x)
    if n == 0:
        raise ValueError("no samples")
    h = (n - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, n - 1)
    return sorted_x[lo] + (h - lo) * (sorted_x[hi] - sorted_x[lo])


def summarize(values: Iterable[float | None]) -> dict:
    """{n, mean, p50, p90, p95, p99, max, min, std, p99_low_n}; n=0 gives only n."""
    xs = sorted(v for v in values if v is not None)
    n = len(xs)
    if n == 0:
        return {"n": 0}
    mean = math.fsum(xs) / n
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return {"n": n, "mean": mean, "p50": percentile(xs, 50), "p90": percentile(xs, 90),
            "p95": percentile(xs, 95), "p99": percentile(xs, 99), "max": xs[-1], "min": xs[0], "std": std,
            "p99_low_n": n < P99_MIN_N}


def summarize_weighted(values: Sequence[float], weights: Sequence[float]) -> dict:
    """Token-weighted summary (each value counts as many times as its weight)."""
    pairs = sorted((v, w) for v, w in zip(values, weights) if w > 0)
    if not pairs:
        return {"n": 0}
    total = math.fsum(w for _, w in pairs)
    mean = math.fsum(v * w for v, w in pairs) / total
    out = {"n": len(pairs), "tokens": total, "mean": mean, "max": pairs[-1][0],
           "min": pairs[0][0], "p99_low_n": len(pairs) < P99_MIN_N}
    for q in (50, 90, 95, 99):
        target, acc = total * q / 100.0, 0.0
        for v, w in pairs:
            acc += w
            if acc >= target - 1e-9:
                out[f"p{q}"] = v
                break
    return out


def median(values: Iterable[float | None]) -> float | None:
    xs = sorted(v for v in values if v is not None)
    return percentile(xs, 50) if xs else None


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error (std / sqrt(n)); SE is 0 for fewer than 2 values."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0
    m = math.fsum(values) / n
    if n < 2:
        return m, 0.0
    var = math.fsum((x - m) ** 2 for x in values) / (n - 1)
    return m, math.sqrt(var / n)
