"""`vllm-orch status`, `history`, `logs`, `stop`, `gc`: reading and operating hosts."""

from __future__ import annotations

import json
import sys
import time

import click

from orchestrator.cli.common import console, load_host_entry, pass_app
from orchestrator.cli.options import (
    complete_models,
    dry_run_option,
    exit_codes,
    fleet_host_options,
    host_options,
    host_selection,
    json_option,
    model_argument,
    yes_option,
)
from orchestrator.fmt import escape, printable


def _manifest_lookups(app):
    """(port_of, served_name_of, api_key_of) from the manifests: the port and served name of a model
    loading before it is recorded, and the API key its probes need (VLLM_API_KEY from the
    environment when the manifest lists it in serving.secret_env)."""
    from orchestrator.cli.common import resolved_models_dir

    cache: dict[str, object] = {}

    def manifest(name: str):
        if name not in cache:
            try:
                from orchestrator.config.manifest import get_manifest

                cache[name] = get_manifest(name, resolved_models_dir(app))[0]
            except Exception:
                cache[name] = None
        return cache[name]

    def port_of(name: str):
        m = manifest(name)
        return m.serving.port if m is not None else None

    def served_name_of(name: str):
        m = manifest(name)
        return m.served_name if m is not None else None

    def api_key_of(name: str):
        from orchestrator.render.artifacts import secrets_from_environ

        m = manifest(name)
        return secrets_from_environ(m, required=False).get("VLLM_API_KEY") if m is not None else None

    return port_of, served_name_of, api_key_of


def _inventory_lookup(app):
    """name -> its inventory entry, or None (the nodes of a multi-node service not selected)."""
    from orchestrator.config.inventory import load_inventory

    inventory = load_inventory(app.inventory_path)

    def lookup(name: str):
        return inventory.hosts.get(name)

    return lookup


# -- status ----------------------------------------------------------------------------------------

@click.command(epilog=exit_codes("0 every host answered and nothing needs attention, 1 a host could not be "
                                  "reached (shown with its error) or needs attention: a service failed or does "
                                  "not run, a swap was left half done (each said on stderr; with --prometheus "
                                  "only an unreachable host: the state is in the figures), 2 bad input."))
@host_selection(fleet=True, default_all=True)
@json_option("Print a list with one object per host.")
@click.option("--prometheus", "as_prometheus", is_flag=True,
              help="Print vllm-orch's own state in Prometheus text format (deploys, swaps and their downtime, "
                   "rollbacks, health restarts, last success; docs/monitoring.md).")
@pass_app
def status(app, hosts, parallel, accept_new_host_key, as_json, as_prometheus):
    """Show, per host: the active model and its state (loading / ready / failed / stopped),
    uptime, GPUs and their memory, GPU processes (service, left behind, foreign), KV-cache usage
    and running/waiting requests, disk use per model, the last deploy and the last benchmark.

    Hosts are asked in parallel; an unreachable host is shown with its error (exit 1). A service
    across several hosts is shown once, with its head, listing every node and its state (--json:
    the service's `nodes`; a worker host's `node_of`).

    \b
    Examples:
      vllm-orch status
      vllm-orch status --host sim --host gpu1 --json
      vllm-orch status --group prod
      vllm-orch status --all --prometheus > /var/lib/node_exporter/textfile/vllm-orch.prom.tmp
    """
    from orchestrator.cli.views import render_status
    from orchestrator.ops.status import gather_status

    if as_json and as_prometheus:
        raise click.UsageError("--json and --prometheus are two formats of one answer: pick one")
    port_of, served_name_of, api_key_of = _manifest_lookups(app)
    workers = {"max_workers": parallel} if parallel else {}
    if as_prometheus:
        from orchestrator.ops.monitor import STATE_HISTORY_TAIL, state_metrics

        workers["history_tail"] = STATE_HISTORY_TAIL
    results = gather_status(hosts, port_of, served_name_of, accept_new_host_key, api_key_of=api_key_of,
                            node_entry=_inventory_lookup(app), **workers)
    if as_prometheus:
        click.echo(state_metrics(results), nl=False)
    elif as_json:
        click.echo(json.dumps([r.as_dict() for r in results], indent=2, default=str))
    else:
        render_status(console(), results)
    if not all(r.reachable for r in results):
        return 1
    if as_prometheus:
        return 0
    attention = [line for r in results for line in r.attention()]
    for line in attention:
        click.echo(f"needs attention: {printable(line)}", err=True)
    return 1 if attention else 0


