"""The real vLLM (CPU build) inside a real-systemd test host: `vllm-orch sim up --systemd --real-vllm`
binds the cached venv read-only into the container at its own path; deploy goes over SSH, the
service is a systemd unit, the download is the real huggingface_hub from the host's mirror."""

from __future__ import annotations

import pytest
import yaml

from orchestrator.config.inventory import HostEntry
from orchestrator.host.connect import open_host
from orchestrator.host.services import Service
from orchestrator.ops.status import host_status
from orchestrator.probe.readiness import GATES, UNIT_GATE
from orchestrator.sim import manager
from tests.plugins.real_vllm import START_BUDGET_S
from tests.plugins.remote_hosts import systemd_skip_reason

from .deployhelp import SHIPPED, deploy

pytestmark = [pytest.mark.real_vllm, pytest.mark.systemd]


@pytest.fixture
def real_systemd_host(real_vllm, tmp_path, monkeypatch):
    reason = systemd_skip_reason()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path / "state"))
    home = manager.sim_home()
    manager.up(1, systemd=True, real_vllm=True, home=home)
    try:
        raw = yaml.safe_load(manager.inventory_file(home).read_text())["hosts"]["sim"]
        yield HostEntry.model_validate({**raw, "name": "sim"}), real_vllm
    finally:
        manager.down(home)


def test_deploy_into_a_real_systemd_container_with_the_venv_bound_read_only(real_systemd_host):
    e, real = real_systemd_host
    assert e.service_manager == "systemd" and e.vllm == real["vllm"] and "PYTHONPATH" not in e.env
    assert list(e.skip_checks) == ["torch-cuda"]          # the CPU build's torch; the parser is real
    r = deploy(e, SHIPPED["tiny-llama-a"], budget_s=START_BUDGET_S, poll_s=0.5)
    assert r.ok, r.error
    assert list(r.extra["history"]["gates"]) == [*GATES, UNIT_GATE]          # a systemd host: the unit too
    st = host_status(e)
    assert (st.state, st.active_model, st.vllm_version) == ("ready", "tiny-llama-a", "0.32.0+cpu"), st
    assert sorted(p["name"] for p in st.gpu_processes) == ["VLLM::EngineCore", "VLLM::Worker"]
    assert all(p["owner"] == "tiny-llama-a" for p in st.gpu_processes)   # the unit's cgroup
    with open_host(e) as host:
        unit = Service.for_host(host, e, "tiny-llama-a")
        assert unit.state().active
        # Read-only inside the container: the venv is the machine's, shared by every host.
        touch = host.run(["touch", f"{real['venv']}/probe-write"])
        assert touch.exit_code != 0 and "Read-only file system" in touch.stderr
        assert any("Application startup complete." in line for line in unit.tail(200))
