"""`vllm-orch monitor --out DIR`: Prometheus targets, scrape config, rules and their tests, and a
Grafana dashboard for the services the selected hosts run (docs/monitoring.md)."""

from __future__ import annotations

import re
from pathlib import Path

import click

from orchestrator.cli.common import console, pass_app
from orchestrator.cli.options import exit_codes, host_selection
from orchestrator.fmt import escape


def _hostport(ctx, param, value: str | None) -> str | None:
    """HOST:PORT (a name, an IPv4 address or a bracketed IPv6 one), as written into a file_sd file."""
    if value is None:
        return None
    if not re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]{0,252}):([1-9][0-9]{0,4})", value) \
            or int(value.rsplit(":", 1)[1]) > 65535:
        raise click.BadParameter(f"{value!r} is not HOST:PORT")
    return value


def _url(ctx, param, value: str | None) -> str | None:
    """An http(s) URL without spaces or quotes, as written into a YAML file."""
    if value is None:
        return None
    if not re.fullmatch(r"https?://[A-Za-z0-9\[\]._:-]+(/[A-Za-z0-9._~/%-]*)?", value):
        raise click.BadParameter(f"{value!r} is not an http(s) URL (e.g. http://prom.lan:9090/api/v1/write)")
    return value


@click.command(epilog=exit_codes("0 written, 1 a host could not be reached (its services are left out, "
                                  "the rest is written), 2 bad input, 3 refused (a scrape key over plain http "
                                  "without --scrape-key-over-http, or a scrape key file holding the service's "
                                  "API key)."))
@host_selection(fleet=True, default_all=True)
@click.option("--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder to write prometheus.yml, targets/, rules/ and grafana/ into (made when missing).")
@click.option("--scrape-key-file", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Opt-in: a scrape-only credential of yours (e.g. for a proxy guarding /metrics), sent as "
                   "bearer auth to keyed services, referenced by the scrape config as it is (never copied; never "
                   "the service's API key). Default: no scrape carries a key (vLLM leaves /metrics open).")
@click.option("--scheme", type=click.Choice(["http", "https"]), default="http", show_default=True,
              help="How Prometheus reaches the vLLM targets; a keyed scrape needs https.")
@click.option("--scrape-key-over-http", is_flag=True,
              help="Allow --scrape-key-file over plain http (a private path, e.g. loopback).")
@click.option("--state-target", default=None, metavar="HOST:PORT", callback=_hostport,
              help="Where Prometheus reads `vllm-orch status --prometheus`'s output (a node exporter's "
                   "textfile collector). Default: no vllm-orch state target.")
@click.option("--remote-write", default=None, metavar="URL", callback=_url,
              help="Where the agent of a host with loopback-only services (every sleep-capable one) "
                   "sends their series: your Prometheus's /api/v1/write (started with "
                   "--web.enable-remote-write-receiver). See agent/HOST/ in the output.")
@click.option("--interval", type=click.IntRange(min=1, max=3600), default=15, show_default=True,
              help="Seconds between scrapes and rule evaluations (rate windows are four of them).")
@click.option("--for", "for_s", type=click.IntRange(min=0), default=None,
              help="Every alert's `for:` in seconds (alert drills and tests). Default: each alert's own.")
@pass_app
def monitor(app, hosts, parallel, accept_new_host_key, out, scrape_key_file, scheme, scrape_key_over_http,
            state_target, remote_write, interval, for_s):
    """Write what a Prometheus and a Grafana need to watch the fleet's services: file_sd targets
    (labels host, service, model, served_name, gpus, node_role, vllm_version), prometheus.yml,
    recording and alert rules, their `promtool test rules` cases and a dashboard.

    Each host is asked what it runs (as `status` does, without the API key). No scrape carries a key
    and no file written holds one: vLLM 0.33 serves /metrics without it. --scrape-key-file opts in
    to bearer auth for keyed services (your own scrape credential, over https unless forced).

    \b
    Examples:
      vllm-orch monitor --out /etc/prometheus/vllm-orch
      vllm-orch monitor --group prod --out ./monitoring --scheme https --scrape-key-file /etc/prometheus/scrape.key
      promtool test rules ./monitoring/rules/vllm-orch.rules.test.yml
    """
    from orchestrator.cli.common import resolved_models_dir
    from orchestrator.cli.ops import _manifest_lookups
    from orchestrator.config.manifest import get_manifest
    from orchestrator.errors import OrchestratorError
    from orchestrator.ops import monitor_rules
    from orchestrator.ops.monitor import ServiceFacts, fleet, write
    from orchestrator.ops.status import gather_status

    port_of, served_name_of, api_key_of = _manifest_lookups(app)
    workers = {"max_workers": parallel} if parallel else {}
    results = gather_status(hosts, port_of, served_name_of, accept_new_host_key, **workers)     # no key sent
    folder = resolved_models_dir(app)
    key = None
    unread: dict[str, str] = {}

    def facts_of(model: str) -> ServiceFacts:
        nonlocal key
        try:
            m = get_manifest(model, folder)[0]
        except OrchestratorError as exc:   # no manifest here, or a bad one: no key, no SLO (said below)
            unread[model] = str(exc).splitlines()[0]
            return ServiceFacts()
        keyed = "VLLM_API_KEY" in m.serving.secret_env
        if keyed and key is None:
            key = api_key_of(model)
        return ServiceFacts(keyed=keyed, slo_ttft_p95_s=m.performance.slo_ttft_p95_seconds, bind=m.serving.host)

    targets, exporters = fleet(results, {e.name: e for e in hosts}, facts_of)
    timing = monitor_rules.Timing(interval_s=interval, for_s=for_s)
    written = write(out, targets, exporters, timing, scrape_key_file=str(scrape_key_file) if scrape_key_file else None,
                    scheme=scheme, key_over_http=scrape_key_over_http, service_key=key, state_target=state_target,
                    remote_write=remote_write)
    con = console()
    if (out / "secrets" / "vllm-api-key").exists():     # what monitor wrote before the keyed scrape was opt-in
        con.print(f"[yellow]{escape(str(out / 'secrets' / 'vllm-api-key'))} (written by an earlier vllm-orch monitor) "
                  f"holds the service's API key and is no longer referenced: delete it[/yellow]")
    for model, why in sorted(unread.items()):
        con.print(f"[yellow]{escape(model)}: its manifest could not be read ({escape(why)}): scraped without "
                  f"a scrape key, no TTFT objective[/yellow]")
    for st in results:
        if not st.reachable:
            con.print(f"[red]{st.host}: unreachable ({escape(st.error or '')}); its services are not in the "
                      f"targets[/red]")
    for host in sorted({t.host for t in targets if t.on_host}):
        names = ", ".join(t.service for t in targets if t.on_host and t.host == host)
        con.print(f"[yellow]{escape(host)}: {escape(names)} listen{'s' if ',' not in names else ''} on loopback only "
                  f"(a Prometheus elsewhere cannot scrape {'it' if ',' not in names else 'them'}): run a Prometheus "
                  f"agent there with {escape(str(out / 'agent' / host))}/ "
                  f"(prometheus --enable-feature=agent --config.file=prometheus.yml)"
                  + ("" if remote_write else "; pass --remote-write URL so it sends their series to your "
                     "Prometheus") + "[/yellow]")
    con.print(f"{len(targets)} service target{'s' if len(targets) != 1 else ''}, {len(exporters)} exporter"
              f"{'s' if len(exporters) != 1 else ''}; wrote {len(written)} files under {out}")
    for p in written:
        con.print(f"  {p.relative_to(out)}")
    return 0 if all(r.reachable for r in results) else 1
