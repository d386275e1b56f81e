"""run_benchmark: the Python API behind `vllm-orch bench` (also called by `--host` mode).

    result = run_benchmark("http://127.0.0.1:8000", "kimi-k25", BenchOptions(concurrency=[1, 32]),
                           metadata={"manifest_hash": ..., "vllm_version": ..., "host_label": "staging"},
                           out_dir=Path("bench-results/run1"), console=rich_console)
    result.headline -> {"single_stream_tok_s": 61.3, "peak_output_tok_s": 1238.0, ...}
"""

from __future__ import annotations

import asyncio
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import __version__
from orchestrator.bench.client import Endpoint, http_get
from orchestrator.bench.formulas import FORMULAS, SCHEMA
from orchestrator.bench.loadgen import run_level
from orchestrator.bench.options import BenchOptions
from orchestrator.bench.prompts import RequestFactory
from orchestrator.bench.report import append_jsonl, headline, write_csv, write_json
from orchestrator.bench.shard import run_level_sharded
from orchestrator.bench.summary import summarize_level


@dataclass
class BenchResult:
    data: dict                                   # the content of result.json
    out_dir: Path
    files: dict[str, str] = field(default_factory=dict)

    @property
    def levels(self) -> list[dict]:
        return self.data["levels"]

    @property
    def headline(self) -> dict:
        return self.data["headline"]

    def history_entry(self) -> dict:
        """What `--host` mode appends to the host's deploy history (and `status` shows)."""
        m = self.data["metadata"]
        return {"operation": "bench", "ok": True, "time": m["started"], "model": m["model"],
                "served_name": m["served_name"], "label": m.get("label"), "result": str(self.out_dir),
                **self.headline}


def _loop_policy():
    try:
        import uvloop  # optional: used only when already installed

        return uvloop.EventLoopPolicy()
    except ImportError:
        return None


