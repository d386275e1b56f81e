"""Preflight inside deploy, with the REAL vLLM 0.33.0 parser as the vLLM of a simulated host
(`vllm-orch sim up --vllm-python`): shipped manifests pass; a removed flag or a wrong type is refused
against the manifest field that produced it, before anything is downloaded."""

from __future__ import annotations

import pytest
import yaml

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.errors import RefusedError
from orchestrator.sim import manager

from .deployhelp import DEPLOYABLE, deploy, on_port

pytestmark = pytest.mark.vllm_parser


@pytest.fixture
def real_parser_sim(tmp_path, monkeypatch, vllm_parser_python):
    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path / "state"))
    home = manager.sim_home()
    manager.up(1, speed=2000, vllm_python=str(vllm_parser_python), home=home)
    raw = yaml.safe_load(manager.inventory_file(home).read_text())["hosts"]["sim"]
    try:
        yield HostEntry.model_validate({**raw, "name": "sim"})
    finally:
        manager.down(home)


def _with_extra(name: str, extra: list[str]) -> Manifest:
    data = on_port(name).model_dump()
    data["vllm"]["extra_args"] = extra
    return Manifest.model_validate(data)


def test_shipped_manifests_pass_the_real_parser(real_parser_sim):
    for model in DEPLOYABLE:
        plan = deploy(real_parser_sim, on_port(model), dry_run=True).plan
        pre = [a for a in plan.actions if a.step == "preflight"][0]
        assert any(d.startswith("ok      flags: vLLM 0.33.0 parser accepts") for d in pre.details), pre.details
        assert plan.refusal is None, plan.refusal


@pytest.mark.parametrize("extra,message", [
    (["--enable-reasoning"], "unrecognized arguments: --enable-reasoning"),
    (["--swap-space", "4"], "unrecognized arguments: --swap-space"),
    (["--seed", "many"], "invalid int value: 'many'"),
])
def test_bad_flags_are_refused_against_the_field_before_the_download(real_parser_sim, extra, message):
    m = _with_extra("minimax-m25", extra)
    result = deploy(real_parser_sim, m)
    err = result.error
    assert isinstance(err, RefusedError) and err.step == "preflight", err
    assert "vllm.extra_args[" in str(err) and message in str(err)
    assert [a.step for a in result.plan.actions] == ["lock", "preflight"]
    assert not (__import__("pathlib").Path(real_parser_sim.models_root) / m.name).exists()
