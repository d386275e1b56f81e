"""A service stays where it was placed (issue 25): after `deploy MODEL --gpus 4-7 --port P --name
mm-b`, a changed manifest's regen, a redeploy and a swap without --gpus/--port keep mm-b on its GPUs
and port; and every planner, regen included, refuses a placement that takes another service's GPUs
or port. Driven through the CLI as a user would, on a SIMULATED host."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from orchestrator.config.manifest import Manifest
from orchestrator.host.state import read_records
from orchestrator.probe.api import Endpoint, health

from .deployhelp import SHIPPED, cli_env, entry, free_port, write_models

MM = "minimax-m25"             # TP4: GPUs 0-3 by its manifest


def with_changes(port: int, **serving) -> Manifest:
    data = SHIPPED[MM].model_dump()
    data["serving"]["port"] = port
    data["serving"].update(serving)
    data["vllm"]["gpu_memory_utilization"] = serving.pop("_util", data["vllm"]["gpu_memory_utilization"])
    return Manifest.model_validate(data)


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], env={**env, "COLUMNS": "250"},
                          capture_output=True, text=True, timeout=300)


def changed_lines(text: str, marker: str) -> list[str]:
    """The diff lines (+/-) of a dry run's output that mention `marker`."""
    return [line.strip() for line in text.splitlines() if line.strip()[:1] in "+-" and marker in line]


def test_regen_redeploy_and_swap_keep_a_placed_service_where_it_is(sim_host, tmp_path):
    pa, pb = free_port(), free_port()
    models = tmp_path / "models"
    write_models(models, [with_changes(pa)])
    env = cli_env(sim_host, models)
    e = entry(sim_host)
    r = cli(env, "deploy", MM, "--host", "sim")
    assert r.returncode == 0, r.stdout + r.stderr
    r = cli(env, "deploy", MM, "--host", "sim", "--gpus", "4-7", "--port", str(pb), "--name", "mm-b")
    assert r.returncode == 0, r.stdout + r.stderr

    # The manifest changes (a memory fraction): regen re-renders both services, each where it is.
    data = with_changes(pa).model_dump()
    data["vllm"]["gpu_memory_utilization"] = 0.85
    write_models(models, [Manifest.model_validate(data)])
    r = cli(env, "regen", "--host", "sim", "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    assert changed_lines(r.stdout, "CUDA_VISIBLE_DEVICES") == [], r.stdout
    assert any(f"--port {pb} " in line for line in changed_lines(r.stdout, "+set --")), r.stdout
    assert not any(f"--port {pa} " in line and "mm-b" in line for line in r.stdout.splitlines())
    r = cli(env, "regen", "--host", "sim", "--restart")
    assert r.returncode == 0, r.stdout + r.stderr
    records = {n: r.shown() for n, r in read_records(sim_host.host, e).items()}
    assert (records["mm-b"]["gpus"], records["mm-b"]["port"]) == ([4, 5, 6, 7], pb)
    assert (records[MM]["gpus"], records[MM]["port"]) == ([0, 1, 2, 3], pa)
    assert health(Endpoint(sim_host.host, pb)) == 200 and health(Endpoint(sim_host.host, pa)) == 200

    # A redeploy of mm-b without --gpus/--port: it is where it was, nothing to do.
    r = cli(env, "deploy", MM, "--host", "sim", "--name", "mm-b", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert all(s["noop"] for s in out["plan"] if s["step"] != "lock"), out["plan"]

    # A swap of mm-b to itself (a redeploy through swap) keeps it there too.
    r = cli(env, "swap", MM, "--host", "sim", "--name", "mm-b", "--replace", "mm-b", "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nothing to do" in r.stdout, r.stdout


def test_regen_refuses_a_manifest_change_that_moves_a_service_onto_another(sim_host, tmp_path):
    """minimax-m25's manifest moves to mm-b's port: regen refuses (exit 3, naming mm-b), changes nothing."""
    pa, pb = free_port(), free_port()
    models = tmp_path / "models"
    write_models(models, [with_changes(pa)])
    env = cli_env(sim_host, models)
    e = entry(sim_host)
    assert cli(env, "deploy", MM, "--host", "sim").returncode == 0
    r = cli(env, "deploy", MM, "--host", "sim", "--gpus", "4-7", "--port", str(pb), "--name", "mm-b")
    assert r.returncode == 0, r.stdout + r.stderr
    write_models(models, [with_changes(pb)])
    installed = {p.name: p.read_text() for p in (Path(e.state_dir) / "installed").iterdir()}
    for args in (["--dry-run"], ["--restart"]):
        r = cli(env, "regen", "--host", "sim", *args)
        assert r.returncode == 3, (args, r.stdout, r.stderr)
        assert "mm-b" in r.stdout + r.stderr and f"port {pb}" in r.stdout + r.stderr, r.stdout + r.stderr
    assert {p.name: p.read_text() for p in (Path(e.state_dir) / "installed").iterdir()} == installed
    assert health(Endpoint(sim_host.host, pb)) == 200 and health(Endpoint(sim_host.host, pa)) == 200
