"""deploy and swap over real SSH: a real sshd in front of the simulated host, and real-systemd
simulated hosts (systemd-nspawn containers with their own network namespace, reached over SSH)."""

from __future__ import annotations

import pytest

from orchestrator.errors import RefusedError
from orchestrator.config.inventory import HostEntry
from orchestrator.probe.api import Endpoint, health
from orchestrator.probe.readiness import NotReady
from orchestrator.sim import manager


from .deployhelp import DEPLOYABLE, deploy, on_port, statuses, swap


@pytest.fixture
def ssh_sim(sim_host, sshd_local):
    """The default simulated host, reached through a real sshd on loopback."""
    return HostEntry.model_validate({**sim_host.entry, "name": "sim", **sshd_local.inventory()})


@pytest.mark.parametrize("model", DEPLOYABLE)
def test_deploy_over_real_ssh(ssh_sim, sim_host, model):
    m = on_port(model)
    result = deploy(ssh_sim, m)
    assert result.ok, result.error
    assert statuses(result)["ready"] == "done"
    assert deploy(ssh_sim, m).plan.changes is False
    assert health(Endpoint(sim_host.host, m.serving.port)) == 200


def test_unknown_host_key_is_refused_with_its_fingerprint(sim_host, sshd_local, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    e = HostEntry.model_validate({**sim_host.entry, "name": "sim", **sshd_local.inventory(),
                                  "known_hosts_file": str(empty)})
    with pytest.raises(RefusedError) as info:
        deploy(e, on_port("minimax-m25"), dry_run=True)
    assert "SHA256:" in str(info.value) and "--accept-new-host-key" in (info.value.hint or "")


@pytest.mark.parametrize("model", DEPLOYABLE)
def test_deploy_each_model_on_real_systemd(systemd_sim, model):
    home, e = systemd_sim
    from orchestrator.host.connect import open_host
    from orchestrator.ops.stop import stop_model

    m = on_port(model, 8000)
    result = deploy(e, m)
    assert result.ok, result.error
    with open_host(e) as host:
        assert host.run(["systemctl", "is-active", f"vllm-{model}.service"]).stdout.strip() == "active"
        unit = host.get(f"/etc/systemd/system/vllm-{model}.service").decode()
        assert "KillMode=mixed" in unit and "ExecStartPost=" in unit
        verify = host.run(["systemd-analyze", "verify", f"/etc/systemd/system/vllm-{model}.service"])
        assert verify.ok and verify.stderr.strip() == "", verify.stderr
        stop_model(host, e, model)
        assert host.run(["systemctl", "is-active", f"vllm-{model}.service"]).stdout.strip() != "active"


# A crash is reported as "fatal-log" when the fatal line is read first, or "crash" when the exit is
# seen first (systemd can reap it within one poll); both carry the root-cause line.
CRASH = ("fatal-log", "crash")


@pytest.mark.parametrize("fault,kinds,cause", [
    ("crash-gpu-memory", CRASH, "Free memory on device"),
    ("crash-unrecognized-args", CRASH, "unrecognized arguments"),
    ("crash-trust-remote-code", CRASH, "contains custom code"),
    ("hang", ("hang",), None), ("garbage", ("smoke",), None)])
def test_failed_swap_rolls_back_on_real_systemd(systemd_sim, fault, kinds, cause):
    home, e = systemd_sim
    old, new = on_port("minimax-m25", 8000), on_port("minimax-m25-ep", 8000)
    manifests = {old.name: old, new.name: new}
    assert deploy(e, old).ok
    manager.add_fault("sim", fault, model=new.name, home=home)
    failed = swap(e, new, manifests, no_progress_s=2)
    assert isinstance(failed.error, NotReady) and failed.error.kind in kinds
    if cause:
        assert cause in failed.error.root_cause
    assert failed.extra["rollback"]["ok"], failed.extra["rollback"]
    from orchestrator.host.connect import open_host
    with open_host(e) as host:
        assert host.run(["systemctl", "is-active", "vllm-minimax-m25.service"]).stdout.strip() == "active"
        assert host.run(["test", "-d", f"{e.models_root}/minimax-m25"]).ok, "the old model's files are kept"


def test_swap_on_real_systemd(systemd_sim):
    home, e = systemd_sim
    old, new = on_port("minimax-m25", 8000), on_port("minimax-m25-ep", 8000)
    manifests = {old.name: old, new.name: new}
    assert deploy(e, old).ok
    ok = swap(e, new, manifests)
    assert ok.ok, ok.error
    assert ok.extra["load_s"] <= ok.extra["downtime_s"] <= ok.extra["load_s"] + 2.0


def test_probes_reach_a_server_bound_to_the_hosts_loopback(systemd_sim):
    """vLLM listening on 127.0.0.1 inside the host: the gates go through the SSH connection."""
    import socket

    from orchestrator.host.connect import open_host
    from orchestrator.config.manifest import Manifest
    from orchestrator.ops.stop import stop_model

    from orchestrator.host.state import read_active

    home, e = systemd_sim
    with open_host(e) as host:                 # this module's host is shared: stop what serves
        active = read_active(host, e)
        if active:
            stop_model(host, e, active["model"])
    data = on_port("minimax-m25", 8000).model_dump()
    data["serving"]["host"] = "127.0.0.1"
    m = Manifest.model_validate(data)
    result = deploy(e, m)
    assert result.ok, result.error
    assert statuses(result)["ready"] == "done"
    with pytest.raises(OSError):
        socket.create_connection((e.address, 8000), timeout=2).close()
    with open_host(e) as host:
        stop_model(host, e, m.name)
