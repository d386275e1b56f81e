"""`vllm-orch swap` and `vllm-orch regen`."""

from __future__ import annotations

import click

from orchestrator.cli.common import (
    console,
    load_model,
    pass_app,
    resolved_models_dir,
    terminal_ask,
)
from orchestrator.cli.deploy import finish, make_options, placement_options, service_request
from orchestrator.cli.options import (
    DEFAULT_EXIT_CODES,
    dry_run_option,
    exit_codes,
    fleet_host_options,
    host_selection,
    json_option,
    kill_foreign_option,
    model_argument,
    skip_check_option,
    verify_engine_option,
    yes_option,
)
from orchestrator.fmt import escape


@click.command(epilog=exit_codes("0 ok, 1 failed (the previous model was started again when it could be: "
                                 "see the rollback line), 2 bad input, 3 refused by a safety check or for "
                                 "want of --yes (nothing changed), 130 interrupted (the rollback ran: see its "
                                 "line)."))
@model_argument()
@host_selection(fleet=True, parallel=False)
@dry_run_option()
@json_option()
@skip_check_option
@verify_engine_option
@kill_foreign_option
@click.option("--max-unavailable", type=click.IntRange(min=1), default=1, show_default=True, metavar="K",
              help="With several hosts: swap at most K hosts at a time (the others keep serving).")
@click.option("--continue-on-failure", is_flag=True,
              help="With several hosts: go on with the next hosts after a host's swap failed (and rolled back); "
                   "by default the rollout stops there.")
@yes_option("delete the model folders the plan frees disk with (vllm-orch's own only), and accept an "
            "unstaged swap when the disk cannot hold both models (longer downtime, no rollback without a "
            "new download); without it deletions are asked on a terminal and an unstaged swap is refused")
@click.option("--warm/--no-warm", default=True, show_default=True,
              help="While the old model still serves, read the new model's weights into the page cache (in "
                   "vLLM's load order, as far as memory allows), so its load reads from RAM.")
@click.option("--replace", "replace", default=None, metavar="SERVICE",
              help="The service MODEL replaces, on a host that runs several; the others keep serving. MODEL "
                   "takes its GPUs and port unless --gpus / --port say otherwise.")
@click.option("--sleep-old", "sleep_old", is_flag=True,
              help="Put the old service to sleep (vLLM's sleep mode: its manifest's `sleep` section) instead of "
                   "stopping it: a later swap back wakes it in seconds. Level 1 when host RAM holds its weights, "
                   "else level 2 (the plan says which). Needs a port of its own for MODEL (--port).")
