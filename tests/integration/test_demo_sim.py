"""`./dev demo` (orchestrator/sim/demo.py) on a SIMULATED host: it never destroys what a user made.

It used to begin with a silent `sim down`: a second run killed the services, removed a second
simulated host and deleted the downloaded models and records."""

from __future__ import annotations

import os
import subprocess
import sys

from orchestrator.sim import manager
from tests.plugins.sim_hosts import TEST_SPEED


def demo(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.sim.demo", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def snapshot(home) -> dict:
    st = manager.status(home)["hosts"]
    return {name: ({k: p["pid"] for k, p in h["processes"].items() if p["alive"]},
                   sorted((s["pid"], s["model"]) for s in h["vllm_servers"])) for name, h in st.items()}


def test_a_second_demo_keeps_the_hosts_services_and_models_and_a_busy_host_is_left_alone(tmp_path):
    env = dict(os.environ, VLLM_ORCH_STATE_HOME=str(tmp_path / "state"), NO_COLOR="1")
    os.environ["VLLM_ORCH_STATE_HOME"] = env["VLLM_ORCH_STATE_HOME"]
    try:
        home = manager.sim_home()
        manager.up(2, speed=TEST_SPEED, home=home)      # the user's own second host, `sim-2`
        first = demo(env)
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
        before = snapshot(home)
        assert [m.rsplit("/", 1)[-1] for _, m in before["sim"][1]] == ["kimi-k25-int4"] and before["sim-2"][0]
        models = sorted(p.name for p in (manager.host_dir("sim", home) / "models").iterdir())
        assert models

        again = demo(env)
        assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
        assert "sim down" not in again.stdout.split("Next:")[0]
        assert snapshot(home) == before                  # same processes: nothing stopped or restarted
        assert sorted(p.name for p in (manager.host_dir("sim", home) / "models").iterdir()) == models

        other = demo(dict(env, VLLM_ORCH_DEMO_MODEL="kimi-k25-nvfp4"))
        assert other.returncode == 3, other.stdout[-2000:] + other.stderr[-2000:]
        assert "already serves kimi-k25-int4 (port 8000, ready)" in other.stderr and "nothing changed" in other.stderr
        assert snapshot(home) == before
    finally:
        manager.down(manager.sim_home())
        os.environ.pop("VLLM_ORCH_STATE_HOME", None)


def test_demo_help_explains_and_starts_nothing(tmp_path):
    env = dict(os.environ, VLLM_ORCH_STATE_HOME=str(tmp_path / "state"))
    out = demo(env, "--help")
    assert out.returncode == 0, out.stderr
    assert "VLLM_ORCH_DEMO_MODEL" in out.stdout and "exit codes" in out.stdout and "sim down" in out.stdout
    assert not (tmp_path / "state").exists()