def run_benchmark(base_url: str, model: str, options: BenchOptions | None = None,
                  metadata: dict | None = None, out_dir: Path | None = None, console=None) -> BenchResult:
    """Run every concurrency level against base_url (OpenAI-compatible), write all report files."""
    opts = options or BenchOptions()
    out = Path(out_dir or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S"))
    policy = _loop_policy()
    if policy is not None:
        asyncio.set_event_loop_policy(policy)
    try:
        return asyncio.run(_run(base_url, model, opts, dict(metadata or {}), out, console))
    finally:
        if policy is not None:
            asyncio.set_event_loop_policy(None)


async def _probe(ep: Endpoint, model: str, api_key: str | None = None) -> dict:
    from orchestrator.errors import ConfigError
    from orchestrator.probe.api import model_ids

    info: dict = {}
    try:
        status, body = await http_get(ep, "/v1/models", timeout=10, api_key=api_key)
        if status == 200:
            info["served_models"] = model_ids(json.loads(body))
    except (TimeoutError, OSError, ValueError) as exc:
        raise ConnectionError(f"cannot reach {ep.url('/v1/models')}: {exc}") from exc
    if status == 401:
        raise ConfigError(f"{ep.url('/v1/models')} answered 401: the server wants an API key and "
                          f"{'got a wrong one' if api_key else 'got none'}",
                          hint="pass --api-key or export VLLM_API_KEY")
    try:
        status, body = await http_get(ep, "/version", timeout=5)
        if status == 200:
            info["server_version"] = json.loads(body).get("version")
    except (TimeoutError, OSError, ValueError):
        pass
    return info


async def _run(base_url: str, model: str, opts: BenchOptions, meta: dict, out: Path, console) -> BenchResult:
    from orchestrator.errors import ConfigError, ConnectError

    ep = Endpoint.parse(base_url)
    try:
        probe = await _probe(ep, model, opts.api_key)
    except ConnectionError as exc:
        raise ConnectError(str(exc), hint="is the server up? try: curl " + ep.url("/v1/models")) from exc
    served = probe.get("served_models")
    if served is not None and model not in served:
        raise ConfigError(f"the server does not serve {model!r}", hint=f"served names: {', '.join(map(str, served))}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "requests.jsonl").write_text("")
    metadata = {"tool": "vllm-orch bench", "tool_version": __version__, "model": meta.pop("model", model),
                "served_name": model, "endpoint": ep.url(""), "label": opts.label or None,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "client_host": platform.node(),
                "python": platform.python_version(), "server_version": probe.get("server_version"),
                **meta}
    data = {"schema": SCHEMA, "metadata": metadata, "options": opts.to_json(), "formulas": FORMULAS,
            "levels": [], "headline": {}}
    factory = RequestFactory(ep, model, opts)
    for c in opts.concurrency:
        procs = opts.processes_for(c)
        _say(console, f"[bold]C={c}[/]: warm-up {opts.warmup_s:g} s, window >= {opts.duration_s:g} s and "
                      f">= {opts.window_min_requests(c)} requests" + (f", {procs} processes" if procs > 1 else ""))
        live = _live(console)
        try:
            if procs > 1:
                run = await run_level_sharded(base_url, model, c, opts, procs)
            else:
                run = await run_level(ep, factory, c, opts, progress=_progress_fn(live))
        finally:
            if live is not None:
                live.stop()
        summary, rows = summarize_level(run, opts)
        append_jsonl(out / "requests.jsonl", rows)
        data["levels"].append(summary)
        _say(console, _level_line(summary))
        for w in summary["warnings"]:
            _say(console, f"  [yellow]warning:[/] {w}")
        write_json(out / "result.json", data)          # partial results survive an interrupt
    if console is not None and data["levels"]:
        console.print(levels_table(data["levels"]))
    data["headline"] = headline(data)
    data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    files = {"result": "result.json", "requests": "requests.jsonl", "summary_csv": "summary.csv"}
    write_csv(out / "summary.csv", data["levels"])
    from orchestrator.bench.html import write_html
    from orchestrator.bench.plots import PlotsUnavailable, write_plots

    plots: dict[str, Path] = {}
    try:
        plots = write_plots(data["levels"], out / "plots", f"{model}{' ' + opts.label if opts.label else ''}")
    except PlotsUnavailable as exc:                       # the report is still written, saying so
        data["plots_skipped"] = str(exc)
        from rich.markup import escape

        _say(console, f"[yellow]plots skipped:[/] {escape(str(exc))}")
    files.update({f"plot_{k}": str(p.relative_to(out)) for k, p in plots.items()})
    data["files"] = files
    write_html(out / "report.html", data, plots)
    files["html"] = "report.html"
    write_json(out / "result.json", data)
    return BenchResult(data, out, files)


def _say(console, text: str) -> None:
    if console is not None:
        console.print(text, highlight=False)


def _live(console):
    """A one-line live status, refreshed from the event loop (no refresh thread competing for the GIL)."""
    if console is None or not getattr(console, "is_terminal", False):
        return None
    from rich.live import Live

    live = Live(console=console, auto_refresh=False, transient=True)
    live.start()
    return live


def _progress_fn(live):
    if live is None:
        return None
    state = {"last": 0.0}

    def show(p: dict) -> None:
        now = time.monotonic()
        if now - state["last"] < 0.5:
            return
        state["last"] = now
        live.update(f"  C={p['concurrency']} {p['phase']}: {p['elapsed_s']:.0f} s, {p['completed']} done, "
                    f"window {p['window_done']}/{p['window_min']} requests, {p['window_s']:.0f}/"
                    f"{p['duration_s']:g} s, {p['errors']} errors", refresh=True)
    return show


def levels_table(levels: list[dict]):
    """The per-level table printed at the end of a run."""
    from rich.table import Table

    t = Table(title="bench results (ms; * = p99 from < 100 requests)")
    for col in ("C", "n", "err", "out tok/s", "req/s", "tok/s/user", "TTFT p50", "TTFT p99",
                "TPOT p50", "TPOT p99", "E2E p50", "E2E p99", "valid"):
        t.add_column(col, justify="right")
    for L in levels:
        lat = L["latency_ms"]

        def g(m, s, d=1):
            x = lat[m].get(s)
            return "-" if x is None else f"{x:.{d}f}" + ("*" if s == "p99" and lat[m].get("p99_low_n") else "")
        tps = L["per_user"]["tok_s_user_median"]
        t.add_row(str(L["concurrency"]), str(lat["ttft"].get("n", 0)), str(L["requests"]["errors"]),
                  f"{L['throughput']['output_tok_s']:.1f}", f"{L['throughput']['requests_per_s']:.2f}",
                  "-" if tps is None else f"{tps:.1f}", g("ttft", "p50"), g("ttft", "p99"),
                  g("tpot", "p50", 2), g("tpot", "p99", 2), g("e2e", "p50"), g("e2e", "p99"),
                  "yes" if L["valid"] else "[red]NO[/]")
    return t


def _level_line(L: dict) -> str:
    lat = L["latency_ms"]
    v = "" if L["valid"] else " [red]INVALID (client-bound)[/]"

    def g(m, s, d=1):
        x = lat[m].get(s)
        return "-" if x is None else f"{x:.{d}f}"
    tps = L["per_user"]["tok_s_user_median"]
    return (f"  C={L['concurrency']}: [bold]{L['throughput']['output_tok_s']:.1f} tok/s[/] aggregate, "
            f"{'-' if tps is None else f'{tps:.1f}'} tok/s/user, TTFT p50/p99 {g('ttft', 'p50')}/"
            f"{g('ttft', 'p99')} ms, TPOT p50 {g('tpot', 'p50', 2)} ms, E2E p99 {g('e2e', 'p99')} ms, "
            f"n={lat['ttft'].get('n', 0)}, errors {L['requests']['errors']}{v}")