# -- history ---------------------------------------------------------------------------------------

@click.command(epilog=exit_codes("0 ok, 1 the host could not be reached, 2 bad input (a host with several "
                                  "services and none named)."))
@model_argument(required=False, metavar="[SERVICE]")
@host_options
@click.option("--limit", "-n", type=click.IntRange(min=1), default=30, show_default=True,
              help="Show the last N records.")
@click.option("--model", "model_opt", default=None, help="Only records about this model (or service).",
              shell_complete=complete_models)
@json_option("Print the records as a JSON list.")
@pass_app
def history(app, model, host_name, accept_new_host_key, limit, model_opt, as_json):
    """Show every deploy, swap, rollback, stop, gc and bench on a host, with timings and results
    (from history.jsonl in the host's state_dir). On a host that runs several services, name the
    one (SERVICE) whose records to show.

    \b
    Example:
      vllm-orch history --host sim
      vllm-orch history minimax-m25 --host gpu1
    """
    from orchestrator.cli.views import render_history
    from orchestrator.config.placement import choose_service
    from orchestrator.host.connect import open_host
    from orchestrator.host.state import read_history, read_records

    entry = load_host_entry(app, host_name)
    model = model or model_opt
    with open_host(entry, accept_new_host_key) as host:
        if model is None:
            services = read_records(host, entry)
            choose_service(services, None, entry.name, f"history SERVICE --host {entry.name}",
                           asleep=[n for n, r in services.items() if r.asleep])
        lines = read_history(host, entry)
    records = [r.shown() for r in lines if model is None or r.about(model)][-limit:]
    if as_json:
        click.echo(json.dumps(records, indent=2, default=str))
        return
    render_history(console(), entry.name, records)


def the_only_service(host, entry, command: str, *, prefer_awake: bool = False) -> str:
    """The service a per-service command (stop, logs) means when none is named: the host's only one
    (with `prefer_awake`, for commands that change nothing: else its only awake one). Several, or
    none recorded: exit 2 in one line (naming them, or pointing at status)."""
    from orchestrator.config.placement import choose_service
    from orchestrator.errors import ConfigError
    from orchestrator.host.state import read_records

    usage = f"{command} SERVICE --host {entry.name}"
    records = read_records(host, entry)
    name = choose_service(records, None, entry.name, usage,
                          asleep=[n for n, r in records.items() if r.asleep] if prefer_awake else ())
    if name is None:
        raise ConfigError(f"{entry.name} runs no recorded service: name one (`vllm-orch {usage}`)",
                          hint="vllm-orch status")
    return name


# -- logs ------------------------------------------------------------------------------------------

@click.command(epilog=exit_codes("0 ok, 1 the host could not be reached or its log could not be read, "
                                  "2 bad input (no service of MODEL installed, or a host with several "
                                  "services and none named)."))
@model_argument(required=False, metavar="[SERVICE]")
@host_options
@click.option("--since-deploy", is_flag=True,
              help="From the start of the last deploy/swap of MODEL (process hosts: its last start).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until Ctrl-C.")
@click.option("-n", "--lines", type=click.IntRange(min=1), default=200, show_default=True,
              help="How many of the last lines to show (without --since-deploy).")
@click.option("--nodes", "all_nodes", is_flag=True,
              help="A service across several hosts: every node's log, merged by time, each line prefixed "
                   "with its node (with -f: as the lines arrive).")
