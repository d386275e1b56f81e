"""`vllm-orch deploy` and `vllm-orch check`."""

from __future__ import annotations

import json

import click

from orchestrator.cli.common import console, load_model, pass_app, terminal_ask
from orchestrator.cli.options import (
    dry_run_option,
    exit_codes,
    fleet_host_options,
    json_option,
    kill_foreign_option,
    model_argument,
    skip_check_option,
    verify_engine_option,
    yes_option,
)


def make_options(skip_checks, kill_foreign, enable=False, yes=False, warm=False, replace=None, sleep_old=False,
                 verify_engine=False):
    from orchestrator.plan.run import Options

    return Options(kill_foreign=kill_foreign, enable=enable, yes=yes, skip_checks=frozenset(skip_checks),
                   warm=warm, replace=replace, sleep_old=sleep_old, verify_engine=verify_engine)


def placement_options(f):
    """--name, --gpus and --port: place a model on a host without copying its manifest (they win
    over the inventory's overrides; `render --host` and --dry-run name where each value came from)."""
    f = click.option("--name", "service_name", default=None, metavar="NAME", callback=_slug,
                     help="The service's name on the host (its unit vllm-NAME.service, records, history): "
                          "default the model's. Lets one host run the same model twice.")(f)
    f = click.option("--port", type=click.IntRange(1, 65535), default=None,
                     help="The service's HTTP port on this host (default: the inventory's override, else "
                          "the manifest's).")(f)
    return click.option("--gpus", "gpus", default=None, metavar="IDS",
                        help="The GPUs the service takes, e.g. 4-7 or 4,5,6,7: as many as the manifest's "
                             "tensor x data parallel layout (default: the inventory's, else the manifest's).")(f)


def _slug(_ctx, _param, value):
    from orchestrator.config.manifest import RESERVED_SERVICE, SLUG
    from orchestrator.errors import ConfigError

    if value is not None and not SLUG.match(value):
        raise ConfigError(f"--name {value}: not a service name like mm-b (lowercase letters, digits and -)")
    if value == RESERVED_SERVICE:
        raise ConfigError(f"--name {value}: the gateway's service name, pick another")
    return value


def service_request(m, name: str | None, gpus: str | None, port: int | None):
    """The command line's --name, --gpus and --port for model M (config/placement.Request; a bad
    --gpus list is exit 2 before any host is asked)."""
    from orchestrator.config.placement import Request

    return Request.parse(m, name, gpus, port)


def finish(result, as_json: bool):
    """Print the result (JSON or a closing line); the command returns it (cli/main.py exits with its
    exit_code). A failure not shown as JSON is raised: the error boundary prints it."""
    if as_json:
        click.echo(json.dumps(result.as_dict(), indent=2, default=str))
        return result
    if result.ok:
        from orchestrator.fmt import escape

        for warning in result.extra.get("warnings") or []:      # e.g. far below the performance floor
            console().print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)
        if not result.dry_run:
            console().print(f"[bold green]{result.operation} {result.model} on {result.host}: ok[/] "
                            f"({result.seconds:.1f}s)")
        return result
    if result.error is not None:
        raise result.error
    return result


@click.command(epilog=exit_codes("0 ok, 1 failed, 2 bad input (nothing changed), 3 refused by a safety check "
                                 "or for want of --yes (nothing changed)."))
@model_argument()
@fleet_host_options
@dry_run_option()
@json_option()
@skip_check_option
@verify_engine_option
@kill_foreign_option
@click.option("--enable", is_flag=True, help="Also enable the unit so it starts at boot (systemd hosts).")
@yes_option("delete the inactive model folders the plan frees disk with (vllm-orch's own only); without it "
            "deploy asks on a terminal and refuses without one")
@click.option("--warm", is_flag=True,
              help="Before starting, read the weights into the page cache as far as the host's memory allows "
                   "(for a start after a stop: the load then reads from RAM; the plan shows the expected "
                   "start-up with and without).")
@placement_options
@pass_app
def deploy(app, model, hosts, parallel, accept_new_host_key, dry_run, as_json, skip_checks, verify_engine, kill_foreign,
           enable, yes, warm, service_name, gpus, port):
    """Deploy MODEL on a host: lock, preflight, disk, download + verify, free the GPUs, install the
    unit, start, wait for the readiness gates (health, model listed, smoke completion), record.

    Every step says what it will do or why there is nothing to do; --dry-run prints exactly that
    plan. Running it again when the model already serves unchanged does nothing.

    \b
    Examples:
      vllm-orch deploy kimi-k25-int4 --host sim --dry-run
      vllm-orch deploy kimi-k25-int4 --host sim
      HF_TOKEN=hf_... vllm-orch deploy minimax-m25 --host gpu1 --enable
      vllm-orch deploy kimi-k25-int4 --host gpu1 --warm
      vllm-orch deploy minimax-m25 --host gpu1 --gpus 4-7 --port 8001 --name mm-b
      vllm-orch deploy kimi-k25-int4 --group prod --parallel 4

    A host runs several services on disjoint GPUs and ports; a placement that takes another
    service's GPUs or port is refused (exit 3, naming it).

    With several hosts (--host a,b, --group, --all) they are deployed in parallel with one progress
    line per host and a summary table; the exit code is the worst of the hosts'. Deletions the plan
    would ask about need --yes there (there is no terminal question per host).

    A multi-node manifest (with `multinode:`) is ONE service over the selected hosts, in order: the
    first is the head (rank 0, the API server), the others its headless ranks. It runs as one plan
    (each step names its node; downloads in parallel, verified identical before any start; workers
    start before the head; readiness at the head follows every node's log). Select exactly
    multinode.nodes hosts (exit 2 otherwise): `vllm-orch deploy kimi-k25-int4-2node --host gpu1,gpu2`.
    """
    from orchestrator.ops.deploy import run_deploy
    from orchestrator.ops.execute import Reporter
    from orchestrator.ops.fleet import per_host
    from orchestrator.render.artifacts import secrets_from_environ

    m = load_model(app, model)
    request = service_request(m, service_name, gpus, port)     # bad --gpus: exit 2 before any host
    secrets_from_environ(m)                     # a secret it needs and is not given: exit 2 before any host
    name = request.name or m.name
    opts = make_options(skip_checks, kill_foreign, enable, yes=yes, warm=warm, verify_engine=verify_engine)
    if per_host(m, hosts):                      # the same service on each host: a fleet run
        from orchestrator.cli.fleet import fleet_op
        from orchestrator.ops.seed import run_seeded, seeded

        with seeded(opts, hosts, accept_new_host_key) as fleet_opts:      # download once per fleet
            return fleet_op(f"deploy {name}", hosts, parallel, as_json, dry_run,
                            lambda e, rep: run_seeded(fleet_opts, e, lambda: run_deploy(
                                e, m, fleet_opts, rep, dry_run, accept_new_host_key, request=request)))
    reporter = Reporter(console(), quiet=as_json)     # one service over its nodes (one host, or a multi-node model's)
    result = run_deploy(hosts, m, opts, reporter, dry_run, accept_new_host_key, ask=terminal_ask(as_json),
                        request=request)
    return finish(result, as_json)


