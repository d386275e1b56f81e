"""The command line. Thin: parse -> load -> (connect -> plan -> show -> execute) -> result.

This module is the only error boundary: OrchestratorError becomes one red line and an exit code;
`--debug` shows the traceback. Heavy modules (SSH, Hub, plotting, the simulator) are imported only
by the commands that use them, so `vllm-orch --help` and `vllm-orch models` start fast.
"""

from __future__ import annotations

import importlib
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import click

from orchestrator import __version__
from orchestrator.cli.options import exit_codes
from orchestrator.errors import OrchestratorError

# name -> ("module:attribute", one-line help). Listed in --help without importing the module.
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "models": ("orchestrator.cli.catalog:models", "List the deployable models."),
    "validate": ("orchestrator.cli.catalog:validate", "Check manifests and inventories; exit 2 if any is bad."),
    "render": ("orchestrator.cli.catalog:render", "Show the systemd unit, env file and vLLM argv for a model."),
    "schema": ("orchestrator.cli.catalog:schema", "Print the JSON schema of model manifests (or hosts)."),
    "hosts": ("orchestrator.cli.catalog:hosts", "List the hosts of the inventory."),
    "deploy": ("orchestrator.cli.deploy:deploy", "Deploy a model on a host: plan, download, start, verify."),
    "check": ("orchestrator.cli.deploy:check", "Run preflight checks for a model on a host, change nothing."),
    "swap": ("orchestrator.cli.swap:swap", "Replace the active model on a host, rolling back on failure."),
    "regen": ("orchestrator.cli.swap:regen", "Re-render and install the units of every model on a host."),
    "status": ("orchestrator.cli.ops:status", "Show what each host serves, its GPUs, disk and load."),
    "monitor": ("orchestrator.cli.monitor:monitor", "Write Prometheus targets, rules and a Grafana dashboard for the fleet."),
    "history": ("orchestrator.cli.ops:history", "Show every deploy, swap and rollback on a host."),
    "logs": ("orchestrator.cli.ops:logs", "Show a model service's log."),
    "stop": ("orchestrator.cli.ops:stop", "Stop a model service and verify its GPUs are free."),
    "gc": ("orchestrator.cli.ops:gc", "Delete inactive managed model folders on a host."),
    "gateway": ("orchestrator.cli.gateway:gateway", "One URL for every model of a host: route by model, drain, hold."),
    "bench": ("orchestrator.cli.bench:bench", "Benchmark a served model: single stream and concurrency sweep."),
    "sim": ("orchestrator.sim.cli:sim", "Run SIMULATED GPU hosts (fake vLLM, nvidia-smi, Hugging Face Hub)."),
}


@dataclass
class AppContext:
    """Global options, passed to every command as click's ctx.obj."""

    models_dir: Path | None = None
    inventory_path: Path | None = None
    debug: bool = False
    extra: dict = field(default_factory=dict)


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(LAZY_COMMANDS))

    def get_command(self, ctx, name):
        cmd = super().get_command(ctx, name)
        if cmd is not None or name not in LAZY_COMMANDS:
            return cmd
        module, attr = LAZY_COMMANDS[name][0].split(":")
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx, formatter):
        rows = [(name, LAZY_COMMANDS[name][1]) for name in self.list_commands(ctx)
                if name in LAZY_COMMANDS]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"],
                                              "max_content_width": 100},
             epilog=exit_codes("0 ok, 1 failed, 2 bad input, 3 refused by a safety check, 130 interrupted. "
                               "Each command's --help says what they mean for it."))
@click.version_option(__version__, prog_name="vllm-orch")
@click.option("--models", "models_dir", type=click.Path(path_type=Path), envvar="VLLM_ORCH_MODELS",
              help="Folder of model manifests (*.yaml). Default: $VLLM_ORCH_MODELS, else ./models, "
                   "else the models shipped with vllm-orch.")
@click.option("--inventory", "inventory_path", type=click.Path(path_type=Path),
              envvar="VLLM_ORCH_INVENTORY",
              help="hosts.yaml. Default: ./hosts.yaml, else ~/.config/vllm-orch/hosts.yaml. The extra "
                   "inventory files (hosts.d, e.g. the SIMULATED hosts of `vllm-orch sim up`) are always "
                   "added.")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.pass_context
