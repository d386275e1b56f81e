"""`vllm-orch bench`: run a benchmark (`--url`/`--host`) or compare results (`bench compare A B ...`)."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click

from orchestrator.cli.options import accept_new_host_key_option, exit_codes, host_option, json_option, model_argument
from orchestrator.errors import ConfigError

HELP = """Benchmark a served model: a concurrency sweep (closed loop) or request rates (open loop),
with SLO goodput and reports.

\b
Examples:
  vllm-orch bench --url http://127.0.0.1:8000 --model kimi-k25
  vllm-orch bench --url http://gpu1:8000/v1 --model kimi-k25 -c 1,8,32 --duration 30 --label tp8
  vllm-orch bench --host gpu1                       # endpoint and served name from the active deployment
  vllm-orch bench --host sim kimi-k25-int4 -c 1,32 --max-tokens 256:768 --ramp-up 10
  vllm-orch bench --host gpu1 --rate 2,4,8,inf --max-concurrency 128 --slo ttft=2s,tpot=50ms
  vllm-orch bench --host gpu1 --slo ttft=2s,tpot=50ms --search          # highest C meeting the SLO
  vllm-orch bench --host gpu1 --prompts sharegpt.json --input-tokens 1024 --seed 7
  vllm-orch bench compare bench-results/a bench-results/b   # side by side, changes beyond noise flagged

