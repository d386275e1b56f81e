"""Service-level objectives and goodput: which requests were good enough, and how many per second.

    parse_slo("ttft=500ms,tpot=50ms")  -> {"ttft": 500.0, "tpot": 50.0}     (milliseconds)

A request is good when it succeeded and meets every threshold given:
    ttft  its time to first token               <= threshold
    tpot  its (e2e - ttft) / (tokens - 1)        <= threshold (a one-token answer has no TPOT: met)
    itl   its longest inter-token gap, per token <= threshold (no token waited longer than that)
    e2e   its end-to-end latency                  <= threshold
good_fraction = good / window requests, failed ones included (a server that drops load cannot look
good). goodput = good requests (or their completion tokens) / window seconds. A level meets the SLO
when good_fraction >= percentile/100, i.e. the p-th percentile request meets every threshold.
"""

from __future__ import annotations

import re

from orchestrator.bench.stats import percentile

METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_max_ms", "e2e": "e2e_ms"}
_VALUE = re.compile(r"^([0-9]*\.?[0-9]+)\s*(ms|s|us)?$")
_UNIT_MS = {"ms": 1.0, None: 1.0, "s": 1000.0, "us": 0.001}


def parse_slo(text: str) -> dict[str, float]:
    """{metric: threshold ms} from "ttft=500ms,tpot=50ms" (units ms, s or us; bare numbers are ms)."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in METRICS:
            raise ValueError(f"{part!r}: expected METRIC=VALUE with METRIC one of "
                             f"{', '.join(METRICS)} (e.g. ttft=500ms,tpot=50ms)")
        m = _VALUE.match(value.strip().lower())
        if not m or float(m.group(1)) <= 0:
            raise ValueError(f"{part!r}: the value must be a positive time like 500ms or 2s")
        if key in out:
            raise ValueError(f"{key} is given twice")
        out[key] = float(m.group(1)) * _UNIT_MS[m.group(2)]
    if not out:
        raise ValueError("no objective given (e.g. ttft=500ms,tpot=50ms)")
    return out


def is_good(row: dict, slo: dict[str, float]) -> bool:
    if not row["ok"]:
        return False
    for key, limit in slo.items():
        v = row.get(METRICS[key])
        if v is None:
            if key == "tpot" or key == "itl":     # a one-token answer has no decode gaps
                continue
            return False
        if v > limit:
            return False
    return True


def evaluate(rows: list[dict], slo: dict[str, float], pct: float, window_s: float) -> dict:
    """The level's SLO section from its window rows (failed ones included)."""
    good = [r for r in rows if is_good(r, slo)]
    n = len(rows)
    frac = len(good) / n if n else 0.0
    per_metric = {}
    for key, limit in slo.items():
        vals = sorted(r[METRICS[key]] for r in rows if r["ok"] and r.get(METRICS[key]) is not None)
        at = percentile(vals, pct) if vals else None
        per_metric[key] = {"threshold_ms": limit, f"p{pct:g}_ms": at,
                           "fraction_within": (sum(1 for v in vals if v <= limit) / n) if n else None}
    return {
        "objectives_ms": dict(slo), "percentile": pct, "requests": n, "good": len(good),
        "good_fraction": frac, "met": bool(n) and frac >= pct / 100.0,
        "goodput_req_s": len(good) / window_s if window_s > 0 else 0.0,
        "goodput_tok_s": sum(r["completion_tokens"] or 0 for r in good) / window_s if window_s > 0 else 0.0,
        "metrics": per_metric,
    }


def describe(slo: dict[str, float], pct: float) -> str:
    return ", ".join(f"{k} <= {v:g} ms" for k, v in slo.items()) + f" for >= {pct:g}% of requests"
