"""Options and arguments shared by the commands, so each means one thing everywhere, with shell
completion of MODEL (from the manifests) and --host (from the inventory), and the exit codes every
command's --help ends with.

    @click.command(epilog=exit_codes(DEFAULT_EXIT_CODES))
    @model_argument()
    @host_option()
    @accept_new_host_key_option
    @dry_run_option()
    ...
"""

from __future__ import annotations

import functools
from pathlib import Path

import click
from click.shell_completion import CompletionItem

from orchestrator.config.checks import CHECK_NAMES

DEFAULT_EXIT_CODES = "0 ok, 1 failed, 2 bad input (nothing changed), 3 refused by a safety check (nothing changed)."


def exit_codes(text: str = DEFAULT_EXIT_CODES) -> str:
    """The epilog of a command's --help (errors.py defines the codes)."""
    return f"Exit codes: {text}"


# -- completion ------------------------------------------------------------------------------------
# Completion runs before the command: read what the global options say (or their defaults), never fail.

def _root_param(ctx: click.Context, name: str) -> Path | None:
    value = ctx.find_root().params.get(name)
    return Path(value) if value else None


def complete_models(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """Model names: the manifests of the models folder (--models, $VLLM_ORCH_MODELS, ./models...)."""
    try:
        from orchestrator.config.manifest import manifest_files, models_dir

        names = [p.stem for p in manifest_files(models_dir(_root_param(ctx, "models_dir")))]
    except Exception:   # a broken folder must not break the shell
        return []
    return [CompletionItem(n) for n in sorted(names) if n.startswith(incomplete)]


def complete_hosts(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """Host names: the inventory (--inventory, ./hosts.yaml... plus the extra-inventory folder)."""
    try:
        from orchestrator.config.inventory import load_inventory

        names = list(load_inventory(_root_param(ctx, "inventory_path")).hosts)
    except Exception:
        return []
    done, _, last = incomplete.rpartition(",")          # --host gpu1,g<TAB>
    prefix = done + "," if done else ""
    taken = set(done.split(",")) if done else set()
    return [CompletionItem(prefix + n) for n in sorted(names) if n.startswith(last) and n not in taken]


def complete_groups(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """Group names of the inventory's `groups:`."""
    try:
        from orchestrator.config.inventory import load_inventory

        names = list(load_inventory(_root_param(ctx, "inventory_path")).groups)
    except Exception:
        return []
    return [CompletionItem(n) for n in sorted(names) if n.startswith(incomplete)]


# -- arguments and options -------------------------------------------------------------------------

def model_argument(required: bool = True, metavar: str | None = None):
    return click.argument("model", required=required, metavar=metavar, shell_complete=complete_models)


def host_option(required: bool = True, multiple: bool = False, help: str | None = None):
    """--host NAME: an inventory host (repeatable where a command asks several hosts)."""
    return click.option(
        "--host", "host_names" if multiple else "host_name", required=required, multiple=multiple,
        metavar="HOST", shell_complete=complete_hosts,
        help=help or "Inventory host name (see `vllm-orch hosts`).")


accept_new_host_key_option = click.option(
    "--accept-new-host-key", is_flag=True,
    help="Trust and remember an SSH host key seen for the first time (like OpenSSH's accept-new). "
         "A changed key is always refused.")


def host_selection(fleet: bool, default_all: bool = False, parallel: bool = True):
    """--host a,b (repeatable), --group NAME (repeatable), --all and --accept-new-host-key, resolved
    against the inventory into an ordered list of host entries (orchestrator.config.inventory.select_hosts).

    fleet=True: the command gets `hosts` (the list) and `parallel` (--parallel N, None: the fleet
    runner's default). fleet=False: the command works on one host and gets `host_name` as before;
    a selection of several hosts is refused (exit 2). default_all: no selection means every host.
    parallel=False: no --parallel (swap's rollout has its own bound, --max-unavailable)."""

    def decorate(f):
        @functools.wraps(f)
        def wrapper(*args, host_names, group_names, all_hosts, **kwargs):
            from orchestrator.config.inventory import load_inventory, select_hosts
            from orchestrator.errors import ConfigError

            names = [n.strip() for value in host_names for n in value.split(",") if n.strip()]
            if not (names or group_names or all_hosts):
                if not default_all:
                    raise ConfigError("no host selected", hint="pass --host NAME (or --host a,b), --group NAME or --all")
                all_hosts = True
            app = click.get_current_context().find_root().obj
            inventory = load_inventory(app.inventory_path if app is not None else None)
            entries = select_hosts(inventory, names, list(group_names), all_hosts)
            if not entries:
                from orchestrator.config.inventory import NO_INVENTORY_HINT
                raise ConfigError("no hosts in the inventory", hint=NO_INVENTORY_HINT)
            if fleet:
                kwargs["hosts"] = entries
            elif len(entries) > 1:
                command = click.get_current_context().info_name
                raise ConfigError(f"`{command}` works on one host; {len(entries)} are selected "
                                  f"({', '.join(e.name for e in entries)})", hint="pass one --host NAME")
            else:
                kwargs["host_name"] = entries[0].name
            return f(*args, **kwargs)

        for option in reversed(_selection_options(fleet, default_all, parallel)):
            wrapper = option(wrapper)
        return accept_new_host_key_option(wrapper)

    return decorate


def _selection_options(fleet: bool, default_all: bool, parallel: bool):
    many = " (repeatable; or comma-separated: --host gpu1,gpu2)" if fleet else ""
    default = " Default: every host of the inventory." if default_all else ""
    options = [
        click.option("--host", "host_names", multiple=True, metavar="HOST", shell_complete=complete_hosts,
                     help=f"Inventory host name{many} (see `vllm-orch hosts`).{default}"),
        click.option("--group", "group_names", multiple=True, metavar="GROUP", shell_complete=complete_groups,
                     help="Every host of an inventory group (hosts.yaml `groups:`; repeatable)."),
        click.option("--all", "all_hosts", is_flag=True, help="Every host of the inventory."),
    ]
    if fleet and parallel:
        options.append(click.option(
            "--parallel", type=click.IntRange(min=1), default=None, metavar="N",
            help="With several hosts: work on at most N at once (default: all of them, at most 16)."))
    return options


def host_options(f):
    """--host/--group/--all (exactly one host) and --accept-new-host-key: every command that works on
    one host; it gets `host_name`."""
    return host_selection(fleet=False)(f)


def fleet_host_options(f):
    """--host a,b/--group/--all, --parallel and --accept-new-host-key: the commands that run on several
    hosts at once (orchestrator.ops.fleet); they get `hosts` and `parallel`."""
    return host_selection(fleet=True)(f)


def dry_run_option(help: str = "Print the plan and change nothing on the host."):
    return click.option("--dry-run", is_flag=True, help=help)


def json_option(help: str = "Print the result as JSON (no live output)."):
    return click.option("--json", "as_json", is_flag=True, help=help)


skip_check_option = click.option(
    "--skip-check", "skip_checks", multiple=True, type=click.Choice(CHECK_NAMES), metavar="NAME",
    help=f"Skip a preflight check by name (repeatable; shown as skipped in the plan): {', '.join(CHECK_NAMES)}.")

verify_engine_option = click.option(
    "--verify-engine", is_flag=True,
    help="Check the service's engine venv (a manifest's `engine:`) in full: the pins, its imports and `vllm "
         "--version` (tens of seconds on a real vLLM), instead of trusting the verdict an earlier full check "
         "recorded on the host while the venv's files are unchanged since; and ask vLLM's parser about the "
         "command line again instead of reusing the answer the venv kept.")

kill_foreign_option = click.option(
    "--kill-foreign", is_flag=True,
    help="Also kill GPU processes that are not vLLM on the model's GPUs (refused otherwise).")


def yes_option(what: str):
    """--yes/-y means one thing everywhere: do not ask; go ahead where vllm-orch would otherwise ask
    for a confirmation (or, without a terminal, refuse). `what` says what is confirmed."""
    return click.option("--yes", "-y", is_flag=True, help=f"Do not ask: {what}.")
