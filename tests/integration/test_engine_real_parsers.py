"""Preflight asks the service's ENGINE venv (a manifest's `engine:`), with the REAL parsers of two vLLM
versions: 0.33.0 (the cached parser venv) and 0.32.0 (vLLM's CPU build, the real_vllm cache; no
extra cache to build). vLLM 0.33.0 added `--monokernel` (absent from 0.32.0's `vllm serve` parser):
the same command line passes with one engine and is refused, naming the manifest field, with the
other. The engine venvs stand at their content addresses under engines_root as links to the cached
venvs (the engine step's own check refuses links; preflight is what is tested here)."""

from __future__ import annotations

from pathlib import Path

from orchestrator.config.engine import lock_of, python_path
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.host.engine import EngineState
from orchestrator.host.local import LocalHost
from orchestrator.ops.gather import preflight
from orchestrator.plan.inputs import ServiceInput
from orchestrator.plan.preflight import FAIL, OK
from orchestrator.plan.run import Options
from orchestrator.render.artifacts import render
from tests.unit.test_planners import facts

GPU_CHECKS = frozenset({"gpus", "foreign-gpu-processes", "service-user", "root-programs", "root-folders",
                        "torch-cuda"})


def service(version: str) -> Manifest:
    return Manifest.model_validate({
        "name": "tiny", "source": {"repo": "org/tiny"}, "serving": {"gpus": 1},
        "vllm": {"extra_args": ["--monokernel"]},
        "engine": {"vllm": version, "python": "3.11"}})


def test_preflight_uses_each_engine_venvs_own_real_parser(vllm_parser_python, real_vllm, tmp_path):
    root = tmp_path / "engines"
    root.mkdir()
    # service_user root: the parser venvs live in root's cache (/root is 0700); the checks' drop to
    # an unprivileged service user is tests/integration/test_engine_least_privilege.py's
    entry = HostEntry(name="h", address="local", service_manager="process", engines_root=str(root),
                      service_user="root", models_root=str(tmp_path / "models"), units_dir=str(tmp_path / "units"),
                      state_dir=str(tmp_path / "state"))
    venvs = {"0.33.0": Path(vllm_parser_python).parent.parent, real_vllm["version"]: Path(real_vllm["venv"])}
    verdicts = {}
    for version, venv in venvs.items():
        m = service(version)
        lock = lock_of(m.engine)  # type: ignore[arg-type]
        (root / lock.name).symlink_to(venv)
        svc = ServiceInput(manifest=m, rendered=render(m, entry, {}))
        assert python_path(m, entry) == f"{root}/{lock.name}/bin/python"
        checks = preflight(LocalHost("h"), entry, svc, facts(), Options(skip_checks=GPU_CHECKS),
                           engine_now=EngineState(lock, str(root / lock.name), "ok", vllm_version=version))
        verdicts[version] = {c.name: c for c in checks}
    new, old = verdicts["0.33.0"], verdicts[real_vllm["version"]]
    assert new["flags"].status == OK and "vLLM 0.33.0" in new["flags"].summary, new["flags"]
    assert old["flags"].status == FAIL, old["flags"]
    assert "--monokernel" in old["flags"].summary and "vllm.extra_args[0]" in old["flags"].summary
    assert "0.32.0" in old["flags"].summary
    assert new["vllm-version"].status == OK and "0.33.0" in new["vllm-version"].summary
    assert old["vllm-version"].status == OK and "0.32.0" in old["vllm-version"].summary