@pass_app
def logs(app, model, host_name, accept_new_host_key, since_deploy, follow, lines, all_nodes):
    """Show a model service's log: journalctl -u vllm-MODEL on systemd hosts, the service's log
    file on process hosts. Streamed as it is read; -f follows until Ctrl-C. The service may be
    left out on a host that runs one.

    \b
    Examples:
      vllm-orch logs kimi-k25-int4 --host sim --since-deploy
      vllm-orch logs kimi-k25-int4 --host gpu1 -f
      vllm-orch logs kimi-k25-int4-2node --host gpu1 --nodes --since-deploy
    """
    from orchestrator.errors import ConfigError
    from orchestrator.host.connect import open_host
    from orchestrator.host.services import Service
    from orchestrator.host.state import read_history, read_installed
    from orchestrator.ops.stop import deploy_started_at

    entry = load_host_entry(app, host_name)
    with open_host(entry, accept_new_host_key) as host:
        if model is None:
            model = the_only_service(host, entry, "logs", prefer_awake=True)
        if read_installed(host, entry, model) is None:
            listing = host.run(["ls", f"{entry.state_dir}/installed"])
            names = sorted(n[:-5] for n in listing.stdout.split() if n.endswith(".json"))
            raise ConfigError(f"{model} has no service installed on {entry.name}",
                              hint=f"installed: {', '.join(names) or 'none'}")
        since = None
        if since_deploy:
            since = deploy_started_at([r.shown() for r in read_history(host, entry)], model)
            if since is None:
                since = time.time() - 24 * 3600   # no deploy on record: the last day (process: last start)
        nodes: list[str] = []
        if all_nodes:
            from orchestrator.ops.stop import recorded_nodes

            nodes = recorded_nodes(host, entry, model)
            if not nodes:
                raise ConfigError(f"{model} on {entry.name} is not a service across several hosts: --nodes "
                                  f"has no other node's log to merge", hint=f"vllm-orch logs {model} --host {entry.name}")
        if not nodes:
            svc = Service.for_host(host, entry, model)
            cmd = svc.log_command(follow=follow, since=since, lines=lines)
            out = sys.stdout

            def emit(line: str) -> None:
                out.write(printable(line) + "\n")
                out.flush()

            try:
                r = host.stream(cmd, on_line=emit, timeout=10 ** 7 if follow else 600)
            except KeyboardInterrupt:
                return
    if nodes:
        return _node_logs(app, entry, model, nodes, accept_new_host_key, follow, since, lines)
    if not r.ok and r.stderr.strip():
        click.echo(printable(r.stderr.strip().splitlines()[-1]), err=True)
        return 1
    return 0


