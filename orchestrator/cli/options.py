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


def host_options(f):
    """--host (required) and --accept-new-host-key: every command that works on one host."""
    return host_option()(accept_new_host_key_option(f))


def dry_run_option(help: str = "Print the plan and change nothing on the host."):
    return click.option("--dry-run", is_flag=True, help=help)


def json_option(help: str = "Print the result as JSON (no live output)."):
    return click.option("--json", "as_json", is_flag=True, help=help)


skip_check_option = click.option(
    "--skip-check", "skip_checks", multiple=True, type=click.Choice(CHECK_NAMES), metavar="NAME",
    help=f"Skip a preflight check by name (repeatable; shown as skipped in the plan): {', '.join(CHECK_NAMES)}.")

kill_foreign_option = click.option(
    "--kill-foreign", is_flag=True,
    help="Also kill GPU processes that are not vLLM on the model's GPUs (refused otherwise).")


def yes_option(what: str):
    """--yes/-y means one thing everywhere: do not ask; go ahead where vllm-orch would otherwise ask
    for a confirmation (or, without a terminal, refuse). `what` says what is confirmed."""
    return click.option("--yes", "-y", is_flag=True, help=f"Do not ask: {what}.")
