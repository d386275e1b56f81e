"""`bench compare A B ...`: results side by side per level, changes beyond noise flagged.

Noise rule (also in docs/benchmarking.md): a change of a metric between the baseline A and a run B
is flagged only when BOTH hold
  1. it is larger than 5% of the baseline value (smaller changes are within run-to-run variation
     seen on real deployments), and
  2. it is larger than 2 x the combined standard error, sqrt(SE_A^2 + SE_B^2), where SE is
     std/sqrt(n) over the window requests for latency means and tok/s per user, and the slice
     standard error (formulas: output_tok_s_se) for aggregate throughput. Percentiles have no SE
     here and use rule 1 only, with a 10% threshold.
Direction decides the colour: higher tok/s is better, lower latency is better.
"""

from __future__ import annotations

import math

from orchestrator.bench.report import level_key, level_sort_key

REL_MIN = 0.05
PCTL_REL_MIN = 0.10

# (label, getter(level) -> (value, se or None), higher_is_better)
METRICS = [
    ("output tok/s", lambda L: (L["throughput"]["output_tok_s"], L["throughput"]["output_tok_s_se"]), True),
    ("tok/s/user p50", lambda L: (L["per_user"]["tok_s_user_median"], None), True),
    ("TTFT mean ms", lambda L: _mean_se(L["latency_ms"]["ttft"]), False),
    ("TTFT p95 ms", lambda L: (L["latency_ms"]["ttft"].get("p95"), None), False),
    ("TTFT p99 ms", lambda L: (L["latency_ms"]["ttft"].get("p99"), None), False),
    ("TPOT mean ms", lambda L: _mean_se(L["latency_ms"]["tpot"]), False),
    ("TPOT p99 ms", lambda L: (L["latency_ms"]["tpot"].get("p99"), None), False),
    ("E2E mean ms", lambda L: _mean_se(L["latency_ms"]["e2e"]), False),
    ("errors", lambda L: (float(L["requests"]["errors"]), None), False),
    ("goodput req/s", lambda L: ((L.get("slo") or {}).get("goodput_req_s"), None), True),
]


def _mean_se(s: dict) -> tuple[float | None, float | None]:
    if not s.get("n"):
        return None, None
    return s["mean"], (s.get("std", 0.0) / math.sqrt(s["n"])) if s["n"] > 1 else None


def judge(a: float | None, sa: float | None, b: float | None, sb: float | None,
          higher_better: bool) -> str:
    """'better' / 'worse' / '' (within noise) for baseline a and candidate b."""
    if a is None or b is None:
        return ""
    delta = b - a
    if a == 0:
        beyond = abs(delta) > 0
    else:
        rel = abs(delta) / abs(a)
        if sa is None and sb is None:
            beyond = rel > PCTL_REL_MIN
        else:
            beyond = rel > REL_MIN and abs(delta) > 2 * math.sqrt((sa or 0) ** 2 + (sb or 0) ** 2)
    if not beyond:
        return ""
    return "better" if (delta > 0) == higher_better else "worse"


def compare(results: list[dict]) -> list[dict]:
    """Rows: {level, metric, values: [..], verdicts: [.. per run after the first]}; levels are
    matched by name (C=8, rate=4/s, ...)."""
    by_level = [{level_key(L): L for L in r["levels"]} for r in results]
    order = {level_key(L): level_sort_key(L) for r in results for L in r["levels"]}
    rows = []
    for key in sorted(order, key=lambda k: order[k]):
        for label, get, hib in METRICS:
            vals = [get(m[key]) if key in m else (None, None) for m in by_level]
            base = vals[0]
            verdicts = [judge(base[0], base[1], v[0], v[1], hib) for v in vals[1:]]
            rows.append({"level": key, "metric": label, "values": [v[0] for v in vals],
                         "verdicts": verdicts})
    return rows


def render(results: list[dict], rows: list[dict]):
    """The comparison as a Rich table."""
    from rich.table import Table

    names = [r.get("metadata", {}).get("label") or r.get("_path", f"run {i}") for i, r in enumerate(results)]
    t = Table(title="bench compare (first run is the baseline; flagged = beyond noise, see --help)")
    t.add_column("level")
    t.add_column("metric")
    for i, n in enumerate(names):
        t.add_column(("A: " if i == 0 else f"{chr(65 + i)}: ") + str(n), justify="right")
    last = None
    for row in rows:
        cells = []
        for i, v in enumerate(row["values"]):
            text = "-" if v is None else f"{v:,.2f}"
            if i > 0 and row["verdicts"][i - 1]:
                base = row["values"][0]
                pct = f" ({100 * (v - base) / base:+.1f}%)" if base else ""
                color = "green" if row["verdicts"][i - 1] == "better" else "red"
                text = f"[{color}]{text}{pct} {row['verdicts'][i - 1]}[/]"
            cells.append(text)
        t.add_row(row["level"] if row["level"] != last else "", row["metric"], *cells)
        last = row["level"]
    return t
