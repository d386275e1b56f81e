"""One self-contained HTML report: metadata, headline, per-level tables, plots inlined as base64, formulas.

No JavaScript and no external resources, so it opens anywhere (and offline) without console errors.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:1.4em} h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px;margin:8px 0}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:right} th{background:#f3f3f3}
td.l,th.l{text-align:left} .bad{color:#b00020;font-weight:600} .warn{color:#9a6700}
img{max-width:100%;border:1px solid #eee;margin:6px 0} code{background:#f5f5f5;padding:0 3px}
"""


def _f(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return html.escape(str(v))


def _table(head: list[str], rows: list[list], left: int = 1) -> str:
    th = "".join(f'<th class="{"l" if i < left else ""}">{html.escape(h)}</th>' for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td class="{"l" if i < left else ""}">{c}</td>'
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def render_html(data: dict, plots: dict[str, Path]) -> str:
    meta = data.get("metadata", {})
    levels = data.get("levels", [])
    title = f"vllm-orch bench: {meta.get('model', '?')}" + (f" [{meta['label']}]" if meta.get("label") else "")
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
             f"<link rel='icon' href='data:,'><title>{html.escape(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    if meta.get("host_label"):   # the inventory's note on the host, e.g. SIMULATED: shown first
        parts.append(f"<p class='warn'>Host {html.escape(str(meta.get('host', '?')))}: "
                     f"{html.escape(str(meta['host_label']))}</p>")
    parts.append("<h2>Run</h2>" + _table(["field", "value"], [
        [html.escape(k), _f(v) if not isinstance(v, (list, dict)) else f"<code>{html.escape(str(v))}</code>"]
        for k, v in meta.items()]))
    hl = data.get("headline", {})
    parts.append("<h2>Headline</h2>" + _table(["", "value"], [
        ["single stream tok/s per user (median 1/TPOT, C=1)", _f(hl.get("single_stream_tok_s"))],
        ["single stream TTFT p50 (ms)", _f(hl.get("single_stream_ttft_ms"))],
        ["peak aggregate output tok/s", _f(hl.get("peak_output_tok_s"))],
        ["at level", _f(hl.get("peak_level"))],
        ["TTFT p99 at peak (ms)", _f(hl.get("peak_ttft_p99_ms"))],
        ["all levels valid (client not the bottleneck)",
         _f(hl.get("valid")) if hl.get("valid") else "<span class='bad'>no</span>"],
    ]))
    if data.get("slo"):
        srch = data.get("search") or {}
        parts.append("<h2>SLO</h2>" + _table(["", "value"], [
            ["objective", html.escape(data["slo"]["rule"])],
            *([[f"highest {srch['kind']} meeting it (search)", _f(srch.get("best"))],
               ["lowest tried that missed it", _f(srch.get("first_failing"))],
               ["levels run", _f(srch.get("levels_run"))], ["search stopped", _f(srch.get("note"))]]
              if srch else [])]))
    if data.get("warnings"):
        parts.append("<p class='warn'>" + "<br>".join(html.escape(w) for w in data["warnings"]) + "</p>")

    slo_on = bool(data.get("slo"))
    rows = []
    for L in levels:
        lat, tp = L["latency_ms"], L["throughput"]
        n = lat["ttft"].get("n", 0)
        p99 = lambda m: _f(lat[m].get("p99")) + ("*" if lat[m].get("p99_low_n") else "")  # noqa: E731
        slo = L.get("slo") or {}
        verdict = L.get("client_verdict") or ("ok" if L["valid"] else "invalid")
        rows.append([html.escape(L.get("level") or f"C={L['concurrency']}"), _f(n),
                     _f(L["requests"]["errors"]) + (" <span class='bad'>ABORTED</span>" if L.get("aborted") else ""),
                     f"{_f(tp['output_tok_s'])} &plusmn; {_f(tp['output_tok_s_se'])}",
                     _f(tp["requests_per_s"], 2), _f(L["per_user"]["tok_s_user_median"]),
                     _f(lat["ttft"].get("p50")), _f(lat["ttft"].get("p95")), p99("ttft"),
                     _f(lat["ttfc"].get("p50")), _f(lat["tpot"].get("p50"), 2),
                     _f(lat["tpot"].get("p95"), 2), p99("tpot"), _f(lat["itl"].get("p50"), 2),
                     _f(lat["e2e"].get("p50")), _f(lat["e2e"].get("p95")), p99("e2e"),
                     _f(lat["queue"].get("p99"), 3),
                     *([_f(100 * slo["good_fraction"]) if slo else "-", _f(slo.get("goodput_req_s"), 2),
                        _f(slo.get("goodput_tok_s")),
                        ("met" if slo.get("met") else "<span class='bad'>missed</span>") if slo else "-"]
                       if slo_on else []),
                     {"ok": "ok", "marginal": "<span class='warn'>marginal</span>"}.get(
                         verdict, "<span class='bad'>INVALID</span>")])
    parts.append("<h2>Levels</h2>" + _table(
        ["level", "n", "errors", "output tok/s (window)", "req/s", "tok/s/user", "TTFT p50",
         "TTFT p95", "TTFT p99", "TTFC p50", "TPOT p50", "TPOT p95", "TPOT p99", "ITL p50",
         "E2E p50", "E2E p95", "E2E p99", "queue p99",
         *(["good %", "goodput req/s", "goodput tok/s", "SLO"] if slo_on else []), "client"],
        rows) + "<p>Times in ms. * p99 from fewer than 100 requests. Client: ok, marginal (valid, "
                "near the self-check limits) or INVALID (the client may have been the bottleneck).</p>")

    for name, alt in (("throughput", "throughput vs concurrency"), ("latency", "latency percentiles"),
                      ("per_user", "per-user vs aggregate")):
        if name in plots:
            parts.append(_img(plots[name], alt))
    if data.get("plots_skipped"):
        parts.append(f"<p class='warn'>Plots skipped: {html.escape(data['plots_skipped'])}</p>")

    detail = []
    for L in levels:
        s = L["server_metrics"]
        errs = ", ".join(f"{k}: {v}" for k, v in L["requests"]["errors_by_kind"].items()) or "none"
        detail.append([html.escape(L.get("level") or f"C={L['concurrency']}"), html.escape(errs),
                       _f(L["tokens"]["completion"].get("mean")), _f(L["tokens"]["reasoning"].get("mean")),
                       _f(L["tokens"]["discrepancy_flagged"]),
                       _f(s.get("generation_tokens_delta")) if s.get("available") else "n/a",
                       _f(s.get("generation_tokens_discrepancy_pct")) if s.get("available") else "n/a",
                       _f((s.get("waiting") or {}).get("max_during")) if s.get("available") else "n/a",
                       _f((s.get("kv_cache_usage_perc") or {}).get("max_during"), 3) if s.get("available") else "n/a",
                       _f(s.get("preemptions_delta")) if s.get("available") else "n/a",
                       _f(L["client"]["cpu_pct"]), _f(L["client"]["loop_lag_ms"].get("p99"), 2),
                       "<br>".join(html.escape(w) for w in L["warnings"]) or "-"])
    parts.append("<h2>Tokens, errors, server metrics, client self-check</h2>" + _table(
        ["level", "errors by kind", "completion tok (mean)", "reasoning tok (mean)", "chunk/usage flags",
         "server gen. tokens", "server vs usage %", "waiting max", "KV usage max", "preemptions",
         "client CPU %", "loop lag p99 ms", "warnings"], detail, left=2))

    parts.append("<h2>Definitions</h2>" + _table(
        ["name", "definition"], [[f"<code>{html.escape(k)}</code>", html.escape(v)]
                                 for k, v in data.get("formulas", {}).items()], left=2))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(path: Path, data: dict, plots: dict[str, Path]) -> Path:
    path.write_text(render_html(data, plots), encoding="utf-8")
    return path
