"""CLI consistency: every command's --help ends with its exit codes, the shared options mean one
thing everywhere, and shell completion offers model names (manifests) and host names (inventory)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml
from click.shell_completion import ShellComplete
from click.testing import CliRunner

from orchestrator.cli.main import LAZY_COMMANDS, cli

REPO = Path(__file__).resolve().parents[2]

# Commands that change a host: each must accept --dry-run (and change nothing with it: see
# tests/integration/test_dry_run.py).
HOST_CHANGING = ("deploy", "swap", "regen", "stop", "gc")


def all_commands() -> dict[str, click.Command]:
    """'deploy', 'sim up', 'bench compare'... -> the click command (lazy ones loaded)."""
    from orchestrator.cli.bench import compare_cmd

    ctx = click.Context(cli)
    out: dict[str, click.Command] = {"": cli}
    for name in LAZY_COMMANDS:
        cmd = cli.get_command(ctx, name)
        out[name] = cmd
        if isinstance(cmd, click.Group):
            for sub in cmd.list_commands(ctx):
                out[f"{name} {sub}"] = cmd.get_command(ctx, sub)
    out["bench compare"] = compare_cmd
    return out


def option_names(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}


@pytest.mark.parametrize("name", sorted(all_commands()))
def test_every_help_lists_exit_codes(name):
    args = [*name.split(), "--help"] if name else ["--help"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "Exit codes: 0 " in text, f"`vllm-orch {name} --help` does not list its exit codes"


@pytest.mark.parametrize("name", HOST_CHANGING)
def test_host_changing_commands_have_dry_run(name):
    assert "--dry-run" in option_names(all_commands()[name])


def test_shared_options_mean_one_thing():
    """Same flag, same help text (up to the command-specific tail), same type, wherever it exists."""
    seen: dict[str, tuple] = {}
    for name, cmd in all_commands().items():
        for p in cmd.params:
            if not isinstance(p, click.Option):
                continue
            if "--yes" in p.opts:
                assert "-y" in p.opts and p.help.startswith("Do not ask: "), name
            if "--host" in p.opts:
                assert p.metavar == "HOST" and p._custom_shell_complete is not None, name
            for flag in ("--accept-new-host-key", "--skip-check", "--kill-foreign", "--verify-engine"):
                if flag in p.opts:
                    key = (p.help, type(p.type).__name__, getattr(p.type, "choices", None))
                    assert seen.setdefault(flag, key) == key, f"{flag} differs in `{name}`"
    assert set(seen) == {"--accept-new-host-key", "--skip-check", "--kill-foreign", "--verify-engine"}
    # bench --host reaches hosts over SSH like every other command
    assert "--accept-new-host-key" in option_names(all_commands()["bench"])


def test_unknown_skip_check_is_bad_input():
    r = CliRunner().invoke(cli, ["deploy", "kimi-k25-int4", "--host", "x", "--skip-check", "flag"])
    assert r.exit_code == 2 and "'flag' is not one of" in r.output


@pytest.fixture
def places(tmp_path, monkeypatch):
    """A models folder with two manifests, a hosts.yaml and an extra inventory file."""
    models = tmp_path / "models"
    models.mkdir()
    for name in ("kimi-k25-int4", "minimax-m25"):
        shutil.copy(REPO / "models" / f"{name}.yaml", models / f"{name}.yaml")
    (tmp_path / "hosts.yaml").write_text(yaml.safe_dump({"hosts": {"gpu1": {"address": "gpu1.example"},
                                                                   "gpu2": {"address": "gpu2.example"}}}))
    extra = tmp_path / "state" / "hosts.d"
    extra.mkdir(parents=True)
    (extra / "sim.yaml").write_text(yaml.safe_dump({"hosts": {"sim": {"address": "local", "label": "SIMULATED"}}}))
    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("VLLM_ORCH_MODELS", raising=False)
    monkeypatch.delenv("VLLM_ORCH_INVENTORY", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def complete(args: list[str], incomplete: str) -> list[str]:
    comp = ShellComplete(cli, {}, "vllm-orch", "_VLLM_ORCH_COMPLETE")
    return [c.value for c in comp.get_completions(args, incomplete)]


def test_model_arguments_complete_from_the_manifests(places):
    assert complete(["deploy"], "") == ["kimi-k25-int4", "minimax-m25"]
    assert complete(["swap"], "mini") == ["minimax-m25"]
    for cmd in ("check", "render", "logs", "stop", "bench"):
        assert complete([cmd], "k") == ["kimi-k25-int4"], cmd
    other = places / "other"
    other.mkdir()
    shutil.copy(REPO / "models" / "example.yaml", other / "example.yaml")
    assert complete(["--models", str(other), "deploy"], "") == ["example"]     # the global option counts


def test_host_options_complete_from_the_inventory(places):
    assert complete(["deploy", "kimi-k25-int4", "--host"], "") == ["gpu1", "gpu2", "sim"]
    assert complete(["status", "--host"], "s") == ["sim"]
    for cmd in (["swap", "minimax-m25"], ["regen"], ["stop", "m"], ["gc"], ["history"], ["bench"]):
        assert complete([*cmd, "--host"], "gpu") == ["gpu1", "gpu2"], cmd
    inv = places / "lab.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"lab1": {"address": "lab1.example"}}}))
    assert complete(["--inventory", str(inv), "gc", "--host"], "") == ["lab1", "sim"]


def test_completion_never_breaks_the_shell(places):
    (places / "hosts.yaml").write_text("hosts: [not, a, mapping")
    assert complete(["gc", "--host"], "") == []
    assert complete(["deploy", "--skip-check"], "f") == ["flags", "foreign-gpu-processes"]


def test_the_documented_shell_hook_works(places):
    """`_VLLM_ORCH_COMPLETE=bash_source vllm-orch` prints the hook; the hook's request answers."""
    exe = [sys.executable, "-m", "orchestrator.cli.main"]
    env = dict(os.environ, _VLLM_ORCH_COMPLETE="bash_source")
    hook = subprocess.run(exe, env=env, capture_output=True, text=True, timeout=60)
    assert hook.returncode == 0 and "_vllm_orch_completion()" in hook.stdout
    env = dict(os.environ, _VLLM_ORCH_COMPLETE="bash_complete", COMP_WORDS="vllm-orch deploy kimi-k25-int4 --host g",
               COMP_CWORD="4")
    r = subprocess.run(exe, env=env, capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["plain,gpu1", "plain,gpu2"], r.stdout + r.stderr


def test_one_place_maps_results_to_exit_codes():
    """Commands return their result; cli/main.exit_code (through the group's result callback) is
    the one place it becomes the exit code. No command exits by itself."""
    from pathlib import Path

    from orchestrator.cli.main import exit_code
    from orchestrator.errors import RefusedError
    from orchestrator.ops.session import OpResult
    from orchestrator.plan.model import Plan

    plan = Plan("deploy", "h", "m")
    assert exit_code(None) == 0 and exit_code(3) == 3 and exit_code(True) == 0
    assert exit_code(OpResult("deploy", "h", "m", ok=True, dry_run=False, plan=plan)) == 0
    refused = OpResult("deploy", "h", "m", ok=False, dry_run=False, plan=plan, error=RefusedError("no"))
    assert exit_code(refused) == 3
    assert exit_code(OpResult("deploy", "h", "m", ok=False, dry_run=False, plan=plan)) == 1
    cli_dir = Path(__file__).parents[2] / "orchestrator" / "cli"
    exits = [p.name for p in cli_dir.glob("*.py") if p.name != "main.py" and "sys.exit(" in p.read_text()]
    assert exits == []


@pytest.mark.parametrize("command,target", [("deploy", "orchestrator.ops.deploy.run_deploy"),
                                            ("swap", "orchestrator.ops.swap.run_swap"),
                                            ("check", "orchestrator.cli.deploy.preflight_on")])
def test_verify_engine_reaches_the_operations_options(places, monkeypatch, command, target):
    seen = []

    class Stop(Exception):
        pass

    def capture(*args, **kwargs):
        seen.append(next(a for a in args if type(a).__name__ == "Options"))
        raise Stop

    module, name = target.rsplit(".", 1)
    monkeypatch.setattr(f"{module}.{name}", capture)
    for flags, want in (([], False), (["--verify-engine"], True)):
        CliRunner().invoke(cli, [command, "minimax-m25", "--host", "gpu1", *flags])
        assert seen and seen.pop().verify_engine is want, (command, flags)
