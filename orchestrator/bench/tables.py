"""What a run prints: the per-level lines, the final table, and the search result.

The final table is printed at its natural width when the output is not a terminal, so the figures
survive in logs and redirected output (Rich otherwise assumes 80 columns and cuts columns off).
"""

from __future__ import annotations

import math

from orchestrator.bench.options import BenchOptions, Level


def print_wide(console, renderable) -> None:
    """Print a table at its natural width when the output is not a terminal (a log, a pipe, a
    file): Rich would otherwise assume 80 columns and cut the figures off."""
    if getattr(console, "is_terminal", False):
        console.print(renderable)
        return
    from rich.measure import Measurement

    need = Measurement.get(console, console.options.update(width=10_000), renderable).maximum
    old = console.width
    console.width = max(old, need)
    try:
        console.print(renderable)
    finally:
        console.width = old


def level_intro(level: Level, opts: BenchOptions, procs: int) -> str:
    if level.rate is None:
        what = (f"warm-up {max(opts.warmup_s, opts.ramp_up_s):g} s"
                + (f" (ramp-up {opts.ramp_up_s:g} s)" if opts.ramp_up_s else "")
                + f", window >= {opts.duration_s:g} s and >= {opts.window_min_requests(level.concurrency)} requests")
    elif math.isinf(level.rate):
        what = f"{opts.window_min_requests(level.concurrency)} requests at once"
    else:
        what = (f"{opts.arrivals}" + (f" (burstiness {opts.burstiness:g})" if opts.arrivals == "poisson"
                                      and opts.burstiness != 1 else "")
                + f" arrivals, warm-up {max(opts.warmup_s, opts.ramp_up_s):g} s, window >= "
                  f"{opts.duration_s:g} s")
    return f"[bold]{level.label}[/]: {what}" + (f", {procs} processes" if procs > 1 else "")


def run_intro(opts: BenchOptions) -> str:
    """What a fixed sweep will take at the least, before its first level: every level's warm-up and
    window, and that a window also waits for its minimum requests (at low concurrency with long
    answers that is what takes the time; each level's line then says how long it has left)."""
    levels = opts.levels()
    warm = max(opts.warmup_s, opts.ramp_up_s)
    least = sum(warm + opts.duration_s for lv in levels if lv.rate is None or not math.isinf(lv.rate))
    return (f"[bold]{len(levels)} level{'s' if len(levels) != 1 else ''}[/]: at least {least:.0f} s "
            f"(each a warm-up of {warm:g} s and a window of >= {opts.duration_s:g} s that also waits for "
            f"its minimum requests; each level says how long it has left)")


def eta(p: dict) -> str:
    """How long the running level has left, from its progress (loadgen's report): the window's
    rest or, when slower, the minimum requests at the window's rate so far."""
    if p.get("phase") != "window" or not p.get("window_s"):
        return "in warm-up"
    left_s = max(0.0, p["duration_s"] - p["window_s"])
    need = p["window_min"] - p["window_done"]
    if need > 0:
        if not p["window_done"]:
            return "the first requests of the window are still running"
        left_s = max(left_s, need * p["window_s"] / p["window_done"])
    return f"~{left_s:.0f} s left in this level"


def progress_line(p: dict) -> str:
    return (f"  {p['level']} {p['phase']}: {p['elapsed_s']:.0f} s, {p['completed']} done, "
            f"{p['in_flight']} in flight, window {p['window_done']}/{p['window_min']} requests, "
            f"{p['window_s']:.0f}/{p['duration_s']:g} s, {p['errors']} errors; {eta(p)}")


def _fmt(x, d: int = 1) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def print_fitted(console, table, parts) -> None:
    """Print `table` whole when it fits the terminal (or the output is no terminal: at its natural
    width, print_wide); on a narrower terminal, as the tables `parts()` makes (each with the row
    names first), one under the other, instead of cutting figures off (80 columns cut the bench's
    15)."""
    from rich.measure import Measurement

    if not getattr(console, "is_terminal", False) or \
            Measurement.get(console, console.options.update(width=10_000), table).maximum <= console.width:
        print_wide(console, table)
        return
    for part in parts():
        console.print(part)


LEVEL_COLUMNS = (("level", "n", "err", "out tok/s", "req/s", "tok/s/user"),
                 ("TTFT p50", "TTFT p95", "TTFT p99", "TPOT p50", "TPOT p95", "TPOT p99"),
                 ("E2E p50", "E2E p95", "E2E p99"))
SLO_COLUMNS = ("good %", "goodput req/s", "goodput tok/s", "SLO")