@click.command(epilog=exit_codes("0 every check passed (warnings and skips included), 1 the host could not "
                                  "be asked, 2 bad input, 3 a check failed. Nothing is changed on the host (a "
                                  "full check of an engine venv records its verdict in the venv)."))
@model_argument()
@fleet_host_options
@skip_check_option
@verify_engine_option
@json_option("Print the checks as JSON.")
@placement_options
@pass_app
def check(app, model, hosts, parallel, accept_new_host_key, skip_checks, verify_engine, as_json, service_name, gpus,
          port):
    """Run the preflight checks of MODEL on a host and change nothing: GPUs, VRAM, driver, the vLLM
    version (and, where the host's vLLM can parse them, the rendered flags).

    With several hosts they are checked in parallel, with a summary table (the root cause of each
    failed check); the exit code is the worst of the hosts'. A multi-node manifest is checked on
    each of its nodes (the selected hosts, head first) with that node's own command line.

    \b
    Examples:
      vllm-orch check kimi-k25-int4 --host sim
      vllm-orch check kimi-k25-int4 --group prod
    """
    m = load_model(app, model)
    request = service_request(m, service_name, gpus, port)
    name = request.name or m.name
    opts = make_options(skip_checks, False, verify_engine=verify_engine)
    if m.multinode is not None:                 # every node's own argv, through its own vLLM's parser
        from orchestrator.config.placement import node_roles

        node_roles(m, hosts)                    # the wrong number of hosts: exit 2 before any is asked
    if len(hosts) > 1:
        from orchestrator.cli.fleet import finish_fleet, run_with_view
        from orchestrator.ops.fleet import HostOutcome, root_cause

        def one(entry, _reporter) -> HostOutcome:
            action, refusal = preflight_on(entry, m, request, opts, accept_new_host_key, hosts)
            data = {"host": entry.name, "model": name, "ok": refusal is None, "checks": action.details}
            return HostOutcome(0 if refusal is None else refusal.exit_code,
                               None if refusal is None else root_cause(refusal), action.summary, data)

        return finish_fleet(f"check {name}", run_with_view(f"check {name}", hosts, one, parallel, as_json),
                     as_json, "checks")
    entry = hosts[0]
    action, refusal = preflight_on(entry, m, request, opts, accept_new_host_key, hosts)
    if as_json:
        click.echo(json.dumps({"host": entry.name, "model": name, "ok": refusal is None,
                               "checks": action.details}, indent=2))
        return 0 if refusal is None else refusal.exit_code
    console().print(f"Preflight of {name} on {entry.describe()}: {action.summary}", markup=False)
    for line in action.details:
        console().print(f"  {line}", markup=False, soft_wrap=True)
    if refusal is not None:
        raise refusal


def preflight_on(entry, m, request, opts, accept_new_host_key: bool, nodes):
    """The preflight action of model M as the service `request` names on one host (a node of a
    multi-node service among `nodes`, checked with its own argv) and its refusal (None: every
    check passed). The placement is checked as deploy checks it first (its name, GPUs and ports
    against the host's other services): a check that passes is a deploy that is not refused there."""
    from orchestrator.ops import gather
    from orchestrator.ops.session import session
    from orchestrator.plan.placements import clash_refusal, name_refusal
    from orchestrator.plan.prepare import preflight_action

    with session(entry, f"check {request.name or m.name}", True, accept_new_host_key) as s:
        facts = gather.host_facts(s.host, entry, m, request, nodes=list(nodes) if m.multinode is not None else ())
        spec = gather.service_spec(m, list(nodes) if m.multinode is not None else [entry], request,
                                   {entry.name: facts})
        inp = gather.for_check(s.host, entry, m, spec, opts, s.lock, facts)
        action, refusal = preflight_action(inp)
        placement = name_refusal(inp.facts, inp.target, entry.name) or clash_refusal(inp.facts, inp.target,
                                                                                      entry.name)
        if placement is not None:
            action.details.append(f"{'FAIL':<7} placement: {placement.message}")
            action.summary = f"{action.summary}; the placement is refused"
            refusal = refusal or placement
        return action, refusal
