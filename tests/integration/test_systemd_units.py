"""What the rendered units mean on a real systemd (a SIMULATED GPU host in a systemd-nspawn
container, reached over SSH): `active` only once the model serves, TimeoutStartSec bounding a stuck
start, a bounded crash loop with its root cause in status, the health timer restarting a hung
server, a graceful drain on stop, and a compile cache that outlives a restart.

Each test starts from a host with no vllm unit running (the module shares one container)."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime

import pytest

from orchestrator.host.connect import open_host
from orchestrator.host.state import read_history
from orchestrator.ops.status import host_status
from orchestrator.probe import api
from orchestrator.sim import manager
from tests.plugins.sim_hosts import fired

from .deployhelp import deploy, tuned

pytestmark = pytest.mark.systemd
PORT = 8000


EVICT = """import glob, os, sys
for path in glob.glob(os.path.join(sys.argv[1], "*.safetensors")):
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
"""


def show(host, unit: str) -> dict:
    r = host.run(["systemctl", "show", unit, "-p", "ActiveState,SubState,Result,NRestarts,MainPID"])
    return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)


def wait_for(predicate, budget: float, every: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + budget
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what} not met within {budget} s"
        time.sleep(every)
    return value


def host_dir(home):
    return manager.host_dir("sim", home)


@pytest.fixture
def sd(clean_systemd_sim):
    return clean_systemd_sim


def test_the_unit_is_activating_while_it_loads_and_active_once_it_serves(sd):
    home, e = sd
    m = tuned("minimax-m25", PORT)
    assert deploy(e, m).ok
    unit = m.unit_name
    manager.add_fault("sim", "slow-start", model=m.name, home=home, factor=25)   # a few seconds of loading
    with open_host(e) as host:
        # The deploy left the weights in the page cache, where the simulated vLLM loads them at RAM
        # speed (as a real one would): drop them, so this start reads from the simulated disk.
        host.run(["python3", "-c", EVICT, f"{e.models_root}/{m.name}"]).check(e.name)
        cursor = host.run(["journalctl", "-u", unit, "-n", "0", "--show-cursor", "-o", "cat"]).stdout
        host.run(["systemctl", "restart", "--no-block", unit]).check(e.name)
        samples = []

        def loaded():
            st = show(host, unit)
            answer = api.health(api.Endpoint(host, PORT), timeout=2)
            samples.append((st["ActiveState"], st["SubState"], answer))
            return st["ActiveState"] == "active" and samples[-1]
        wait_for(loaded, 120, every=0.3, what="the unit active")
        begun = next(i for i, s in enumerate(samples) if s[0] == "activating")     # (the stop came first)
        loading = [s for s in samples[begun:] if s[2] is None]
        # `start` is systemd's moment between the exec and ExecStartPost; never `active` while loading
        assert len(loading) >= 3 and all(s[:2] in (("activating", "start"), ("activating", "start-post"))
                                         for s in loading), samples
        assert samples[-1] == ("active", "running", 200)
        during = host_status(e, lambda _m: PORT)               # status agrees with the unit
        assert during.state == "ready" and during.unit_state == "active (running)", during
        after = cursor.split("-- cursor: ")[-1].strip()
        journal = host.run(["journalctl", "-u", unit, f"--after-cursor={after}", "-o", "cat"]).stdout
    assert "vllm-orch probe: ready after" in journal
    # the restart found the compile cache the first start wrote, where the unit keeps it
    assert "Using cache directory: /var/cache/vllm-orch/vllm/torch_compile_cache/" in journal
    assert "Directly load the compiled graph(s)" in journal


def start_until_failed(e, home, startup: dict, fault: str, **extra) -> tuple[object, dict, float]:
    """Deploy minimax-m25 with these startup fields, stop it, arm `fault` and start the unit the
    way systemd would at boot (no vllm-orch watching): (manifest, unit state once failed, seconds)."""
    m = tuned("minimax-m25", PORT, startup=startup)
    assert deploy(e, m).ok
    with open_host(e) as host:
        host.run(["systemctl", "stop", m.unit_name]).check(e.name)
        manager.add_fault("sim", fault, model=m.name, home=home, **extra)
        t0 = time.monotonic()
        host.run(["systemctl", "start", "--no-block", m.unit_name]).check(e.name)
        assert show(host, m.unit_name)["ActiveState"] == "activating"
        st = wait_for(lambda: (s := show(host, m.unit_name))["ActiveState"] == "failed" and s, 120,
                      what=f"the unit to fail ({fault})")
        took = time.monotonic() - t0
        time.sleep(3)                                  # RestartSec is 1 s: nothing starts it again
        assert show(host, m.unit_name)["ActiveState"] == "failed"
    return m, st, took


def test_timeout_start_sec_bounds_a_start_that_hangs(sd):
    home, e = sd
    _m, st, took = start_until_failed(e, home, {"budget_seconds": 10, "start_attempts": 1, "restart_delay_seconds": 1},
                                      "hang")
    assert st["Result"] == "timeout" and 10 <= took < 40, (st, took)
    assert len(fired(host_dir(home), "hang")) == 1             # one attempt: the restart was refused
    assert not [f for f in (host_dir(home) / "gpu-procs").glob("*.json")
                if manager.alive(json.loads(f.read_text())["pid"], None)], "the stop freed the GPUs"


def test_a_failure_late_in_every_load_is_retried_a_bounded_number_of_times(sd):
    home, e = sd
    m, st, _took = start_until_failed(e, home, {"budget_seconds": 20, "start_attempts": 2,
                                                "restart_delay_seconds": 1}, "crash-no-kv-memory", times=5)
    assert len(fired(host_dir(home), "crash-no-kv-memory")) == 2, st      # 2 attempts, then failed
    status = host_status(e, lambda _m: PORT)
    assert status.state == "failed" and status.active_model == m.name
    assert "2 starts failed in a row, then the start limit" in status.state_reason, status.state_reason
    assert f"`vllm-orch logs {m.name} --host {e.name}` shows why" in status.state_reason
    assert "No available memory for the cache blocks" in (status.root_cause or ""), status


def test_the_health_timer_restarts_a_server_that_hangs_after_deploy(sd):
    home, e = sd
    m = tuned("minimax-m25", PORT, probes={"health_interval_seconds": 2, "health_failures": 2,
                                           "health_timeout_seconds": 2})
    manager.add_fault("sim", "hang-after-ready", model=m.name, home=home, after=20)
    assert deploy(e, m).ok                              # serves for 20 s, then hangs
    with open_host(e) as host:
        pid = show(host, m.unit_name)["MainPID"]
        restart = wait_for(lambda: [r for r in read_history(host, e) if r.operation == "health-restart"],
                           150, every=1, what="a health-restart record")[-1].shown()
        wait_for(lambda: (s := show(host, m.unit_name))["ActiveState"] == "active" and s["MainPID"] != pid,
                 120, what="the restarted service to serve")
    hung_at = fired(host_dir(home), "hang-after-ready")[-1]["at"]
    latency = datetime.fromisoformat(restart["at"]).timestamp() - hung_at
    print(f"health timer: hang -> restart recorded in {latency:.1f} s (interval 2 s, 2 failures, timeout 2 s)")
    assert restart["model"] == m.name and restart["ok"] and "did not answer within 2s" in restart["reason"]
    assert 0 < latency < 60
    # systemd calls a Type=exec unit active long before it serves: wait for status to say ready
    status = wait_for(lambda: (st := host_status(e, lambda _m: PORT)).state == "ready" and st, 120,
                      what="status to see the restarted service ready")
    assert status.last_health_restart and status.last_health_restart["reason"] == restart["reason"]


def test_stop_drains_the_requests_in_flight(sd):
    home, e = sd
    m = tuned("minimax-m25", PORT)
    assert deploy(e, m).ok
    got: dict = {}
    with open_host(e) as host:
        ep = api.Endpoint(host, PORT)
        body = {"model": m.served_name, "prompt": "Count slowly", "max_tokens": 400, "ignore_eos": True,
                "stream": True}

        def client():
            with ep.stream("POST", "/v1/completions", json=body, timeout=60) as s:
                events = [line for _, line in s.lines() if line.startswith("data:")]
            got["events"] = events
        reader = threading.Thread(target=client)
        reader.start()
        time.sleep(1.0)                                  # the request is being generated
        t0 = time.monotonic()
        host.run(["systemctl", "stop", m.unit_name], timeout=300).check(e.name)
        stop_s = time.monotonic() - t0
        reader.join(60)
        journal = host.run(["journalctl", "-u", m.unit_name, "-n", "60", "-o", "cat"]).stdout
    events = got["events"]
    assert events[-1] == "data: [DONE]"
    finish = [json.loads(ev[5:])["choices"][0]["finish_reason"] for ev in events[:-1]
              if json.loads(ev[5:]).get("choices")]
    assert finish[-1] == "length" and len(finish) == 400, finish[-3:]      # every token arrived
    assert "[shutdown] EngineCore: draining in-flight requests count=1 timeout=30s" in journal
    assert stop_s < 30, stop_s


def test_after_a_swap_and_a_reboot_the_swapped_in_model_comes_back(sd, tmp_path):
    """deploy --enable, swap, reboot: the new model starts at boot and the old one does not; stop
    and gc take the start at boot away from what they make inactive."""
    import os
    import subprocess
    import sys

    from orchestrator.host.state import read_active

    from .deployhelp import swap, write_models

    home, e = sd
    a, b = tuned("minimax-m25", PORT), tuned("minimax-m25-ep", PORT)
    assert deploy(e, a, enable=True).ok
    assert swap(e, b, {a.name: a, b.name: b}).ok
    with open_host(e) as host:
        enabled = {m.name: host.run(["systemctl", "is-enabled", m.unit_name]).stdout.strip() for m in (a, b)}
        assert enabled == {a.name: "disabled", b.name: "enabled"}
        assert read_active(host, e).model == b.name and read_active(host, e).enabled is True
    manager.reboot("sim", home)
    with open_host(e) as host:
        wait_for(lambda: show(host, b.unit_name)["ActiveState"] == "active", 120, what=f"{b.name} after the reboot")
        assert show(host, a.unit_name)["ActiveState"] == "inactive"
    status = host_status(e, lambda _m: PORT)
    assert status.active_model == b.name and status.state == "ready" and status.enabled is True

    models = write_models(tmp_path / "models", [a, b])
    env = dict(os.environ, VLLM_ORCH_STATE_HOME=str(home.parent), VLLM_ORCH_MODELS=str(models))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], env=env, capture_output=True,
                              text=True, timeout=300)
    stopped = cli("stop", b.name, "--host", "sim")
    assert stopped.returncode == 0 and "disable vllm-minimax-m25-ep.service at boot" in stopped.stdout
    with open_host(e) as host:
        assert host.run(["systemctl", "is-enabled", b.unit_name]).stdout.strip() == "disabled"
        host.run(["systemctl", "enable", a.unit_name]).check(e.name)          # enabled by hand, then ...
    collected = cli("gc", "--host", "sim", "--yes")                            # ... its weights deleted
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert f"disabled {a.unit_name} at boot" in collected.stdout
    with open_host(e) as host:
        assert host.run(["systemctl", "is-enabled", a.unit_name]).stdout.strip() == "disabled"
