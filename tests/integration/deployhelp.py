"""Helpers for deploy/swap tests: shipped manifests on a free port, quick options, a quiet run."""

from __future__ import annotations

from pathlib import Path

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest, load_all
from orchestrator.config.placement import Request
from orchestrator.ops.deploy import run_deploy
from orchestrator.ops.execute import Reporter
from orchestrator.ops.swap import run_swap
from orchestrator.paths import shipped_dir
from orchestrator.plan.run import Options
from tests.plugins.sim_hosts import free_port  # noqa: F401  (re-exported: the suite's one copy)

SHIPPED, _ = load_all(shipped_dir("models"))
DEPLOYABLE = ["kimi-k25-int4", "kimi-k25-int4-dcp8", "kimi-k25-nvfp4", "minimax-m25", "minimax-m25-ep"]


# The performance step's measuring stream in tests that check logic, not the figure: 32 tokens at
# the simulated 79 tok/s take 0.4 s where the manifests' 256 take 3.2 s, in every deploy and swap
# of kimi-k25-int4 (most of the simulated-host tests). Tests of the figure itself pass perf_tokens=None.
QUICK_PERF_TOKENS = 32


def on_port(name: str, port: int | None = None, **startup) -> Manifest:
    """A shipped manifest moved to a free port (tests must not touch a user's sim on 8000)."""
    return tuned(name, port, startup=startup)


def tuned(name: str, port: int | None = None, *, perf_tokens: int | None = QUICK_PERF_TOKENS,
          **sections: dict) -> Manifest:
    """A shipped manifest on a free port with some fields of its sections changed, e.g.
    tuned("minimax-m25", startup={"budget_seconds": 10}, probes={"health_failures": 2});
    its performance measurement shortened to `perf_tokens` (None: the manifest's own)."""
    data = SHIPPED[name].model_dump()
    data["serving"]["port"] = port or free_port()
    for section, fields in sections.items():
        data[section].update(fields)
    if perf_tokens:
        data["performance"]["max_tokens"] = perf_tokens
        for hw in data["requires"]["hardware"].values():
            if hw.get("performance"):
                hw["performance"]["max_tokens"] = perf_tokens
    return Manifest.model_validate(data)


def write_models(folder: Path, manifests: list[Manifest]) -> Path:
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    for m in manifests:
        (folder / f"{m.name}.yaml").write_text(yaml.safe_dump(m.model_dump(exclude={"name"}), sort_keys=False))
    return folder


def cli_env(sim_host, models: Path) -> dict:
    """Environment for running the CLI in a subprocess against this sim home and models folder."""
    import os

    return dict(os.environ, VLLM_ORCH_STATE_HOME=str(sim_host.home.parent), VLLM_ORCH_MODELS=str(models))


def entry(sim_host, **changes) -> HostEntry:
    return HostEntry.model_validate({**sim_host.entry, "name": sim_host.name, **changes})


def opts(**kw) -> Options:
    base = dict(poll_s=0.1, budget_s=60, gpu_release_timeout_s=30)
    base.update(kw)
    return Options(**base)


def deploy(e: HostEntry, m: Manifest, dry_run: bool = False, request: Request = Request(), **kw):
    """`deploy M` (as the service `request` names: --name, --gpus, --port), quiet."""
    return run_deploy(e, m, opts(**kw), Reporter(None, quiet=True), dry_run, request=request)


def swap(e: HostEntry, m: Manifest, manifests: dict, dry_run: bool = False, request: Request = Request(), **kw):
    return run_swap(e, m, manifests, opts(**kw), Reporter(None, quiet=True), dry_run, request=request)


def statuses(result) -> dict[str, str]:
    return {r.step: r.status for r in result.outcome.results}


def kill_when(cmd: list[str], env: dict, marker: str) -> None:
    """Run a vllm-orch command and SIGKILL it once its output shows marker (an interrupted run)."""
    import subprocess

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if marker in line:
            break
    proc.kill()
    proc.wait()
