"""deploy and swap over real SSH: a real sshd in front of the simulated host, and real-systemd
simulated hosts (systemd-nspawn containers with their own network namespace, reached over SSH)."""

from __future__ import annotations

import time

import pytest

from orchestrator.config.inventory import HostEntry
from orchestrator.errors import RefusedError
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
    # a short no-progress window ends the hang case quickly; the others keep the manifest's, or a
    # loaded machine's 6 s between two log lines of the garbage case's load read as a hang (seen)
    failed = swap(e, new, manifests, **({"no_progress_s": 5} if fault == "hang" else {}))
    assert isinstance(failed.error, NotReady) and failed.error.kind in kinds, failed.error
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
    # The downtime holds the new one's load; what it adds (stop and start, 2.16 s on a busy slower
    # machine) is a figure of the machine: printed, and measured by benchmarks/bench_deploy_swap.py.
    assert ok.extra["load_s"] <= ok.extra["downtime_s"]
    print(f"staged swap on real systemd: downtime {ok.extra['downtime_s']:.2f} s, load {ok.extra['load_s']:.2f} s")


def test_probes_reach_a_server_bound_to_the_hosts_loopback(systemd_sim):
    """vLLM listening on 127.0.0.1 inside the host: the gates go through the SSH connection."""
    import socket

    from orchestrator.config.manifest import Manifest
    from orchestrator.host.connect import open_host
    from orchestrator.host.state import read_active
    from orchestrator.ops.stop import stop_model

    home, e = systemd_sim
    with open_host(e) as host:                 # this module's host is shared: stop what serves
        active = read_active(host, e)
        if active:
            stop_model(host, e, active.model)
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


# -- only our processes, on a real systemd host with a second user ---------------------------------

def _start_as(host, user: str, title: str) -> int:
    """A GPU-holder process titled like a vLLM worker, started by `user` in its own session (a live
    process of someone else: its process group leader lives). Its PID inside the container."""
    from orchestrator.host.base import Script
    from orchestrator.sim import nspawn

    prog = f"{nspawn.SIM_MOUNT}/bin/vllm"
    launcher = (f"import os, sys; os.environ.update(VLLM_SIM_HOLDER_TITLE={title!r}, VLLM_SIM_HOST_DIR="
                f"{nspawn.SIM_MOUNT!r}); os.execv(sys.executable, [{title!r}, {prog!r}, '__sim_gpu_holder__'])")
    r = host.run(Script(f"id {user} >/dev/null 2>&1 || useradd -m {user}; "
                        f"su -s /bin/sh {user} -c \"setsid python3 -c \\\"{launcher}\\\" </dev/null >/dev/null 2>&1 & "
                        f"echo \\$!\""))
    assert r.ok, r.stderr
    return int(r.stdout.split()[-1])


def _hold_gpu(host, pid: int, gpu: int, name: str) -> None:
    import json as _json

    from orchestrator.sim import nspawn

    host.put(f"{nspawn.SIM_MOUNT}/gpu-procs/{pid}-{gpu}.json",
             _json.dumps({"pid": pid, "process_name": name, "gpu_index": gpu, "used_mib": 30000}).encode())


def _alive(host, pid: int) -> bool:
    r = host.run(["ps", "-o", "stat=", "-p", str(pid)])
    return r.ok and r.stdout.strip() != "" and not r.stdout.strip().startswith("Z")


def test_only_our_processes_on_a_shared_systemd_host(clean_systemd_sim):
    """A second user's live process titled VLLM::Worker_TP0 on the model's GPUs is foreign: deploy
    and swap refuse at preflight (naming the user) and stop leaves it alive; the orphaned workers of a
    SIGKILLed server on the same GPUs are abandoned, and deploy kills them and starts."""
    from orchestrator.host.base import Script
    from orchestrator.host.connect import open_host
    from orchestrator.ops.stop import stop_model
    from orchestrator.sim import nspawn
    from tests.plugins.sim_hosts import make_model

    home, e = clean_systemd_sim          # this module shares its host: it serves nothing now
    old, new = on_port("minimax-m25", 8000), on_port("minimax-m25-ep", 8000)     # GPUs 0-3 / 0-7
    manifests = {old.name: old, new.name: new}
    with open_host(e) as host:
        alice = _start_as(host, "alice", "VLLM::Worker_TP0")
        _hold_gpu(host, alice, 2, "VLLM::Worker_TP0")
        try:
            refused = deploy(e, old)
            assert isinstance(refused.error, RefusedError) and refused.error.step == "preflight"
            pre = next(a for a in refused.plan.actions if a.step == "preflight")
            assert any("user alice" in d and "foreign" in d for d in pre.details), pre.details
            assert _alive(host, alice)
        finally:
            host.run(["kill", "-KILL", str(alice)])
            host.run(["rm", "-f", f"{nspawn.SIM_MOUNT}/gpu-procs/{alice}-2.json"])

        # deploy on free GPUs; then alice's job lands on GPU 7: swap (GPUs 0-7) refuses, stop leaves it
        assert deploy(e, old).ok
        alice = _start_as(host, "alice", "VLLM::Worker_TP0")
        _hold_gpu(host, alice, 7, "VLLM::Worker_TP0")
        try:
            refused = swap(e, new, manifests)
            assert isinstance(refused.error, RefusedError) and "alice" in "\n".join(
                next(a for a in refused.plan.actions if a.step == "preflight").details)
            assert host.run(["systemctl", "is-active", f"vllm-{old.name}.service"]).stdout.strip() == "active"
            res = stop_model(host, e, old.name, old.serving.visible_devices, release_timeout=20, poll=0.2)
            assert res.ok and _alive(host, alice), res
        finally:
            host.run(["kill", "-KILL", str(alice)])
            host.run(["rm", "-f", f"{nspawn.SIM_MOUNT}/gpu-procs/{alice}-7.json"])

        # a `vllm serve` started by hand (not by vllm-orch), its API server SIGKILLed: the workers stay
        hdir = manager.host_dir("sim", home)
        make_model(hdir, "by-hand", "MiniMaxAI/MiniMax-M2.5", total_size=230e9)
        r = host.run(Script(
            f"cd /tmp && CUDA_VISIBLE_DEVICES=0,1,2,3 VLLM_SIM_HOST_DIR={nspawn.SIM_MOUNT} setsid "
            f"{nspawn.SIM_MOUNT}/bin/vllm serve {nspawn.SIM_MOUNT}/models/by-hand --trust-remote-code "
            f"--max-model-len 65536 -tp 4 --port 8123 </dev/null >/tmp/by-hand.log 2>&1 & echo $!"))
        server = int(r.stdout.split()[-1])
        deadline = time.monotonic() + 60
        while "Application startup complete." not in (host.run(["cat", "/tmp/by-hand.log"]).stdout):
            assert time.monotonic() < deadline and _alive(host, server), host.run(["cat", "/tmp/by-hand.log"]).stdout
            time.sleep(0.3)
        workers = [int(x) for x in host.run(Script("pgrep -f '^VLLM::Worker'")).stdout.split()]
        assert len(workers) == 4
        host.run(["kill", "-KILL", str(server)])
        result = deploy(e, old)
        assert result.ok, result.error
        gpus = next(a for a in result.plan.actions if a.step == "gpus")
        assert gpus.summary.startswith("kill 4 leftover processes") and \
            all("API server is gone" in d for d in gpus.details), gpus.details
        assert not any(_alive(host, w) for w in workers)
        stop_model(host, e, old.name)
