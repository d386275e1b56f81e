"""Per-level aggregation: from a LevelRun's records to the level summary (definitions: formulas.py)."""

from __future__ import annotations

import math
from collections import Counter

from orchestrator.bench.loadgen import LevelRun
from orchestrator.bench.options import ABORT_GRACE_S, BenchOptions
from orchestrator.bench.promscrape import level_deltas
from orchestrator.bench.slo import evaluate
from orchestrator.bench.stats import mean_se, median, summarize, summarize_weighted
from orchestrator.bench.stream import NS, gap_samples, request_metrics, token_weights

SLICES = 5
LATENCY_KEYS = ("ttft_ms", "ttfc_ms", "tpot_ms", "e2e_ms", "e2e_incl_queue_ms", "queue_ms", "ttfb_ms")


def window_throughput(run: LevelRun, ok_records) -> tuple[float, float, list[float], float]:
    """(tok/s, its SE, per-slice tok/s, tokens) over the steady-state window."""
    t0, t1 = run.t_window_start, run.t_window_end
    span = t1 - t0
    if span <= 0:
        return 0.0, 0.0, [], 0.0
    bins = [0.0] * SLICES
    total = 0.0
    for rec in ok_records:
        w = token_weights(rec)
        for ts, k in zip(rec.chunk_ts, w):
            if t0 <= ts <= t1:
                total += k
                bins[min(SLICES - 1, (ts - t0) * SLICES // span)] += k
    rates = [b / (span / SLICES / 1e9) for b in bins]
    _, se = mean_se(rates)
    return total / (span / 1e9), se, rates, total


def client_check(run: LevelRun, opts: BenchOptions) -> tuple[str, list[str], list[str]]:
    """(verdict ok|marginal|invalid, invalid reasons, marginal notes) from loop lag and CPU.
    Two thresholds each (options.py says why): between them a level stays valid, with a note."""
    lag = summarize(run.lag_ms)
    p99 = lag.get("p99") if lag.get("n") else None
    cpu = run.cpu_pct / run.processes if run.cpu_pct is not None else None
    bad, notes = [], []
    if p99 is not None and p99 > opts.lag_p99_limit_ms:
        bad.append(f"event-loop lag p99 {p99:.1f} ms > {opts.lag_p99_limit_ms:g} ms")
    elif p99 is not None and p99 > opts.lag_p99_warn_ms:
        notes.append(f"event-loop lag p99 {p99:.1f} ms is above {opts.lag_p99_warn_ms:g} ms "
                     f"(invalid above {opts.lag_p99_limit_ms:g} ms)")
    if cpu is not None and cpu > opts.cpu_limit_pct:
        bad.append(f"client CPU {cpu:.0f}% of a core per process > {opts.cpu_limit_pct:g}%")
    elif cpu is not None and cpu > opts.cpu_warn_pct:
        notes.append(f"client CPU {cpu:.0f}% of a core per process is above {opts.cpu_warn_pct:g}% "
                     f"(invalid above {opts.cpu_limit_pct:g}%)")
    return ("invalid" if bad else "marginal" if notes else "ok"), bad, notes


def summarize_level(run: LevelRun, opts: BenchOptions, prompt_target: int | None = None
                    ) -> tuple[dict, list[dict]]:
    """(level summary, per-request rows). Rows cover every request (warm-up and drain too).
    prompt_target: the exact prompt_tokens every request was sized to (None: not sized)."""
    rows = [request_metrics(r) for r in run.records]
    pairs = list(zip(run.records, rows))
    window = [(r, row) for r, row in pairs if row["phase"] == "measure"]
    ok_all = [r for r, row in pairs if row["ok"]]
    ok_win = [(r, row) for r, row in window if row["ok"]]
    wrows = [row for _, row in ok_win]
    window_s = max(0.0, (run.t_window_end - run.t_window_start) / 1e9)

    tok_s, tok_s_se, slices, win_tokens = window_throughput(run, ok_all)
    t0, t1 = run.t_window_start, run.t_window_end
    finished_in_window = sum(1 for r in ok_all if r.chunk_ts and t0 <= r.chunk_ts[-1] <= t1)

    itl, itl_w, icl = [], [], []
    for row in rows:
        row["itl_max_ms"] = None
    for r, row in ok_win:
        a, b, c = gap_samples(r)
        itl += a
        itl_w += b
        icl += c
        row["itl_max_ms"] = max(a) if a else None

    cancelled = sum(1 for _, row in window if row["error_kind"] == "cancelled")
    errors = Counter(row["error_kind"] for _, row in window
                     if not row["ok"] and row["error_kind"] != "cancelled")
    warm_errors = Counter(row["error_kind"] for row in rows if row["phase"] != "measure" and not row["ok"])
    sources = Counter(row["tokens_source"] for row in wrows)
    flagged = sum(1 for row in wrows if row["discrepancy_flag"])
    ct = [row["completion_tokens"] for row in wrows]
    osl_mismatch = [100.0 * (row["completion_tokens"] - row["max_tokens"]) / row["max_tokens"]
                    for row in wrows if row["max_tokens"]]

    latency = {k.removesuffix("_ms"): summarize(row[k] for row in wrows) for k in LATENCY_KEYS}
    latency["itl"] = summarize_weighted(itl, itl_w)
    latency["icl"] = summarize(icl)

    lag = summarize(run.lag_ms)
    verdict, reasons, notes = client_check(run, opts)

    server = level_deltas(run.metrics_before, run.metrics_after, run.metrics_during)
    client_total = sum(row["completion_tokens"] or 0 for row in rows if row["ok"] or row["completion_tokens"])
    if server.get("available") and server.get("generation_tokens_delta") is not None:
        g = server["generation_tokens_delta"]
        server["client_completion_tokens"] = client_total
        server["generation_tokens_discrepancy_pct"] = (100.0 * (client_total - g) / g) if g else None

    warnings = []
    if sources.get("chunks"):
        warnings.append(f"{sources['chunks']} requests without server usage: tokens counted from chunks")
    if flagged:
        warnings.append(f"{flagged} requests where token-bearing chunks differ from completion_tokens "
                        f"by > 10% (multi-token chunks?)")
    if osl_mismatch and opts.ignore_eos:
        worst = max(osl_mismatch, key=abs)
        mean_asked = sum(row["max_tokens"] for row in wrows if row["max_tokens"]) / len(osl_mismatch)
        if abs(worst) > min(5.0, 5000.0 / mean_asked):
            warnings.append(f"output length differs from max_tokens by up to {worst:+.1f}%")
    prompt_counts = [row["prompt_tokens"] for row in wrows if row["prompt_tokens"] is not None]
    off_target = (sum(1 for c in prompt_counts if c != prompt_target)
                  if prompt_target is not None else None)
    if off_target:
        warnings.append(f"{off_target} of {len(prompt_counts)} requests had usage.prompt_tokens != "
                        f"{prompt_target} (the sized length)")
    disc = server.get("generation_tokens_discrepancy_pct")
    if disc is not None and abs(disc) > 10:
        warnings.append(f"server generation_tokens counter differs from usage by {disc:+.1f}% "
                        f"(another client on the server?)")
    if run.aborted:
        warnings.append(f"ABORTED: {run.aborted}")
    if cancelled:
        warnings.append(f"{cancelled} requests still running {ABORT_GRACE_S:g} s after the abort "
                        "were cancelled")
    if reasons:
        warnings.append("INVALID (client-bound): " + "; ".join(reasons))
    for n in notes:
        warnings.append("client marginal: " + n)
    if wrows and len(wrows) < 100:
        warnings.append(f"p99 from {len(wrows)} requests (< 100): close to the max")

    level = run.level
    summary = {
        "level": level.label,
        "mode": "closed" if level.closed else "open",
        "concurrency": run.concurrency,
        "rate": None if level.rate is None else (level.rate if math.isfinite(level.rate) else "inf"),
        "processes": run.processes,
        "valid": not reasons,
        "client_verdict": verdict,
        "invalid_reasons": reasons,
        "stop_reason": run.stop_reason,
        "aborted": run.aborted or None,
        "timing_s": {"warmup": (run.t_window_start - run.t_start) / 1e9, "window": window_s,
                     "drain": (run.t_drained - run.t_window_end) / 1e9},
        "requests": {"window": len(window), "ok": len(ok_win), "errors": sum(errors.values()),
                     "cancelled": cancelled,
                     "error_rate": (sum(errors.values()) / len(window)) if window else None,
                     "max_in_flight": run.max_in_flight,
                     "sent_per_s": (sum(1 for _, row in window if t0 <= row["t_send_ns"] <= t1)
                                    / window_s) if window_s else None,
                     "errors_by_kind": dict(errors), "warmup_and_drain": len(rows) - len(window),
                     "warmup_and_drain_errors_by_kind": dict(warm_errors)},
        "throughput": {"output_tok_s": tok_s, "output_tok_s_se": tok_s_se,
                       "output_tok_s_slices": slices, "window_tokens": win_tokens,
                       "requests_per_s": finished_in_window / window_s if window_s else 0.0},
        "per_user": {"tok_s_user_median": median(row["tok_s_user"] for row in wrows),
                     "tok_s_e2e_median": median(row["tok_s_e2e"] for row in wrows)},
        "latency_ms": latency,
        "tokens": {"completion": summarize(ct), "requested_max_tokens": str(opts.max_tokens),
                   "requested": summarize(row["max_tokens"] for row in wrows),
                   "osl_mismatch_pct": summarize(osl_mismatch),
                   "reasoning": summarize(row["reasoning_tokens"] for row in wrows),
                   "reasoning_source": dict(Counter(row["reasoning_source"] for row in wrows)),
                   "prompt": summarize(prompt_counts), "prompt_target": prompt_target,
                   "prompt_off_target": off_target,
                   "cached_prompt_tokens": sum(row["cached_tokens"] or 0 for row in wrows),
                   "tokens_source": dict(sources),
                   "chunk_count_discrepancy_pct": summarize(
                       row["chunk_count_discrepancy_pct"] for row in wrows),
                   "discrepancy_flagged": flagged},
        "server_metrics": server,
        "client": {"loop_lag_ms": lag, "cpu_pct": run.cpu_pct, "verdict": verdict,
                   "lag_p99_warn_ms": opts.lag_p99_warn_ms, "lag_p99_limit_ms": opts.lag_p99_limit_ms,
                   "cpu_warn_pct": opts.cpu_warn_pct, "cpu_limit_pct": opts.cpu_limit_pct},
        "warnings": warnings,
    }
    if not level.closed:
        summary["open_loop"] = {"offered_rate": summary["rate"], "window_arrivals": run.scheduled,
                                "arrivals": opts.arrivals, "burstiness": opts.burstiness,
                                "max_concurrency": opts.max_concurrency}
    if opts.slo:
        summary["slo"] = evaluate([row for _, row in window], opts.slo, opts.slo_percentile, window_s)
    for row, rec in zip(rows, run.records):
        row["level"] = level.label
        if opts.save_chunks:
            row["chunk_offsets_ms"] = [round((t - rec.t_send) / NS, 4) for t in rec.chunk_ts]
            row["chunk_tokens"] = list(rec.chunk_tok)
    return summary, rows
