"""Result files: result.json (versioned), requests.jsonl (one row per request), summary.csv.

Layout of an output folder:
    result.json     {"schema", "tool", "metadata", "options", "formulas", "levels": [...], "files"}
    requests.jsonl  one JSON object per request (every phase; field "phase" says which)
    summary.csv     one row per level, the headline numbers
    plots/*.png     see plots.py;   report.html   see html.py
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from orchestrator.bench.formulas import SCHEMA

CSV_COLUMNS = [
    ("level", lambda L: L.get("level") or f"C={L['concurrency']}"),
    ("mode", lambda L: L.get("mode", "closed")),
    ("concurrency", lambda L: L["concurrency"]),
    ("rate", lambda L: L.get("rate")),
    ("valid", lambda L: L["valid"]),
    ("client_verdict", lambda L: L.get("client_verdict")),
    ("aborted", lambda L: L.get("aborted") or ""),
    ("window_s", lambda L: L["timing_s"]["window"]),
    ("requests", lambda L: L["requests"]["window"]),
    ("errors", lambda L: L["requests"]["errors"]),
    ("output_tok_s", lambda L: L["throughput"]["output_tok_s"]),
    ("output_tok_s_se", lambda L: L["throughput"]["output_tok_s_se"]),
    ("requests_per_s", lambda L: L["throughput"]["requests_per_s"]),
    ("tok_s_user_median", lambda L: L["per_user"]["tok_s_user_median"]),
    ("tok_s_e2e_median", lambda L: L["per_user"]["tok_s_e2e_median"]),
    *[(f"{m}_{s}_ms", (lambda m, s: lambda L: L["latency_ms"][m].get(s))(m, s))
      for m in ("ttft", "ttfc", "tpot", "itl", "e2e") for s in ("mean", "p50", "p90", "p95", "p99", "max")],
    ("ttft_n", lambda L: L["latency_ms"]["ttft"].get("n")),
    ("queue_p99_ms", lambda L: L["latency_ms"]["queue"].get("p99")),
    ("completion_tokens_mean", lambda L: L["tokens"]["completion"].get("mean")),
    ("reasoning_tokens_mean", lambda L: L["tokens"]["reasoning"].get("mean")),
    ("client_cpu_pct", lambda L: L["client"]["cpu_pct"]),
    ("loop_lag_p99_ms", lambda L: L["client"]["loop_lag_ms"].get("p99")),
    ("slo_good_fraction", lambda L: (L.get("slo") or {}).get("good_fraction")),
    ("goodput_req_s", lambda L: (L.get("slo") or {}).get("goodput_req_s")),
    ("goodput_tok_s", lambda L: (L.get("slo") or {}).get("goodput_tok_s")),
    ("slo_met", lambda L: (L.get("slo") or {}).get("met")),
]


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def append_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


def write_csv(path: Path, levels: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([name for name, _ in CSV_COLUMNS])
        for L in levels:
            row = []
            for _, get in CSV_COLUMNS:
                v = get(L)
                row.append(f"{v:.4f}" if isinstance(v, float) else ("" if v is None else v))
            w.writerow(row)


def load_result(path: Path) -> dict:
    """A result.json (or the folder holding one); refuses files of another schema."""
    p = Path(path)
    if p.is_dir():
        p = p / "result.json"
    data = json.loads(p.read_text())
    if not str(data.get("schema", "")).startswith(SCHEMA.rsplit("/", 1)[0]):
        raise ValueError(f"{p}: not a vllm-orch bench result (schema {data.get('schema')!r})")
    data["_path"] = str(p)
    return data


def level_sort_key(L: dict) -> tuple:
    """Closed-loop levels by concurrency, then open-loop levels by rate (inf last)."""
    rate = L.get("rate")
    if rate is None:
        return (0, L["concurrency"] or 0)
    return (1, math.inf if rate == "inf" else rate, L["concurrency"] or 0)


def level_key(L: dict) -> str:
    """The name a level is matched by across runs (`bench compare`)."""
    return L.get("level") or f"C={L['concurrency']}"


def headline(data: dict) -> dict:
    """The numbers people quote, for deploy history and `status`."""
    levels = [L for L in data.get("levels", []) if L["requests"]["ok"]]
    single = next((L for L in levels if L.get("mode", "closed") == "closed" and L["concurrency"] == 1), None)
    peak = max(levels, key=lambda L: L["throughput"]["output_tok_s"], default=None)
    out = {
        "single_stream_tok_s": single["per_user"]["tok_s_user_median"] if single else None,
        "single_stream_ttft_ms": single["latency_ms"]["ttft"].get("p50") if single else None,
        "peak_output_tok_s": peak["throughput"]["output_tok_s"] if peak else None,
        "peak_concurrency": peak["concurrency"] if peak else None,
        "peak_level": level_key(peak) if peak else None,
        "peak_ttft_p99_ms": peak["latency_ms"]["ttft"].get("p99") if peak else None,
        "valid": all(L["valid"] for L in data.get("levels", [])),
    }
    search = data.get("search")
    if search:
        out["slo_best"] = search["best"]
        out["slo_search_kind"] = search["kind"]
    return out
