"""`vllm-orch status`, `history`, `logs`, `stop`, `gc`: reading and operating hosts."""

from __future__ import annotations

import json
import sys
import time

import click

from orchestrator.cli.common import console, is_tty, load_host_entry, pass_app

_KEY_OPTION = click.option("--accept-new-host-key", is_flag=True,
                           help="Trust and remember an SSH host key seen for the first time.")


def _manifest_lookups(app):
    """(port_of, served_name_of) from the manifests, for a model loading before it is recorded."""
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

    return port_of, served_name_of


# -- status ----------------------------------------------------------------------------------------

@click.command()
@click.option("--host", "host_names", multiple=True, metavar="H",
              help="A host to ask (repeatable). Default: every host of the inventory.")
@click.option("--json", "as_json", is_flag=True, help="Print a list with one object per host.")
@_KEY_OPTION
@pass_app
def status(app, host_names, as_json, accept_new_host_key):
    """Show, per host: the active model and its state (loading / ready / failed / stopped),
    uptime, GPUs and their memory, GPU processes (service, left behind, foreign), KV-cache usage
    and running/waiting requests, disk use per model, the last deploy and the last benchmark.

    Hosts are asked in parallel; an unreachable host is shown with its error (exit 1).

    \b
    Examples:
      vllm-orch status
      vllm-orch status --host sim --host gpu1 --json
    """
    from orchestrator.config.inventory import load_inventory
    from orchestrator.ops.status import gather_status
    from orchestrator.cli.views import render_status

    if host_names:
        entries = [load_host_entry(app, name) for name in dict.fromkeys(host_names)]
    else:
        entries = list(load_inventory(app.inventory_path).hosts.values())
        if not entries:
            from orchestrator.errors import ConfigError

            raise ConfigError("no hosts in the inventory",
                              hint="write hosts.yaml (see hosts.example.yaml) or run `vllm-orch sim up`")
    port_of, served_name_of = _manifest_lookups(app)
    results = gather_status(entries, port_of, served_name_of, accept_new_host_key)
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in results], indent=2, default=str))
    else:
        render_status(console(), results)
    sys.exit(0 if all(r.reachable for r in results) else 1)


# -- history ---------------------------------------------------------------------------------------

@click.command()
@click.option("--host", "host_name", required=True, help="Inventory host name.")
@click.option("--limit", "-n", type=click.IntRange(min=1), default=30, show_default=True,
              help="Show the last N records.")
@click.option("--model", "model", default=None, help="Only records about this model.")
@click.option("--json", "as_json", is_flag=True, help="Print the records as a JSON list.")
@_KEY_OPTION
@pass_app
def history(app, host_name, limit, model, as_json, accept_new_host_key):
    """Show every deploy, swap, rollback, stop, gc and bench on a host, with timings and results
    (from history.jsonl in the host's state_dir).

    \b
    Example:
      vllm-orch history --host sim
    """
    from orchestrator.host.connect import open_host
    from orchestrator.host.state import read_history
    from orchestrator.cli.views import render_history

    entry = load_host_entry(app, host_name)
    with open_host(entry, accept_new_host_key) as host:
        records = read_history(host, entry)
    if model:
        records = [r for r in records if model in (r.get("model"), r.get("to"), r.get("from"))]
    records = records[-limit:]
    if as_json:
        click.echo(json.dumps(records, indent=2, default=str))
        return
    render_history(console(), entry.name, records)


# -- logs ------------------------------------------------------------------------------------------

@click.command()
@click.argument("model")
@click.option("--host", "host_name", required=True, help="Inventory host name.")
@click.option("--since-deploy", is_flag=True,
              help="From the start of the last deploy/swap of MODEL (process hosts: its last start).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until Ctrl-C.")
@click.option("-n", "--lines", type=click.IntRange(min=1), default=200, show_default=True,
              help="How many of the last lines to show (without --since-deploy).")
