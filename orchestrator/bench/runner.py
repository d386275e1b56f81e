"""run_benchmark: the Python API behind `vllm-orch bench` (also called by `--host` mode).

    result = run_benchmark("http://127.0.0.1:8000", "kimi-k25", BenchOptions(concurrency=[1, 32]),
                           metadata={"manifest_hash": ..., "vllm_version": ..., "host_label": "staging"},
                           out_dir=Path("bench-results/run1"), console=rich_console)
    result.headline -> {"single_stream_tok_s": 61.3, "peak_output_tok_s": 1238.0, ...}

Levels are closed-loop concurrencies (opts.concurrency) or open-loop request rates (opts.rates);
with opts.search and an SLO, levels are chosen one at a time to find the highest load meeting it.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import __version__
from orchestrator.bench.client import Endpoint, http_get
from orchestrator.bench.eventloop import run_coroutine
from orchestrator.bench.formulas import FORMULAS, SCHEMA
from orchestrator.bench.loadgen import run_level, run_open_level
from orchestrator.bench.options import BenchOptions, Level
from orchestrator.bench.prompts import RequestFactory, load_prompts
from orchestrator.bench.report import append_jsonl, headline, level_sort_key, write_csv, write_json
from orchestrator.bench.search import Search
from orchestrator.bench.shard import run_level_sharded
from orchestrator.bench.slo import describe
from orchestrator.bench.summary import summarize_level
from orchestrator.bench.tables import (
    level_intro,
    level_line,
    print_levels,
    progress_line,
    run_intro,
    search_line,
)
from orchestrator.bench.tokenizer import size_prompts


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


def run_benchmark(base_url: str, model: str, options: BenchOptions | None = None,
                  metadata: dict | None = None, out_dir: Path | None = None, console=None) -> BenchResult:
    """Run every level against base_url (OpenAI-compatible), write all report files."""
    opts = options or BenchOptions()
    out = Path(out_dir or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S"))
    meta = dict(metadata or {})
    return run_coroutine(_run(base_url, model, opts, meta, out, console), opts.event_loop)[0]


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


def _loop_name() -> str:
    import asyncio

    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"


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

    # built-in prompts always have a target length; a file's prompts only when one is asked for
    target = opts.input_tokens or (None if opts.prompts_file else opts.builtin_input_tokens())
    sized = await size_prompts(ep, model, load_prompts(opts), target, enabled=opts.exact_input,
                               api_key=opts.api_key,
                               template_kwargs=opts.extra_body.get("chat_template_kwargs"))
    run_warnings = [sized.warning] if sized.warning else []
    if sized.off_target:
        run_warnings.append(f"{sized.off_target} of {len(sized.bodies)} prompts could not be made "
                            f"exactly {target} tokens (decode/re-encode kept shifting the count)")
    for w in run_warnings:
        _say(console, f"[yellow]warning:[/] {w}")

    out.mkdir(parents=True, exist_ok=True)
    (out / "requests.jsonl").write_text("")
    metadata = {"tool": "vllm-orch bench", "tool_version": __version__, "model": meta.pop("model", model),
                "served_name": model, "endpoint": ep.url(""), "label": opts.label or None,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "client_host": platform.node(),
                "python": platform.python_version(), "event_loop": _loop_name(),
                "server_version": probe.get("server_version"),
                "load_model": "open" if opts.open_loop else "closed",
                "prompts": {**sized.to_json(), "source": str(opts.prompts_file) if opts.prompts_file
                            else "built-in", "seed": opts.seed},
                **meta}
    data: dict = {"schema": SCHEMA, "metadata": metadata, "options": opts.to_json(), "formulas": FORMULAS,
            "levels": [], "headline": {}, "warnings": run_warnings}
    if opts.slo:
        data["slo"] = {"objectives_ms": opts.slo, "percentile": opts.slo_percentile,
                       "rule": describe(opts.slo, opts.slo_percentile)}
    factory = RequestFactory(ep, model, opts, sized.bodies)
    prompt_target = target if sized.exact else None

    async def run_one(level: Level) -> dict:
        procs = opts.processes_for(level)
        _say(console, level_intro(level, opts, procs))
        live = _live(console)
        try:
            if procs > 1:
                run = await run_level_sharded(base_url, model, level, opts, procs, sized.bodies)
            elif level.rate is None:
                run = await run_level(ep, factory, level.concurrency or 1, opts,
                                      progress=_progress_fn(live, console))
            else:
                run = await run_open_level(ep, factory, level.rate, opts, progress=_progress_fn(live, console))
        finally:
            if live is not None:
                live.stop()
        summary, rows = summarize_level(run, opts, prompt_target)
        append_jsonl(out / "requests.jsonl", rows)
        data["levels"].append(summary)
        _say(console, level_line(summary))
        for w in summary["warnings"]:
            _say(console, f"  [yellow]warning:[/] {w}")
        write_json(out / "result.json", data)          # partial results survive an interrupt
        return summary

    if opts.search:
        search = _search_for(opts)
        _say(console, f"[bold]search[/]: the highest {'rate' if opts.open_loop else 'concurrency'} "
                      f"meeting {describe(opts.slo, opts.slo_percentile)}")
        while (x := search.next()) is not None:
            level = Level(opts.max_concurrency, x) if opts.open_loop else Level(int(x))
            s = await run_one(level)
            search.record(x, bool(s["slo"]["met"]) and not s["aborted"])
        data["search"] = {"kind": "rate" if opts.open_loop else "concurrency", **search.result()}
        _say(console, search_line(data["search"]))
    else:
        _say(console, run_intro(opts))
        for level in opts.levels():
            await run_one(level)

    data["levels"].sort(key=level_sort_key)
    if console is not None and data["levels"]:
        print_levels(console, data["levels"], bool(opts.slo))
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
        from orchestrator.fmt import escape

        _say(console, f"[yellow]plots skipped:[/] {escape(str(exc))}")
    files.update({f"plot_{k}": str(p.relative_to(out)) for k, p in plots.items()})
    data["files"] = files
    write_html(out / "report.html", data, plots)
    files["html"] = "report.html"
    write_json(out / "result.json", data)
    return BenchResult(data, out, files)


def _search_for(opts: BenchOptions) -> Search:
    values: list[float] = list(opts.rates if opts.rates is not None else opts.concurrency)
    return Search(min(values), max(values), integer=not opts.open_loop,
                  precision=opts.search_precision, max_levels=opts.search_levels)


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


PROGRESS_LINE_S = 15.0      # without a terminal: one progress line (with the level's ETA) this often


def _progress_fn(live, console=None):
    """The running level's progress and time left: a live line on a terminal, else (a pipe, a CI
    log) a printed line every PROGRESS_LINE_S; None without a console."""
    if live is None and console is None:
        return None
    state = {"last": time.monotonic() if live is None else 0.0}
    every = 0.5 if live is not None else PROGRESS_LINE_S

    def show(p: dict) -> None:
        now = time.monotonic()
        if now - state["last"] < every:
            return
        state["last"] = now
        if live is not None:
            live.update(progress_line(p), refresh=True)
        else:
            from orchestrator.fmt import escape

            _say(console, escape(progress_line(p)))
    return show