\b
Closed loop (-c): C streams (one keep-alive connection each) send the next request when the last
ends; --ramp-up staggers their starts and a --max-tokens range breaks their lock-step. Open loop
(--rate): requests are due on a Poisson (or --burstiness gamma, or constant) schedule whatever the
server does, optionally capped by --max-concurrency: latency at an arrival rate, what an SLO is
written against. Each level: a warm-up, a window of at least --duration seconds and --min-requests
requests, a drain. Prompt lengths are exact in the server's tokens (its /tokenize) when it has
one. Output tokens come from the server's usage (reasoning included); TPOT = (E2E - TTFT) /
(tokens - 1). Written to --out: result.json (formulas inside), requests.jsonl, summary.csv,
plots/*.png and report.html. The client checks itself: a level is "marginal" when event-loop lag
p99 > 10 ms or client CPU > 80% of a core, INVALID above 25 ms or 95%. See docs/benchmarking.md.
"""

COMPARE_HELP = """Compare bench results side by side per concurrency level.

\b
Examples:
  vllm-orch bench compare bench-results/before bench-results/after
  vllm-orch bench compare run1/result.json run2/result.json run3/result.json

\b
The first result is the baseline. A change is flagged only when it is > 5% of the baseline AND
> 2 x sqrt(SE_A^2 + SE_B^2) (SE = standard error: std/sqrt(n) for latency means, the window-slice
SE for aggregate tok/s); percentiles have no SE and need > 10%. Exit code 1 with --fail-on-worse
when any metric got worse beyond noise.
"""


def _levels(ctx, param, text: str) -> list[int]:
    """-c: concurrency levels; click names the option in the error."""
    try:
        levels = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise click.BadParameter(f"expected whole numbers separated by commas, got {text!r}")
    if not levels or min(levels) < 1:
        raise click.BadParameter(f"levels must be >= 1, got {text!r}")
    return levels


def _rates(ctx, param, text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        rates = [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise click.BadParameter(f"expected requests/s separated by commas (inf = all at once), got {text!r}")
    if not rates or any(not r > 0 for r in rates):
        raise click.BadParameter(f"rates must be > 0 (or inf), got {text!r}")
    return rates


def _max_tokens(ctx, param, text: str) -> str:
    from orchestrator.bench.lengths import parse_lengths

    try:
        parse_lengths(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc))
    return text


def _slo(ctx, param, text: str | None) -> dict:
    from orchestrator.bench.slo import parse_slo

    if not text:
        return {}
    try:
        return parse_slo(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc))


def load_options(f):
    """The load-model, SLO, stop and prompt-sizing options (kept together, apart from the shared
    ones, so the option list of `bench` stays easy to merge)."""
    opts = [
        click.option("--rate", "rates", callback=_rates, metavar="R,R,...",
                     help="Open loop: request rates per level, requests/s (inf = all at once), e.g. 2,4,8,inf."),
        click.option("--max-concurrency", type=click.IntRange(min=1), default=None,
                     help="Open loop: cap on requests in flight (more wait in the client, counted as queue)."),
        click.option("--arrivals", type=click.Choice(["poisson", "constant"]), default="poisson",
                     show_default=True, help="Open loop: inter-arrival gaps."),
        click.option("--burstiness", type=click.FloatRange(min=0, min_open=True, max=1e6), default=1.0,
                     show_default=True, help="Open loop, poisson: gamma shape of the gaps (1 = Poisson, "
                     "< 1 burstier, > 1 more regular), as vLLM's bench."),
        click.option("--ramp-up", "ramp_up", type=click.FloatRange(min=0), default=0.0, show_default=True,
                     metavar="SECONDS", help="Closed loop: start the C streams evenly over SECONDS; open "
                     "loop: raise the rate linearly from 0 over SECONDS. Inside the warm-up."),
        click.option("--slo", callback=_slo, metavar="M=T,...", help="Objectives per request, e.g. "
                     "ttft=500ms,tpot=50ms (ttft, tpot, itl, e2e): reports good % and goodput."),
        click.option("--slo-percentile", type=click.FloatRange(min=0, min_open=True, max=100), default=90.0,
                     show_default=True, help="A level meets the SLO when this % of its requests do."),
        click.option("--search", is_flag=True, help="Find the highest concurrency (-c LO,HI) or rate "
                     "(--rate LO,HI) meeting --slo, in a few levels."),
        click.option("--search-levels", type=click.IntRange(min=2), default=8, show_default=True,
                     help="At most this many levels in --search."),
        click.option("--max-errors", type=click.IntRange(min=1), default=None,
                     help="Abort a level after this many failed requests."),
        click.option("--max-error-rate", type=click.FloatRange(min=0, max=100), default=50.0,
                     show_default=True, metavar="PERCENT", help="Abort a level when more than this "
                     "% of its finished requests failed (judged after 10; 0 = never)."),
        click.option("--exact-input/--no-exact-input", default=True, show_default=True,
                     help="Size prompts exactly with the server's /tokenize (estimate if it has none)."),
        click.option("--prompt-pool", type=click.IntRange(min=1), default=None,
                     help="Distinct prompts to use [default: 64 built-in, 1000 from a file]."),
        click.option("--event-loop", type=click.Choice(["auto", "uvloop", "asyncio"]), default="auto",
                     show_default=True, help="auto = uvloop when installed."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _check_combinations(ctx, concurrency, load: dict, min_tokens, max_tokens) -> None:
    """Options that do not go together, named in the error."""
    from click.core import ParameterSource

    def given(name: str) -> bool:
        return ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE

    rates = load["rates"]
    if rates is not None and given("concurrency"):
        raise ConfigError("give -c/--concurrency (closed loop) or --rate (open loop), not both",
                          hint="an open-loop level is capped with --max-concurrency")
    if rates is None:
        for name, flag in (("max_concurrency", "--max-concurrency"), ("arrivals", "--arrivals"),
                           ("burstiness", "--burstiness")):
            if given(name):
                raise ConfigError(f"{flag} applies to open-loop levels: add --rate R,R,...")
    if load["arrivals"] == "constant" and given("burstiness"):
        raise ConfigError("--burstiness shapes Poisson arrivals; --arrivals constant has none")
    if (load["ramp_up"] and rates and any(r == float("inf") for r in rates)
            and not load["max_concurrency"]):
        raise ConfigError("--ramp-up with --rate inf needs --max-concurrency (a burst has no ramp)")
    if load["search"]:
        if not load["slo"]:
            raise ConfigError("--search needs --slo, e.g. --slo ttft=500ms,tpot=50ms")
        values = rates if rates is not None else concurrency
        flag = "--rate" if rates is not None else "-c/--concurrency"
        if len(set(values)) < 2 or any(v == float("inf") for v in values):
            raise ConfigError(f"--search needs two finite bounds in {flag}, e.g. {flag.split('/')[0]} 1,128")
    elif given("search_levels"):
        raise ConfigError("--search-levels applies to --search")
    if given("slo_percentile") and not load["slo"]:
        raise ConfigError("--slo-percentile applies to --slo")
    if min_tokens is not None and ":" in str(max_tokens):
        raise ConfigError("--min-tokens with a --max-tokens range could exceed max_tokens; use one of them")
    if load["event_loop"] == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            raise ConfigError("--event-loop uvloop: uvloop is not installed", hint="pip install uvloop")


class BenchCommand(click.Command):
    """`bench [OPTIONS] [MODEL]`, and `bench compare ...` dispatched to the compare command."""

    def parse_args(self, ctx, args):
        if args and args[0] == "compare":
            ctx.meta["bench.compare_args"] = list(args[1:])
            return []
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        rest = ctx.meta.get("bench.compare_args")
        if rest is not None:
            return compare_cmd.main(rest, prog_name=f"{ctx.command_path} compare", standalone_mode=False)
        return super().invoke(ctx)

    def format_epilog(self, ctx, formatter):
        with formatter.section("Subcommand"):
            formatter.write_dl([("compare A B ...", "Compare results side by side (see `bench compare --help`).")])
        super().format_epilog(ctx, formatter)


@click.command("bench", cls=BenchCommand, help=HELP, context_settings={"max_content_width": 100},
               epilog=exit_codes("0 ok, 1 the run failed (server or host unreachable), 2 bad input."))
@model_argument(required=False, metavar="[MODEL]")
@click.option("--url", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000 (with or without /v1).")
@click.option("--model", "served_model", help="Served model name (with --url).")
@host_option(required=False, help="Benchmark the active deployment on this inventory host.")
@accept_new_host_key_option
@click.option("-c", "--concurrency", default="1,2,4,8,16,32,64,128", show_default=True, callback=_levels,
              help="Closed loop: concurrency levels, comma separated.")
@click.option("--max-tokens", default="512", show_default=True, callback=_max_tokens, metavar="N|A:B|normal:M:S",
              help="Output tokens per request: fixed, a uniform range, or a normal distribution.")
@click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True,
              help="Ask the server to generate exactly --max-tokens (vLLM extension).")
@click.option("--min-tokens", type=click.IntRange(min=0), default=None, help="Send min_tokens (vLLM extension).")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--input-tokens", default=None, type=click.IntRange(min=1),
              help="Prompt length in the server's tokens, chat template included [default: 256 for the "
              "built-in prompts; a file's prompts as written].")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Prompts instead of the built-in ones: ShareGPT-style JSON (first user turn) or "
              "one prompt per line; sampled with --seed.")
@click.option("--warmup", default=10.0, show_default=True, type=click.FloatRange(min=0),
              help="Warm-up seconds per level.")
@click.option("--warmup-requests", default=0, show_default=True, type=click.IntRange(min=0),
              help="Also wait for this many completed requests before the window opens.")
@click.option("--duration", default=60.0, show_default=True, type=click.FloatRange(min=0),
              help="Minimum measurement window per level, seconds.")
@click.option("--min-requests", type=click.IntRange(min=1), default=None,
              help="Minimum requests in the window per level [default: max(20, 2 x C)].")
@click.option("--timeout", default=600.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Per-request timeout, seconds.")
@click.option("--max-level-time", default=3600.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Hard cap on warm-up + window per level, seconds.")
@click.option("--processes", default=1, show_default=True, type=click.IntRange(min=0),
              help="Client processes per level (0 = auto: one per 256 streams).")
@click.option("--continuous-usage/--no-continuous-usage", default=True, show_default=True,
              help="Ask for usage on every chunk (exact tokens per chunk; vLLM supports it).")
@click.option("--extra-body", default=None, help='JSON merged into each request, e.g. '
              '\'{"chat_template_kwargs": {"thinking": false}}\'.')
@click.option("--api-key", envvar="VLLM_API_KEY", default=None, help="Bearer token [env: VLLM_API_KEY].")
@click.option("--label", default="", help="A name for this run (shown in reports and compare).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output folder [default: bench-results/<time>-<label>].")
@click.option("--save-chunks", is_flag=True, help="Keep every chunk's arrival time in requests.jsonl.")
@click.option("--no-metrics", is_flag=True, help="Do not scrape the server's /metrics.")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Seed of the prompts, their sample from --prompts, output lengths and arrivals.")
@json_option("Print the result JSON instead of tables.")
@load_options
@click.pass_context
def bench(ctx, model, url, served_model, host_name, accept_new_host_key, concurrency, max_tokens,
          ignore_eos, min_tokens, temperature, input_tokens, prompts_file, warmup, warmup_requests,
          duration, min_requests, timeout, max_level_time, processes, continuous_usage, extra_body,
          api_key, label, out_dir, save_chunks, no_metrics, seed, as_json, **load):
    import time

    from rich.console import Console

    from orchestrator.bench.options import BenchOptions
    from orchestrator.bench.runner import run_benchmark

    if bool(url) == bool(host_name):
        raise ConfigError("give either --url URL --model NAME or --host HOST [MODEL]",
                          hint="vllm-orch bench --help shows examples")
    try:
        extra = json.loads(extra_body) if extra_body else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--extra-body is not JSON: {exc}")
    if not isinstance(extra, dict):
        raise ConfigError("--extra-body must be a JSON object")
    _check_combinations(ctx, concurrency, load, min_tokens, max_tokens)
    opts = BenchOptions(
        concurrency=concurrency, max_tokens=int(max_tokens) if max_tokens.strip().isdigit() else max_tokens,
        ignore_eos=ignore_eos, min_tokens=min_tokens, temperature=temperature, input_tokens=input_tokens,
        prompts_file=prompts_file, warmup_s=warmup, warmup_requests=warmup_requests,
        duration_s=duration, min_requests=min_requests, timeout_s=timeout, max_level_s=max_level_time,
        processes=processes, continuous_usage=continuous_usage, extra_body=extra, api_key=api_key,
        label=label, seed=seed, save_chunks=save_chunks, scrape_metrics=not no_metrics,
        rates=load["rates"], max_concurrency=load["max_concurrency"], arrivals=load["arrivals"],
        burstiness=load["burstiness"], ramp_up_s=load["ramp_up"], slo=load["slo"],
        slo_percentile=load["slo_percentile"], search=load["search"], search_levels=load["search_levels"],
        max_errors=load["max_errors"],
        max_error_rate=(load["max_error_rate"] / 100.0) if load["max_error_rate"] else None,
        exact_input=load["exact_input"], prompt_pool=load["prompt_pool"], event_loop=load["event_loop"])
    console = Console(stderr=as_json, highlight=False)
    out = out_dir or Path("bench-results") / (time.strftime("%Y%m%d-%H%M%S") + (f"-{label}" if label else ""))

    if host_name:
        target = host_target(ctx.obj, host_name, model or served_model, accept_new_host_key, with_key=bool(api_key))
    else:
        served = served_model or model
        if not served:
            raise ConfigError("--url needs --model NAME (the served model name)",
                              hint="curl URL/v1/models lists the served names")
        target = Target(url, served, {}, lambda: None, None)
    try:
        result = run_benchmark(target.base_url, target.served_name, opts, target.metadata, out,
                               None if as_json else console)
        if target.record is not None:
            target.record(result.history_entry())
    finally:
        target.close()
    if as_json:
        click.echo(json.dumps(result.data, indent=1, default=str))
    else:
        plots = "plots skipped" if result.data.get("plots_skipped") else "plots/"
        console.print(f"results: {out}/report.html  (result.json, requests.jsonl, summary.csv, {plots})", markup=False)


@click.command("compare", help=COMPARE_HELP, context_settings={"max_content_width": 100},
               epilog=exit_codes("0 ok, 1 a metric got worse beyond noise (with --fail-on-worse), 2 bad input."))
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@json_option("Print the comparison as JSON.")
@click.option("--fail-on-worse", is_flag=True, help="Exit 1 if any metric got worse beyond noise.")
def compare_cmd(results, as_json, fail_on_worse):
    from rich.console import Console

    from orchestrator.bench.compare import compare, render
    from orchestrator.bench.report import load_result
    from orchestrator.bench.tables import print_wide

    if len(results) < 2:
        raise ConfigError("bench compare needs at least two results (folders or result.json files)")
    try:
        loaded = [load_result(p) for p in results]
    except (ValueError, OSError) as exc:
        raise ConfigError(str(exc))
    rows = compare(loaded)
    if as_json:
        click.echo(json.dumps({"runs": [r["_path"] for r in loaded], "rows": rows}, indent=1))
    else:
        print_wide(Console(highlight=False), render(loaded, rows))
    return 1 if fail_on_worse and any("worse" in r["verdicts"] for r in rows) else 0


# -- --host mode -------------------------------------------------------------------------------------
@dataclass
class Target:
    base_url: str
    served_name: str
    metadata: dict
    close: Callable[[], None]
    record: Callable[[dict], None] | None     # appends the summary to the host's deploy history


def host_target(app, host_name: str, model: str | None, accept_new_host_key: bool = False,
                with_key: bool = False) -> Target:
    """Endpoint of the active deployment on an inventory host, forwarded over SSH when needed.

    Contract with the deployment side (lead): orchestrator.config.inventory gives the host entry and a
    connected Host; orchestrator.host.state.read_records(host, entry) -> {service: {"model",
    "served_name", "port", ...metadata}}; orchestrator.host.state.append_history(host, entry_dict).
    MODEL names the service (or its model / served name) on a host that runs several.
    """
    from orchestrator.config.inventory import get_host, load_inventory
    from orchestrator.config.placement import choose_service
    from orchestrator.host import state
    from orchestrator.host.connect import open_host
    from orchestrator.host.records import HistoryEntry

    entry = get_host(load_inventory(getattr(app, "inventory_path", None)), host_name)
    host = open_host(entry, accept_new_host_key)
    records = state.read_records(host, entry)
    if not records:
        host.close()
        raise ConfigError(f"{host_name}: no active deployment to benchmark",
                          hint=f"vllm-orch deploy MODEL --host {host_name}")
    match = [n for n, r in records.items() if model in (n, r.model, r.served_name)] if model else []
    if model and not match:
        host.close()
        raise ConfigError(f"{host_name} serves {', '.join(sorted(records))}, not {model!r}",
                          hint=f"vllm-orch swap {model} --host {host_name}")
    try:
        name = match[0] if match else choose_service(records, None, host_name, f"bench --host {host_name} SERVICE",
                                                           asleep=[n for n, r in records.items() if r.asleep])
    except ConfigError:
        host.close()
        raise
    active = records[name or ""]
    port = active.port
    if with_key:        # the key goes only to the service's own listener (probe/keyed.py), proven before the run
        from orchestrator.probe import keyed

        try:
            keyed.prove(host, entry, name or "", port)
        except keyed.ForeignListener as exc:
            host.close()
            raise keyed.refused(exc, entry, "bench") from None
    address = "127.0.0.1" if entry.is_local else entry.address
    closers = [host.close]
    if _reachable(address, port):
        base_url = f"http://{address}:{port}"
    else:
        from orchestrator.host.forward import forward_local

        local_port, closer = forward_local(host, port)
        closers.insert(0, closer)
        base_url = f"http://127.0.0.1:{local_port}"
    metadata = {k: v for k, v in active.model_dump(mode="json", exclude_none=True).items()
                if k not in ("port", "served_name", "version")}
    metadata["host"] = host_name
    metadata["host_label"] = entry.label
    try:
        from orchestrator.host.facts import gather

        f = gather(host, entry)
        metadata["host_gpus"] = [{"index": g.index, "name": g.name, "memory_total_mib": g.memory_total_mib}
                                 for g in f.gpus]
        metadata["driver_version"] = f.driver_version
    except Exception as exc:  # the benchmark does not depend on it
        metadata["host_gpus_error"] = str(exc)

    def close() -> None:
        for c in closers:
            c()
    return Target(base_url, active.served_name or active.model, metadata, close,
                  lambda e: state.append_history(host, entry, HistoryEntry(**e)))


def _reachable(address: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False