def _node_logs(app, entry, model: str, nodes: list[str], accept_new_host_key: bool, follow: bool,
               since: float | None, lines: int) -> int:
    """Every node's log of a multi-node service, read at once (one thread and connection per node),
    merged by time (ops/stop.merge_logs); with follow, each line as it arrives, prefixed by its node."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from orchestrator.host.connect import open_host
    from orchestrator.host.services import Service
    from orchestrator.ops.stop import merge_logs

    entries = [entry if n == entry.name else load_host_entry(app, n) for n in nodes]
    printing = threading.Lock()

    def read(e) -> tuple[str, list[str], str]:
        got: list[str] = []

        def emit(line: str) -> None:
            if follow:
                with printing:
                    sys.stdout.write(f"[{e.name}] {printable(line)}\n")
                    sys.stdout.flush()
            else:
                got.append(printable(line))

        with open_host(e, accept_new_host_key) as host:
            cmd = Service.for_host(host, e, model).log_command(follow=follow, since=since, lines=lines)
            r = host.stream(cmd, on_line=emit, timeout=10 ** 7 if follow else 600)
        problem = printable(r.stderr.strip().splitlines()[-1]) if not r.ok and r.stderr.strip() else ""
        return e.name, got, problem

    pool = ThreadPoolExecutor(max_workers=len(entries), thread_name_prefix="logs")
    try:
        results = list(pool.map(read, entries))
    except KeyboardInterrupt:
        return 0                                # -f ends with Ctrl-C: that is how it is used
    finally:
        pool.shutdown(wait=not follow, cancel_futures=True)
    for line in merge_logs([(name, got) for name, got, _ in results]):
        sys.stdout.write(line + "\n")
    sys.stdout.flush()
    problems = [f"{name}: {p}" for name, _, p in results if p]
    for p in problems:
        click.echo(p, err=True)
    return 1 if problems else 0


# -- stop ------------------------------------------------------------------------------------------

@click.command(epilog=exit_codes("0 stopped (or already stopped; with --dry-run: the plan was shown), "
                                  "1 GPUs not released, 2 bad input (a host with several services and none "
                                  "named), 3 refused (lock held, MODEL not installed)."))
@model_argument(required=False, metavar="[SERVICE]")
@fleet_host_options
@dry_run_option("Show what would be stopped and killed, and change nothing on the host.")
@json_option("Print the result as JSON.")
@click.option("--gpu-timeout", type=click.FloatRange(min=0.1), default=None,
              help="Seconds to wait for GPU memory to be released (default 90).")
@pass_app
def stop(app, model, hosts, parallel, accept_new_host_key, dry_run, as_json, gpu_timeout):
    """Stop MODEL's service, then make sure its GPUs are really free: leftover VLLM::Worker
    processes of that model on its GPUs are killed (SIGTERM, then SIGKILL) and nvidia-smi is polled
    until their memory is released. Clears the service's record. Takes the host lock. Stopping a
    stopped model does nothing and says so. On a host that runs several services, name the one
    (the others keep serving); on a host with one it may be left out.

    With several hosts they are stopped in parallel, with a summary table. A service across several
    hosts (a multi-node manifest) is stopped on every one of its nodes, whichever node is named.

    \b
    Examples:
      vllm-orch stop kimi-k25-int4 --host sim --dry-run
      vllm-orch stop kimi-k25-int4 --host sim
      vllm-orch stop kimi-k25-int4 --group prod
    """
    from orchestrator.plan.run import GPU_RELEASE_TIMEOUT_S

    timeout = gpu_timeout or GPU_RELEASE_TIMEOUT_S
    if len(hosts) == 1:
        model, hosts = _every_node(app, hosts[0], model, accept_new_host_key)
    if len(hosts) > 1:
        from orchestrator.cli.fleet import finish_fleet, run_with_view
        from orchestrator.ops.fleet import HostOutcome

        def one(entry, reporter) -> HostOutcome:
            res = _stop_on(app, entry, model, accept_new_host_key, dry_run, timeout, reporter)
            note = "already stopped" if res.nothing_to_do else (res.gpus_free or "")
            return HostOutcome(0 if res.ok else 1, None if res.ok else f"stop: {res.error or 'GPUs not released'}",
                               note, res.as_dict(), res)

        title = f"stop {model or 'its service'}{' (dry run)' if dry_run else ''}"
        return finish_fleet(title, run_with_view(title, hosts, one, parallel, as_json), as_json, "GPUs")
    from orchestrator.ops.execute import Reporter

    entry = hosts[0]
    reporter = Reporter(console(), quiet=as_json)
    res = _stop_on(app, entry, model, accept_new_host_key, dry_run, timeout, reporter)
    model = res.model       # the host's one service when none was named
    if as_json:
        click.echo(json.dumps(res.as_dict(), indent=2))
        return res
    c = console()
    if dry_run:
        assert res.plan is not None
        reporter.plan(res.plan)                 # exactly what a stop runs, its recovery included
        return res
    if res.nothing_to_do:
        c.print(f"{model} on {entry.name} is already stopped: nothing to do "
                f"({res.gpus_free or 'no GPUs recorded'}).", markup=False)
        return res
    if res.orphans:
        c.print(f"  {len(res.orphans)} processes of {model} outlived its main process: "
                + ", ".join(f"{o['pid']} {o['name']}" for o in res.orphans), markup=False)
    if res.cleared_active:
        c.print(f"  cleared {model}'s record (services/{model}.json)", markup=False)
    if not res.ok:
        from orchestrator.errors import DeployFailed

        raise DeployFailed(res.error or "GPUs not released", host=entry.name, step="stop",
                           hint="find the holders with `fuser -v /dev/nvidia*`")
    c.print(f"[bold green]stopped {model} on {entry.name}[/] ({res.seconds:.1f}s): "
            f"{escape(res.gpus_free or 'no GPUs recorded for it')}")
    return res


def _every_node(app, entry, model: str | None, accept_new_host_key: bool):
    """(service, hosts) for `stop [SERVICE] --host H`: every node of a multi-node service that H
    is a node of (its records name them, head first), else H alone."""
    from orchestrator.host.connect import open_host
    from orchestrator.ops.stop import recorded_nodes

    with open_host(entry, accept_new_host_key) as host:
        name = model or the_only_service(host, entry, "stop")
        nodes = recorded_nodes(host, entry, name)
    if not nodes or nodes == [entry.name]:
        return model, [entry]
    return name, [entry if n == entry.name else load_host_entry(app, n) for n in nodes]


def _stop_on(app, entry, model: str | None, accept_new_host_key: bool, dry_run: bool, timeout: float, reporter):
    """Stop MODEL on one host (its session and lock): the stop's result (its plan with it)."""
    from orchestrator.ops.session import session
    from orchestrator.ops.stop import stop_model

    if model is None:
        from orchestrator.host.connect import open_host

        with open_host(entry, accept_new_host_key) as host:
            model = the_only_service(host, entry, "stop")
    manifest_gpus = None
    try:
        from orchestrator.cli.common import resolved_models_dir
        from orchestrator.config.effective import effective
        from orchestrator.config.manifest import get_manifest

        # the GPUs it takes on this host (a host's overrides may move them)
        m = effective(get_manifest(model, resolved_models_dir(app))[0], entry).manifest
        manifest_gpus = m.serving.visible_devices
    except Exception:
        pass    # a manifest removed since the deploy (or a --name service): its record or the processes say
    with session(entry, f"stop {model}", dry_run, accept_new_host_key) as s:
        return stop_model(s.host, entry, model, manifest_gpus, release_timeout=timeout, reporter=reporter,
                          dry_run=dry_run, lock=s.lock, guard=s.guard)