@placement_options
@pass_app
def swap(app, model, hosts, accept_new_host_key, dry_run, as_json, skip_checks, verify_engine, kill_foreign,
         max_unavailable, continue_on_failure, yes, warm, replace, sleep_old, service_name, gpus, port):
    """Replace the active model on a host with MODEL, with rollback.

    The new model is downloaded and verified while the old one keeps serving (when the disk holds
    both) and its weights are read into the page cache as far as memory allows (--no-warm skips
    that), then the old one is stopped, its GPUs are checked free, the new one starts and must pass
    the readiness gates. If it fails any gate, it is stopped and the previous model is started again
    with its previous unit; its files are never deleted. Downtime (old stopped -> new ready) is
    measured and reported. Once the new model serves it takes the old one's start at boot.

    With sleep mode (a `sleep` section in the manifests): `--sleep-old` puts the old service to
    sleep instead of stopping it; a swap to a service that sleeps on the host wakes it (the awake one
    sleeps with --sleep-old, else stops), checks its canary (the greedy answer recorded at its first
    ready, token for token) and warms it up; a failure puts it back to sleep and brings the other
    back, a cold start as the last resort.

    Ctrl-C, SIGTERM or a lost terminal rolls back the same way (a second Ctrl-C abandons the
    rollback). A swap cut short for good is shown by `vllm-orch status`; running swap again
    finishes it.

    Across several hosts (--host a,b, --group, --all) the swap is rolling: --max-unavailable hosts
    at a time, each staged, gated and rolled back on its own as above; the first failure stops the
    rollout (--continue-on-failure goes on), so every host serves the old or the new model. The
    summary says which host serves what.

    A multi-node model swaps as one service over the selected hosts (its nodes, head first), and a
    swap from a multi-node service stops it on every node: the new one is downloaded and verified on
    all its nodes before the old one stops anywhere; a failure rolls back on every node.

    \b
    Examples:
      vllm-orch swap kimi-k25-nvfp4 --host sim --dry-run
      vllm-orch swap minimax-m25 --host gpu1
      vllm-orch swap kimi-k25-int4 --replace minimax-m25 --host gpu1
      vllm-orch swap kimi-k25-nvfp4 --host gpu1 --sleep-old --port 8001
      vllm-orch swap minimax-m25 --group prod --max-unavailable 1
    """
    from orchestrator.cli.views import warm_summary
    from orchestrator.config.manifest import load_all
    from orchestrator.ops.execute import Reporter
    from orchestrator.ops.fleet import per_host
    from orchestrator.ops.swap import run_swap
    from orchestrator.render.artifacts import secrets_from_environ

    m = load_model(app, model)
    request = service_request(m, service_name, gpus, port)     # bad --gpus: exit 2 before any host
    secrets_from_environ(m)                     # a secret it needs and is not given: exit 2 before any host
    manifests, _bad = load_all(resolved_models_dir(app))
    opts = make_options(skip_checks, kill_foreign, yes=yes, warm=warm, replace=replace, sleep_old=sleep_old,
                        verify_engine=verify_engine)
    if per_host(m, hosts):                      # the same swap on each host: rolling
        from orchestrator.cli.fleet import rolling_swap
        from orchestrator.ops.seed import run_seeded, seeded

        with seeded(opts, hosts, accept_new_host_key) as fleet_opts:      # download once per fleet
            def swap_one(e, rep):
                return run_seeded(fleet_opts, e, lambda: run_swap(e, m, manifests, fleet_opts, rep, dry_run,
                                                                  accept_new_host_key, request=request))

            return rolling_swap(app, request.name or m.name, hosts, swap_one, max_unavailable, continue_on_failure,
                                as_json, dry_run, accept_new_host_key)
    from orchestrator.cli.ops import _inventory_lookup

    reporter = Reporter(console(), quiet=as_json)     # one service over its nodes (one host, or a multi-node model's)
    result = run_swap(hosts, m, manifests, opts, reporter, dry_run, accept_new_host_key, ask=terminal_ask(as_json),
                      request=request, node_entry=_inventory_lookup(app))
    if not as_json and not dry_run:
        extra = result.extra
        if extra.get("downtime_s") is not None and result.ok:
            console().print(f"downtime: {extra['downtime_s']:.1f}s (old stopped -> new ready; the new model's "
                            f"load took {extra.get('load_s', 0):.1f}s)")
            if extra.get("warm"):
                console().print(f"warm-up: {warm_summary(extra['warm'])}")
        elif extra.get("nothing_served") and result.ok:
            console().print(f"downtime: not measured: nothing served before this swap (it ended an outage it "
                            f"did not start); the new model's load took {extra.get('load_s', 0):.1f}s")
        if "rollback" in extra:
            rb = extra["rollback"]
            style = "green" if rb["ok"] else "bold red"
            console().print(f"[{style}]rollback: {escape(rb['result'])} ({rb['seconds']:.1f}s)[/]")
    return finish(result, as_json)


@click.command(epilog=exit_codes(DEFAULT_EXIT_CODES))
@fleet_host_options
@dry_run_option("Show the diffs and change nothing on the host.")
@json_option()
@click.option("--restart", is_flag=True,
              help="Restart running services whose unit changed, through the readiness gates (with rollback).")
@pass_app
def regen(app, hosts, parallel, accept_new_host_key, dry_run, as_json, restart):
    """Re-render the units and env files of every model installed on a host from the current
    manifests and templates: a unified diff per file, then install what changed and daemon-reload.
    Running services keep running unless --restart.

    \b
    Examples:
      vllm-orch regen --host gpu1 --dry-run
      vllm-orch regen --host gpu1 --restart
      vllm-orch regen --group prod --dry-run

    With several hosts they are regenerated in parallel, with a summary table.
    """
    from orchestrator.config.manifest import load_all
    from orchestrator.ops.execute import Reporter
    from orchestrator.ops.regen import run_regen

    manifests, _bad = load_all(resolved_models_dir(app))
    if len(hosts) > 1:
        from orchestrator.cli.fleet import fleet_op

        return fleet_op("regen", hosts, parallel, as_json, dry_run,
                 lambda e, rep: run_regen(e, manifests, make_options((), False), rep, dry_run, restart,
                                          accept_new_host_key))
    entry = hosts[0]
    result = run_regen(entry, manifests, make_options((), False), Reporter(console(), quiet=as_json), dry_run,
                       restart, accept_new_host_key)
    return finish(result, as_json)
