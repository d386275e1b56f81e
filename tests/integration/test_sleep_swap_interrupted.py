"""A sleep swap cut short on the default SIMULATED host (the CLI killed mid-run, as
test_swap.py::test_an_interrupted_swap_converges cuts an ordinary swap): the host records the swap
as half done (state_dir/swap.json) before the step that starts the downtime, `status` says so with
the command that finishes it, `deploy` refuses, and the next `swap` converges: the sleeper stays
asleep, one service serves, the marker is gone."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from orchestrator.errors import RefusedError
from orchestrator.host.state import read_record
from orchestrator.ops.status import gather_status
from orchestrator.probe.api import Endpoint, health, is_sleeping
from orchestrator.sim import manager

from .deployhelp import cli_env, deploy, entry, kill_when, swap, write_models
from .test_sleep_swap import sleepy


@pytest.fixture
def pair(sim_host, tmp_path):
    """kimi-k25-int4 serving with sleep mode, kimi-k25-nvfp4 (sleep mode too) on another port, and
    the environment to run the CLI against them."""
    old, new = sleepy("kimi-k25-int4"), sleepy("kimi-k25-nvfp4")
    e = entry(sim_host)
    result = deploy(e, old)
    assert result.ok, result.error
    env = cli_env(sim_host, write_models(tmp_path / "models", [old, new]))
    return e, old, new, {old.name: old, new.name: new}, env


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def wait_for(what: str, check, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.1)


def half_swap(e) -> dict | None:
    (st,) = gather_status([e])
    return st.interrupted_swap


def sleeping(sim_host, m) -> bool | None:
    return is_sleeping(Endpoint(sim_host.host, m.serving.port))


@pytest.mark.parametrize("way", ["finish", "undo"])
def test_a_sleep_old_swap_cut_while_the_new_one_loads_converges(sim_host, pair, way):
    """Cut after the old service went to sleep, while the new one loads: nothing serves. The next
    swap to the new one finishes it (the old one stays asleep); to the old one undoes it (woken, the
    new one stopped)."""
    e, old, new, _, env = pair
    manager.add_fault("sim", "slow-start", model=new.name, home=sim_host.home)
    kill_when([sys.executable, "-m", "orchestrator.cli.main", "swap", new.name, "--host", "sim", "--sleep-old"],
              env, "ready:")
    assert sleeping(sim_host, old) is True
    half = half_swap(e)
    assert half is not None, "status must say the sleep swap is half done"
    assert (half["from"], half["to"]) == (old.name, new.name)
    assert f"{old.name} is asleep" in half["text"], half["text"]
    assert f"vllm-orch swap {new.name} --host sim" in half["hint"], half["hint"]
    refused = deploy(e, old)
    assert isinstance(refused.error, RefusedError) and refused.error.step == "swap", refused.error
    serving, other = (new, old) if way == "finish" else (old, new)
    again = cli(env, "swap", serving.name, "--host", "sim")      # no --sleep-old needed
    assert again.returncode == 0, again.stdout + again.stderr
    assert health(Endpoint(sim_host.host, serving.serving.port)) == 200
    assert sleeping(sim_host, serving) is False
    assert read_record(sim_host.host, e, serving.name).asleep is None
    if way == "finish":
        assert sleeping(sim_host, old) is True, "the old one stays asleep (not stopped)"
        assert read_record(sim_host.host, e, old.name).asleep is not None
    else:
        assert sleeping(sim_host, new) is None, "the new one, which never served, is stopped"
        assert read_record(sim_host.host, e, new.name) is None
    assert half_swap(e) is None and not (sim_host.dir / "state" / "swap.json").exists()


def test_a_wake_swap_cut_after_the_awake_one_sleeps_converges(sim_host, pair):
    """Swap back to a sleeping service, cut while the awake one goes to sleep: once that sleep
    ends, nothing serves (both asleep). The next swap to the sleeper wakes it."""
    e, old, new, manifests, env = pair
    assert swap(e, new, manifests, sleep_old=True).ok            # int4 asleep, nvfp4 serves
    cfg_path = sim_host.dir / "sim.json"
    cfg = json.loads(cfg_path.read_text())
    fast = cfg["speed"]
    cfg_path.write_text(json.dumps({**cfg, "speed": 0.25}))      # nvfp4's sleep takes seconds: the cut lands in it
    log = sim_host.dir / "logs" / f"vllm-{new.name}.log"
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.main", "swap", old.name, "--host", "sim",
                             "--sleep-old"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(f"{new.name}'s sleep starts", lambda: "Using sleep-mode backend" in (
            log.read_text(errors="replace") if log.exists() else ""))
    finally:
        proc.kill()
        proc.wait()
    cfg_path.write_text(json.dumps({**cfg, "speed": fast}))
    wait_for(f"{new.name} is asleep (the server ends the sleep it was asked for)",
             lambda: sleeping(sim_host, new) is True)
    assert sleeping(sim_host, old) is True, "nothing serves"
    half = half_swap(e)
    assert half is not None, "status must say the sleep swap is half done"
    assert (half["from"], half["to"]) == (new.name, old.name)
    assert f"vllm-orch swap {old.name} --host sim" in half["hint"], half["hint"]
    again = cli(env, "swap", old.name, "--host", "sim")          # finishes it: int4 wakes
    assert again.returncode == 0, again.stdout + again.stderr
    assert sleeping(sim_host, old) is False and health(Endpoint(sim_host.host, old.serving.port)) == 200
    assert sleeping(sim_host, new) is True, "the other one stays asleep (not stopped)"
    assert read_record(sim_host.host, e, old.name).asleep is None
    assert read_record(sim_host.host, e, new.name).asleep is not None, "recorded asleep (the cut run did not)"
    assert half_swap(e) is None and not (sim_host.dir / "state" / "swap.json").exists()