# -- gc --------------------------------------------------------------------------------------------

@click.command(epilog=exit_codes("0 ok, 1 a folder could not be deleted, 2 bad input (a NAME that is no "
                                  "folder), 3 refused (a NAME in use, no confirmation, lock held)."))
@click.argument("names", metavar="[NAME]...", nargs=-1)
@host_options
@dry_run_option("Show what would be deleted; delete nothing.")
@json_option("Print the plan/result as JSON (needs --yes or --dry-run).")
@yes_option("delete the folders without asking (needed without a terminal)")
@pass_app
def gc(app, names, host_name, accept_new_host_key, dry_run, as_json, yes):
    """Delete managed model folders (direct children of models_root) that are not the active model
    and whose service is not running, and engine venvs no service uses. Shows each with its size
    and last use and asks first; without a terminal it refuses unless --yes. Never deletes anything
    outside models_root and engines_root, nor a folder vllm-orch did not make.

    With NAMEs (a folder under models_root, or an engine venv), only those go; a NAME some service
    uses is refused (exit 3, nothing deleted): stop that service first.

    \b
    Examples:
      vllm-orch gc --host sim --dry-run
      vllm-orch gc minimax-m25 --host sim --yes
    """
    from orchestrator.cli.common import terminal_ask
    from orchestrator.ops.execute import Reporter, confirmation
    from orchestrator.ops.session import session
    from orchestrator.ops.stop import gc_plan, run_gc

    entry = load_host_entry(app, host_name)
    c = console()
    reporter = Reporter(c, quiet=as_json)
    with session(entry, "gc", dry_run, accept_new_host_key) as s:
        plan = gc_plan(s.host, entry, s.lock, names)
        data = {"host": entry.name, "dry_run": dry_run, "delete": plan.info["delete"], "keep": plan.info["keep"],
                "bytes": plan.info["bytes"]}
        reporter.plan(plan)                     # exactly what gc deletes (each step asks first)
        if dry_run or not plan.changes:
            if as_json:
                click.echo(json.dumps(data, indent=2))
            return 0
        refusal = confirmation(plan, yes, terminal_ask(as_json), entry.name)
        if refusal is not None:
            raise refusal
        record = run_gc(s.host, entry, plan, reporter, guard=s.guard)
    if as_json:
        click.echo(json.dumps({**data, **record}, indent=2))
    else:
        from orchestrator.fmt import fmt_bytes

        n = len(record["deleted"])
        c.print(f"[bold]gc on {entry.name}:[/] deleted {n} folder{'' if n == 1 else 's'}, freed "
                f"{fmt_bytes(record['freed_bytes'])}" + (f"; kept {len(record['kept'])} (see above)"
                                                        if record["kept"] else ""))
    return 0 if record["ok"] else 1