def cli(ctx, models_dir, inventory_path, debug):
    """vllm-orch deploys vLLM model services on your own multi-GPU machines from declarative
    manifests: it checks the host, frees disk, downloads and verifies shards, frees the GPUs,
    starts the service and waits until it really answers. Then it swaps, rolls back and
    benchmarks.

    \b
    Try it on the built-in SIMULATED GPU host (no GPU needed):
      vllm-orch sim up
      vllm-orch deploy kimi-k25-int4 --host sim --dry-run
      vllm-orch deploy kimi-k25-int4 --host sim
      vllm-orch bench --host sim

    \b
    Shell completion (commands, options, model and host names), bash:
      eval "$(_VLLM_ORCH_COMPLETE=bash_source vllm-orch)"
    """
    ctx.obj = AppContext(models_dir=models_dir, inventory_path=inventory_path, debug=debug)


@cli.result_callback()
@click.pass_context
def _exit_with(ctx, result, **_params) -> None:
    """Every command returns its result (or a code); this is where it becomes the exit code, for
    `vllm-orch` (main) and for click's own runner alike."""
    code = exit_code(result)
    if code:
        ctx.exit(code)


def exit_code(result: object) -> int:
    """The one place a command's result becomes the process's exit code: an operation's result (its
    `exit_code`: 0 ok, 1 failed, 2 bad input, 3 refused, 130 interrupted), or a code the command
    computed (a fleet's worst host, status's unreachable host); nothing returned is 0. Errors
    raised instead are mapped by main (OrchestratorError.exit_code)."""
    if isinstance(result, bool) or result is None:
        return 0
    if isinstance(result, int):
        return result
    code = getattr(result, "exit_code", 0)
    return code if isinstance(code, int) else 0


def _interrupt(signum, frame) -> None:
    from orchestrator.host import cancel

    if not cancel.request():        # no operation runs (status, logs -f...): stop where it is
        raise KeyboardInterrupt


def interrupt_on_termination() -> dict:
    """Ctrl-C, SIGTERM (kill, a CI runner, systemd) and SIGHUP (the terminal or the SSH session to
    this machine went away) cancel a running operation cooperatively (orchestrator/host/cancel.py):
    it stops at its next check, between steps or inside a wait, the running step fails and the
    plan's recovery branch runs (a swap's rollback puts the old model back) instead of the process
    vanishing half way; on a fleet every host's run does. See orchestrator.ops.execute.
    Returns the handlers it replaced (main puts them back when it returns)."""
    return {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}


def main(argv: list[str] | None = None) -> None:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    previous = interrupt_on_termination()
    try:
        result = _run(argv, debug)
    finally:
        # main() called in-process (tests, a wrapper) must not leave its handlers behind: a later
        # operation in that process would see Ctrl-C cancel a token that is no longer its own
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    sys.exit(exit_code(result))


def _run(argv: list[str] | None, debug: bool) -> object:
    """The one error boundary: each error becomes its line(s) and its exit code (SystemExit)."""
    try:
        return cli.main(args=argv, prog_name="vllm-orch", standalone_mode=False)
    except OrchestratorError as err:
        _print_error(err)
        if debug:
            raise
        sys.exit(err.exit_code)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(1)
    except click.ClickException as err:
        err.show()
        sys.exit(2 if err.exit_code in (1, 2) else err.exit_code)
    except click.exceptions.Exit as err:
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
    except Exception as exc:  # a bug: one line, the traceback only with --debug
        if debug:
            raise
        from orchestrator.fmt import printable

        click.echo(f"error: internal error: {type(exc).__name__}: {printable(exc)}", err=True)
        click.echo("hint: run again with --debug for the traceback, and report it", err=True)
        sys.exit(1)


def _print_error(err: OrchestratorError) -> None:
    from rich.console import Console

    from orchestrator.fmt import escape, printable

    # Messages quote user text (a manifest value, a host's answer): never read it as markup.
    console = Console(stderr=True, highlight=False)
    # ... nor send its control characters to the terminal (a root-cause line quotes a service's log).
    console.print(f"[bold red]error:[/] {escape(str(err))}", markup=True, soft_wrap=True)
    for line in err.details:
        console.print(f"  {printable(line)}", markup=False, soft_wrap=True)
    if err.hint:
        console.print(f"[yellow]hint:[/] {escape(err.hint)}", soft_wrap=True)


if __name__ == "__main__":  # pragma: no cover
    main()