@_KEY_OPTION
@pass_app
def logs(app, model, host_name, since_deploy, follow, lines, accept_new_host_key):
    """Show a model service's log: journalctl -u vllm-MODEL on systemd hosts, the service's log
    file on process hosts. Streamed as it is read; -f follows until Ctrl-C.

    \b
    Examples:
      vllm-orch logs kimi-k25-int4 --host sim --since-deploy
      vllm-orch logs kimi-k25-int4 --host gpu1 -f
    """
    from orchestrator.host.connect import open_host
    from orchestrator.errors import ConfigError
    from orchestrator.ops.stop import deploy_started_at
    from orchestrator.host.services import Service
    from orchestrator.host.state import read_history, read_json

    entry = load_host_entry(app, host_name)
    with open_host(entry, accept_new_host_key) as host:
        if read_json(host, f"{entry.state_dir}/installed/{model}.json") is None:
            listing = host.run(["ls", f"{entry.state_dir}/installed"])
            names = sorted(n[:-5] for n in listing.stdout.split() if n.endswith(".json"))
            raise ConfigError(f"{model} has no service installed on {entry.name}",
                              hint=f"installed: {', '.join(names) or 'none'}")
        since = None
        if since_deploy:
            since = deploy_started_at(read_history(host, entry), model)
            if since is None:
                since = time.time() - 24 * 3600   # no deploy on record: the last day (process: last start)
        svc = Service.for_host(host, entry, model)
        cmd = svc.log_command(follow=follow, since=since, lines=lines)
        out = click.get_text_stream("stdout")

        def emit(line: str) -> None:
            out.write(line + "\n")
            out.flush()

        try:
            r = host.stream(cmd, on_line=emit, timeout=10 ** 7 if follow else 600)
        except KeyboardInterrupt:
            return
    if not r.ok and r.stderr.strip():
        click.echo(r.stderr.strip().splitlines()[-1], err=True)
        sys.exit(1)


# -- stop ------------------------------------------------------------------------------------------

@click.command()
@click.argument("model")
@click.option("--host", "host_name", required=True, help="Inventory host name.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--gpu-timeout", type=click.FloatRange(min=0.1), default=None,
              help="Seconds to wait for GPU memory to be released (default 90).")
@_KEY_OPTION
@pass_app
def stop(app, model, host_name, as_json, gpu_timeout, accept_new_host_key):
    """Stop MODEL's service, then make sure its GPUs are really free: leftover VLLM::Worker
    processes of that model on its GPUs are killed (SIGTERM, then SIGKILL) and nvidia-smi is polled
    until their memory is released. Clears the active record if MODEL was active. Takes the host
    lock. Stopping a stopped model does nothing and says so.

    \b
    Exit codes: 0 stopped (or already), 1 GPUs not released, 3 refused (lock held).
    Example:
      vllm-orch stop kimi-k25-int4 --host sim
    """
    from orchestrator.ops.session import session
    from orchestrator.ops.stop import stop_model
    from orchestrator.host.ownership import gpu_list
    from orchestrator.plan.run import GPU_RELEASE_TIMEOUT_S

    entry = load_host_entry(app, host_name)
    manifest_gpus = None
    try:
        from orchestrator.config.manifest import get_manifest
        from orchestrator.cli.common import resolved_models_dir

        manifest_gpus = get_manifest(model, resolved_models_dir(app))[0].serving.visible_devices
    except Exception:
        pass    # a manifest removed since the deploy: the active record or the processes say
    say = (lambda text: None) if as_json else (lambda text: console().print(f"  {text}", markup=False))
    with session(entry, f"stop {model}", False, accept_new_host_key) as s:
        res = stop_model(s.host, entry, model, manifest_gpus,
                         release_timeout=gpu_timeout or GPU_RELEASE_TIMEOUT_S, say=say)
    if as_json:
        click.echo(json.dumps(res.as_dict(), indent=2))
        sys.exit(0 if res.ok else 1)
    c = console()
    if res.nothing_to_do:
        c.print(f"{model} on {entry.name} is already stopped: nothing to do "
                f"({res.gpus_free or 'no GPUs recorded'}).", markup=False)
        return
    if res.orphans:
        c.print(f"  {len(res.orphans)} processes of {model} outlived its main process: "
                + ", ".join(f"{o['pid']} {o['name']}" for o in res.orphans), markup=False)
    if res.cleared_active:
        c.print(f"  cleared the active record ({model} was the active model)", markup=False)
    if not res.ok:
        from orchestrator.errors import DeployFailed

        raise DeployFailed(res.error or "GPUs not released", host=entry.name, step="stop",
                           hint="find the holders with `fuser -v /dev/nvidia*`")
    c.print(f"[bold green]stopped {model} on {entry.name}[/] ({res.seconds:.1f}s): "
            f"{res.gpus_free or 'no GPUs recorded for it'}")


