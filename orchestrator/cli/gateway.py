"""`vllm-orch gateway up | down | status`: one URL for every model of a host (docs/gateway.md)."""

from __future__ import annotations

import json

import click

from orchestrator.cli.common import console, pass_app
from orchestrator.cli.options import exit_codes, fleet_host_options, host_options, json_option


@click.group(epilog=exit_codes("0 ok, 1 failed, 2 bad input, 3 refused; each subcommand's --help says when."))
def gateway():
    """One stable endpoint per host: HAProxy on its own port routes every OpenAI request by its
    `model` to the service that serves it (any port, loopback-bound sleep services included).
    Clients send a key of the gateway (the inventory's gateway.keys_env); the gateway sends each
    service its own. Every deploy, swap, stop and regen on the host updates it as a step of its
    plan: a service's requests in flight finish before it stops, and requests for a model that is
    starting wait for it (up to gateway.hold_seconds, then 503 with Retry-After).

    \b
    Examples:
      export VLLM_ORCH_GATEWAY_KEYS=$(openssl rand -hex 24)
      vllm-orch gateway up --host sim
      vllm-orch gateway status --host sim --json
      vllm-orch gateway down --host sim
    """


def _each(hosts, parallel, as_json, title, one):
    """Run `one(entry) -> GatewayResult` on every host; print; the exit code."""
    if len(hosts) == 1:
        results = [one(hosts[0])]        # its error, if any, is the command's (exit 2, 3...)
    else:
        from concurrent.futures import ThreadPoolExecutor

        from orchestrator.errors import OrchestratorError
        from orchestrator.ops.gateway import GatewayResult

        def guarded(entry):
            try:
                return one(entry)
            except OrchestratorError as exc:
                return GatewayResult(entry.name, "failed", error=exc.message)

        with ThreadPoolExecutor(max_workers=parallel or len(hosts)) as pool:
            results = list(pool.map(guarded, hosts))
    if as_json:
        out = [r.as_dict() for r in results]
        click.echo(json.dumps(out[0] if len(out) == 1 else out, indent=2))
    else:
        for r in results:
            _show(r, title)
    return 1 if any(r.error or r.state == "failed" for r in results) else 0


def _show(r, title: str) -> None:
    from orchestrator.host import gateway as hg

    c = console()
    colour = {"serving": "green", "failed": "red"}.get(r.state, "yellow")
    c.print(f"[bold]{r.host}[/]: gateway [{colour}]{r.state}[/]" + (f" at {r.url}" if r.url and r.state == "serving"
                                                                      else ""), markup=True)
    if r.runs and r.state != "not installed":
        c.print(f"  runs as {r.runs}", markup=False)
    backends = (r.counters or {}).get("backends", {})
    for row in r.routes:
        b = backends.get(f"svc_{row['service']}", {})
        inflight, waiting = hg.load_of(b)
        counts = (f"  {b.get('requests', 0)} requests, {inflight} in flight, {waiting} waiting, "
                  f"{b.get('errors_5xx', 0)} 5xx") if b else ""
        state = ("" if row["up"] else "  (asleep: requests wait while it wakes)" if row.get("held")
                 else "  (503 + Retry-After: stopping, asleep or draining)")
        c.print(f"  {', '.join(row['models'])} -> {row['target']} ({row['service']}){state}{counts}", markup=False)
    if r.state == "serving" and not r.routes:
        c.print("  no model behind it yet: deploy one (`vllm-orch deploy MODEL --host ...`)", markup=False)
    if r.error:
        c.print(f"  [red]{r.error}[/]", markup=True)


@gateway.command(epilog=exit_codes("0 the gateway serves (its URL is printed), 1 it did not start, 2 bad input "
                                   "(no client keys, a bad key), 3 refused (the host lock is held, no haproxy)."))
@fleet_host_options
@click.option("--port", type=click.IntRange(1024, 65535), default=None,
              help="The port it listens on (default: the inventory's gateway.port, else 8090).")
