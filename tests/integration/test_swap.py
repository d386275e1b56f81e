"""swap and regen on the default SIMULATED host: staged swaps with measured downtime, rollback
after each kind of failure (previous model serving, nothing deleted), unstageable disk, regen."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from orchestrator.errors import RefusedError
from orchestrator.host.state import read_active, read_history
from orchestrator.ops.execute import Reporter
from orchestrator.ops.regen import run_regen
from orchestrator.paths import shipped_dir
from orchestrator.probe.api import Endpoint, health
from orchestrator.probe.readiness import NotReady
from orchestrator.sim import manager

from .deployhelp import cli_env, deploy, entry, free_port, kill_when, on_port, opts, swap, write_models


@pytest.fixture
def pair(sim_host):
    """kimi-k25-int4 serving, kimi-k25-nvfp4 ready to swap in, on one free port."""
    port = free_port()
    old, new = on_port("kimi-k25-int4", port), on_port("kimi-k25-nvfp4", port)
    e = entry(sim_host)
    assert deploy(e, old).ok
    return e, old, new, {old.name: old, new.name: new}


def test_staged_swap_measures_downtime(sim_host, pair):
    e, old, new, manifests = pair
    result = swap(e, new, manifests)
    assert result.ok, result.error
    steps = [a.step for a in result.plan.actions]
    assert steps.index("download") < steps.index("stop"), "the download must happen while the old model serves"
    assert result.extra["staged"] is True
    downtime, load = result.extra["downtime_s"], result.extra["load_s"]
    assert load <= downtime, (downtime, load)
    # What the downtime window holds (the stop to the new model ready): no download, no warm-up.
    # How much longer than the load it is (0.2 s on a quiet machine) is benchmarks/bench_deploy_swap.py's.
    done = [r.step for r in result.outcome.results if r.status == "done"]
    window = done[done.index("stop"):done.index("ready") + 1]
    assert "start" in window and not {"download", "warm"} & set(window), window
    assert read_active(sim_host.host, e).model == new.name
    assert read_history(sim_host.host, e)[-1].shown()["operation"] == "swap"
    assert (sim_host.dir / "models" / old.name).is_dir(), "the previous model's files must stay"


def test_a_simulated_hosts_expected_downtime_is_at_its_speed_and_says_the_fields(sim_host, pair):
    # The plan said "expected downtime: 7m00s" for a swap the simulator made in 3 s, and history
    # "~28m55s less than expected": the manifest's field rates, not the host's speed.
    from orchestrator.sim.manager import inventory_hosts
    from tests.plugins.sim_hosts import TEST_SPEED

    e, old, new, manifests = pair
    assert e.time_scale == TEST_SPEED == inventory_hosts(sim_host.home)["sim"]["time_scale"]
    result = swap(e, new, manifests)
    assert result.ok, result.error
    expect = result.plan.info["expected_downtime_s"]
    (warm,) = [a for a in result.plan.actions if a.step == "warm"]
    assert f"this host loads {TEST_SPEED:g}x faster" in warm.summary and "SIMULATED" in warm.summary, warm.summary
    field = result.plan.info["expected_downtime_s"]["cold_s"] * TEST_SPEED
    assert field > 300 and expect["cold_s"] < 10, expect     # Kimi-K2.5's ~36 min at the field's rates


def test_swap_to_the_active_healthy_model_does_nothing(sim_host, pair):
    e, old, _new, manifests = pair
    result = swap(e, old, manifests)
    assert result.ok and [a.summary for a in result.plan.actions][0].startswith("nothing to do")


@pytest.mark.parametrize("fault,kinds,cause", [
    ("crash-gpu-memory", ("fatal-log", "crash"), "Free memory on device"),
    ("crash-unrecognized-args", ("fatal-log", "crash"), "unrecognized arguments"),
    ("crash-trust-remote-code", ("fatal-log", "crash"), "contains custom code"),
    ("hang", ("hang",), None),
    ("garbage", ("smoke",), None),
])
def test_failed_swap_rolls_back_to_the_previous_model(sim_host, pair, fault, kinds, cause):
    e, old, new, manifests = pair
    before = sorted(p.name for p in (sim_host.dir / "models" / old.name).rglob("*"))
    manager.add_fault("sim", fault, model=new.name, home=sim_host.home)
    result = swap(e, new, manifests, no_progress_s=5)
    assert not result.ok and isinstance(result.error, NotReady) and result.error.kind in kinds
    if cause:
        assert cause in result.error.root_cause
    assert result.extra["rollback"]["ok"], result.extra["rollback"]
    assert any("serves again" in d for d in result.error.details)
    assert health(Endpoint(sim_host.host, old.serving.port)) == 200
    assert read_active(sim_host.host, e).model == old.name
    assert sorted(p.name for p in (sim_host.dir / "models" / old.name).rglob("*")) == before
    ops = [h.operation for h in read_history(sim_host.host, e)[-2:]]
    assert ops == ["swap", "rollback"]


def test_swap_when_the_disk_cannot_stage_both(sim_host, pair):
    e, old, new, manifests = pair
    tight = entry(sim_host, models_disk_budget_gib=0.06)      # room for one Kimi only
    refused = swap(tight, new, manifests)
    assert isinstance(refused.error, RefusedError) and refused.error.step == "disk"
    assert "cannot stage" in refused.plan.text() and "min of downtime" in refused.plan.text()
    assert refused.error.hint.startswith("pass --yes")
    assert health(Endpoint(sim_host.host, old.serving.port)) == 200, "a refused swap must not stop the old model"
    accepted = swap(tight, new, manifests, yes=True)
    assert accepted.ok, accepted.error
    assert accepted.extra["staged"] is False
    steps = [a.step for a in accepted.plan.actions]
    assert steps[:2] == ["lock", "preflight"]
    assert steps.index("stop") < steps.index("download")


def test_an_interrupted_swap_converges(sim_host, pair, tmp_path):
    e, old, new, _ = pair
    models = write_models(tmp_path / "models", [old, new])
    env = cli_env(sim_host, models)
    cmd = [sys.executable, "-m", "orchestrator.cli.main", "swap", new.name, "--host", "sim"]
    manager.add_fault("sim", "slow-start", model=new.name, home=sim_host.home)
    kill_when(cmd, env, "ready:")                      # killed while it waits for readiness
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr
    assert read_active(sim_host.host, e).model == new.name
    assert health(Endpoint(sim_host.host, new.serving.port)) == 200


def test_regen_without_and_with_a_template_change(sim_host, tmp_path, monkeypatch):
    e, m = entry(sim_host), on_port("minimax-m25")
    assert deploy(e, m).ok
    manifests = {m.name: m}
    quiet = Reporter(None, quiet=True)
    same = run_regen(e, manifests, opts(), quiet, dry_run=False, restart=False)
    assert same.ok and same.extra["changed"] == []
    templates = tmp_path / "templates"
    shutil.copytree(shipped_dir("templates"), templates)
    script = templates / "vllm-process.sh.j2"
    script.write_text(script.read_text().replace("set -- ", "# local tuning\nset -- "))
    monkeypatch.setenv("VLLM_ORCH_TEMPLATES", str(templates))
    preview = run_regen(e, manifests, opts(), quiet, dry_run=True, restart=False)
    text = preview.plan.text()
    assert "+# local tuning" in text and "--- " in text and "+++ " in text
    pid_before = (sim_host.dir / "state" / "run" / f"vllm-{m.name}.pid").read_text()
    changed = run_regen(e, manifests, opts(), quiet, dry_run=False, restart=False)
    assert changed.ok and changed.extra["changed"] == [m.name]
    assert "# local tuning" in (sim_host.dir / "units" / f"vllm-{m.name}.sh").read_text()
    assert (sim_host.dir / "state" / "run" / f"vllm-{m.name}.pid").read_text() == pid_before
    script.write_text(script.read_text().replace("# local tuning\n", "# local tuning 2\n"))
    before = read_active(sim_host.host, e)
    restarted = run_regen(e, manifests, opts(), quiet, dry_run=False, restart=True)
    assert restarted.ok, restarted.error
    after = read_active(sim_host.host, e)          # how it runs changed, not which weights it serves
    assert (after.revision, after.deployed_at) == (before.revision, before.deployed_at)
    assert after.unit_hash != before.unit_hash
    assert (sim_host.dir / "state" / "run" / f"vllm-{m.name}.pid").read_text() != pid_before
    assert health(Endpoint(sim_host.host, m.serving.port)) == 200


def test_unstaged_swap_is_refused_when_even_deleting_the_old_model_is_not_enough(sim_host, pair):
    e, old, new, manifests = pair
    hopeless = entry(sim_host, models_disk_budget_gib=0.01)
    refused = swap(hopeless, new, manifests, yes=True)
    assert isinstance(refused.error, RefusedError) and "even after deleting" in str(refused.error)
    assert health(Endpoint(sim_host.host, old.serving.port)) == 200
    assert (sim_host.dir / "models" / old.name).is_dir()


def test_a_fault_for_one_of_two_services_with_the_same_command_line_fires_on_that_one(sim_host):
    """Three manifests of one checkpoint, served name and port (as kimi-k25-int4 and its dcp8 variant):
    after a swap there and back two installed services have the same command line; the
    simulated vLLM tells them apart by the log its start script writes to (it took the first that
    matched, so a fault armed for minimax-m25-bad went unfired: issue 41's gateway benchmark)."""
    from orchestrator.config.manifest import Manifest

    e = entry(sim_host)
    base = on_port("minimax-m25")

    def named(name: str) -> Manifest:
        data = base.model_dump()
        data.update(name=name)
        return Manifest.model_validate(data)

    a, b, bad = base, named("minimax-m25-b"), named("minimax-m25-bad")
    manifests = {x.name: x for x in (a, b, bad)}
    assert deploy(e, a).ok
    assert swap(e, b, manifests).ok and swap(e, a, manifests).ok         # b's installed unit stays
    manager.add_fault("sim", "crash-gpu-memory", model=bad.name, home=sim_host.home)
    result = swap(e, bad, manifests)
    assert not result.ok and isinstance(result.error, NotReady) and "Free memory on device" in result.error.root_cause
    assert result.extra["rollback"]["ok"], result.extra["rollback"]
    assert read_active(sim_host.host, e).model == a.name