def print_levels(console, levels: list[dict], with_slo: bool = False) -> None:
    """The per-level table at the end of a run, split by kind of figure on a narrow terminal."""
    # on a narrow terminal: throughput (with the verdict), TTFT + TPOT, E2E (+ SLO): each led by the level
    parts = [(*LEVEL_COLUMNS[0], "client"), ("level", *LEVEL_COLUMNS[1]),
             ("level", *LEVEL_COLUMNS[2], *(SLO_COLUMNS if with_slo else ()))]
    print_fitted(console, levels_table(levels, with_slo),
                 lambda: [levels_table(levels, with_slo, only=p) for p in parts])


def levels_table(levels: list[dict], with_slo: bool = False, only: tuple[str, ...] | None = None):
    """The per-level table printed at the end of a run (`only`: these columns, in the table's order)."""
    from rich.table import Table

    t = Table(title="bench results (ms; * = p99 from < 100 requests)")
    cols = [c for group in LEVEL_COLUMNS for c in group]
    if with_slo:
        cols += list(SLO_COLUMNS)
    cols.append("client")
    keep = [c for c in cols if only is None or c in only]
    for col in keep:
        t.add_column(col, justify="left" if col == "level" else "right", no_wrap=True)
    for L in levels:
        lat = L["latency_ms"]

        def g(m, s, d=1):
            x = lat[m].get(s)
            return _fmt(x, d) + ("*" if x is not None and s == "p99" and lat[m].get("p99_low_n") else "")
        row = [L.get("level") or f"C={L['concurrency']}", str(lat["ttft"].get("n", 0)),
               str(L["requests"]["errors"]) + (" ABORTED" if L.get("aborted") else ""),
               _fmt(L["throughput"]["output_tok_s"]), _fmt(L["throughput"]["requests_per_s"], 2),
               _fmt(L["per_user"]["tok_s_user_median"]),
               g("ttft", "p50"), g("ttft", "p95"), g("ttft", "p99"),
               g("tpot", "p50", 2), g("tpot", "p95", 2), g("tpot", "p99", 2),
               g("e2e", "p50"), g("e2e", "p95"), g("e2e", "p99")]
        if with_slo:
            s = L.get("slo") or {}
            row += [_fmt(100 * s["good_fraction"]) if s else "-", _fmt(s.get("goodput_req_s"), 2),
                    _fmt(s.get("goodput_tok_s")), ("met" if s.get("met") else "[red]missed[/]") if s else "-"]
        verdict = L.get("client_verdict") or ("ok" if L["valid"] else "invalid")
        row.append({"ok": "ok", "marginal": "[yellow]marginal[/]"}.get(verdict, "[red]INVALID[/]"))
        t.add_row(*[cell for col, cell in zip(cols, row) if col in keep])
    return t


def level_line(L: dict) -> str:
    lat = L["latency_ms"]
    v = {"ok": "", "marginal": " [yellow](client marginal)[/]"}.get(L.get("client_verdict") or "",
                                                                   " [red]INVALID (client-bound)[/]")
    tps = L["per_user"]["tok_s_user_median"]
    slo = L.get("slo")
    good = (f", SLO {'met' if slo['met'] else '[red]missed[/]'} ({100 * slo['good_fraction']:.0f}% good, "
            f"goodput {slo['goodput_req_s']:.2f} req/s)") if slo else ""
    abort = f" [red]ABORTED: {L['aborted']}[/]" if L.get("aborted") else ""
    return (f"  {L.get('level')}: [bold]{L['throughput']['output_tok_s']:.1f} tok/s[/] aggregate, "
            f"{_fmt(tps)} tok/s/user, TTFT p50/p95/p99 {_fmt(lat['ttft'].get('p50'))}/"
            f"{_fmt(lat['ttft'].get('p95'))}/{_fmt(lat['ttft'].get('p99'))} ms, TPOT p50 "
            f"{_fmt(lat['tpot'].get('p50'), 2)} ms, E2E p99 {_fmt(lat['e2e'].get('p99'))} ms, "
            f"n={lat['ttft'].get('n', 0)}, errors {L['requests']['errors']}{good}{v}{abort}")


def search_line(s: dict) -> str:
    unit = "/s" if s["kind"] == "rate" else ""
    best = "none" if s["best"] is None else f"{s['best']:g}{unit}"
    fail = "" if s["first_failing"] is None else f" (missed at {s['first_failing']:g}{unit})"
    return f"[bold]search result[/]: highest {s['kind']} meeting the SLO: {best}{fail}, " \
           f"{s['levels_run']} levels; {s['note']}"