@json_option("Print {\"url\": ...} and the routes as JSON.")
@pass_app
def up(app, hosts, parallel, accept_new_host_key, port, as_json):
    """Install and start the host's gateway, or bring a running one up to date (its streams go on).
    Prints the URL clients use as their OpenAI base_url.

    The client keys come from the environment variable the inventory's gateway.keys_env names
    (default VLLM_ORCH_GATEWAY_KEYS; several separated by commas); once installed, an `up`
    without it keeps them. They are written to the host 0600 for the service user, never to a plan
    or a log. The gateway listens on gateway.listen (default 127.0.0.1; name the LAN address to
    serve other machines).

    \b
    Example:
      VLLM_ORCH_GATEWAY_KEYS=$(openssl rand -hex 24) vllm-orch gateway up --host sim
    """
    from orchestrator.ops import gateway as og

    def one(entry):
        if port is not None:
            entry = entry.model_copy(update={"gateway": entry.gateway.model_copy(update={"port": port})})
        return og.up(entry, accept_new_host_key=accept_new_host_key)

    return _each(hosts, parallel, as_json, "up", one)


@gateway.command(epilog=exit_codes("0 stopped (or was not installed), 1 failed, 3 refused (the host lock is held)."))
@fleet_host_options
@json_option()
@pass_app
def down(app, hosts, parallel, accept_new_host_key, as_json):
    """Stop the host's gateway and delete its files (its keys included). The services behind it go
    on serving on their own ports."""
    from orchestrator.ops import gateway as og

    return _each(hosts, parallel, as_json, "down", lambda e: og.down(e, accept_new_host_key=accept_new_host_key))


@gateway.command(epilog=exit_codes("0 ok, 1 the gateway failed or could not be asked."))
@fleet_host_options
@json_option()
@pass_app
def status(app, hosts, parallel, accept_new_host_key, as_json):
    """The gateway's state, URL and routes (model -> service, port), with each route's requests, in
    flight and 5xx answers summed over HAProxy's workers (old ones still finishing included)."""
    from orchestrator.ops import gateway as og

    return _each(hosts, parallel, as_json, "status", lambda e: og.status(e, accept_new_host_key=accept_new_host_key))


@gateway.command(epilog=exit_codes("0 stopped by Ctrl-C (or --for elapsed), 2 bad input (no wake group, a service "
                                   "without a sleep section), 3 refused (no gateway on the host)."))
@host_options
@click.option("--poll", "poll_s", type=click.FloatRange(0.05, 10), default=0.25, show_default=True,
              help="Seconds between two reads of the gateway's counters.")
@click.option("--for", "for_s", type=click.FloatRange(min=0), default=None,
              help="Stop after this many seconds (default: until Ctrl-C).")
@pass_app
def waker(app, host_name, accept_new_host_key, poll_s, for_s):
    """Wake sleeping models on demand: a request for a model of one of the host's
    gateway.wake_groups that sleeps waits at the gateway while this puts the group's awake model
    to sleep and wakes it (the sleep swap of `vllm-orch swap MODEL --sleep-old`, its canary
    checked, rolled back if it fails). A model that woke serves at least the group's
    min_awake_seconds before another's requests put it to sleep (at once if it is idle), so two
    loads on one GPU set take turns instead of thrashing; with ttl_seconds an idle model sleeps
    again. Requests wait up to gateway.hold_seconds, then get 503 with Retry-After.

    It runs in the foreground, a line per wake or sleep; run it where vllm-orch runs (under
    systemd, tmux...), one per host.

    \b
    Example (hosts.yaml):
      gateway:
        wake_groups:
          - services: [kimi-k25-int4, kimi-k25-nvfp4]
            min_awake_seconds: 30
            ttl_seconds: 900
    then:
      vllm-orch gateway waker --host gpu1
    """
    import time

    from orchestrator.cli.common import load_host_entry, resolved_models_dir
    from orchestrator.config.manifest import load_all
    from orchestrator.errors import Interrupted
    from orchestrator.ops import waker as ow

    entry = load_host_entry(app, host_name)
    manifests, _bad = load_all(resolved_models_dir(app))
    end = None if for_s is None else time.monotonic() + for_s
    c = console()

    def say(line: str) -> None:
        c.print(f"{time.strftime('%H:%M:%S')} {line}", markup=False, highlight=False)

    try:
        ow.run(entry, manifests, say, poll_s=poll_s, until=lambda: end is not None and time.monotonic() >= end,
               accept_new_host_key=accept_new_host_key)
    except (KeyboardInterrupt, Interrupted):
        say("stopped")
    return 0