# -- gc --------------------------------------------------------------------------------------------

@click.command()
@click.option("--host", "host_name", required=True, help="Inventory host name.")
@click.option("--dry-run", is_flag=True, help="Show what would be deleted; delete nothing.")
@click.option("--yes", "-y", is_flag=True, help="Delete without asking.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan/result as JSON (needs --yes or --dry-run).")
@_KEY_OPTION
@pass_app
def gc(app, host_name, dry_run, yes, as_json, accept_new_host_key):
    """Delete managed model folders (direct children of models_root) that are not the active model
    and whose service is not running. Shows each with its size and last use and asks first; without
    a terminal it refuses unless --yes. Never deletes anything outside models_root.

    \b
    Exit codes: 0 ok, 1 a folder could not be deleted, 3 refused (no confirmation, lock held).
    Example:
      vllm-orch gc --host sim --dry-run
    """
    from orchestrator.ops.session import session
    from orchestrator.errors import RefusedError
    from orchestrator.ops.stop import gc_facts, plan_gc, run_gc
    from orchestrator.cli.views import render_gc_plan

    entry = load_host_entry(app, host_name)
    c = console()
    with session(entry, "gc", dry_run, accept_new_host_key) as s:
        host, holder = s.host, s.lock.holder
        plan = plan_gc(gc_facts(host, entry))
        data = {"host": entry.name, "dry_run": dry_run,
                "delete": [vars(x) for x in plan.delete], "keep": [list(k) for k in plan.keep],
                "bytes": plan.bytes}
        if not as_json:
            render_gc_plan(c, entry, plan, holder)
        if dry_run or not plan.delete:
            if as_json:
                click.echo(json.dumps(data, indent=2))
            elif not plan.delete:
                c.print("nothing to delete.")
            return
        if not yes:
            if as_json or not is_tty() or not sys.stdin.isatty():
                raise RefusedError(f"gc would delete {len(plan.delete)} folders and needs confirmation",
                                   host=entry.name, step="gc",
                                   hint="pass --yes to delete without asking (or --dry-run to look)")
            if not click.confirm(f"Delete these {len(plan.delete)} folders on {entry.name}?", default=False):
                raise RefusedError("not confirmed: nothing deleted", host=entry.name, step="gc")
        say = (lambda text: None) if as_json else (lambda text: c.print(f"  {text}", markup=False))
        record = run_gc(host, entry, plan, say)
    if as_json:
        click.echo(json.dumps({**data, **record}, indent=2))
    else:
        from orchestrator.fmt import fmt_bytes

        c.print(f"[bold]gc on {entry.name}:[/] deleted {len(record['deleted'])} folders, freed "
                f"{fmt_bytes(record['freed_bytes'])}" + (f"; kept {len(record['kept'])} (see above)"
                                                        if record["kept"] else ""))
    sys.exit(0 if record["ok"] else 1)
