"""A sleeping service is never started or restarted awake beside the awake one on its GPUs (the
default SIMULATED host, 8 GPUs): `deploy` of it refuses (exit 3) naming the awake service and the
swap that wakes it; `regen --restart` installs its new files but leaves it asleep and says so."""

from __future__ import annotations

from orchestrator.config.manifest import Manifest
from orchestrator.errors import RefusedError
from orchestrator.host.state import read_record
from orchestrator.ops.execute import Reporter
from orchestrator.ops.regen import run_regen
from orchestrator.probe.api import Endpoint, health, is_sleeping

from .deployhelp import deploy, entry, opts, swap
from .test_sleep_swap import main_pid, sleepy


def test_deploy_and_regen_restart_leave_a_sleeping_service_asleep(sim_host):
    old, new = sleepy("kimi-k25-int4"), sleepy("kimi-k25-nvfp4")
    e = entry(sim_host)
    assert deploy(e, old).ok
    assert swap(e, new, {old.name: old, new.name: new}, sleep_old=True).ok     # int4 asleep, nvfp4 serves
    pid = main_pid(sim_host, e, old.name)
    data = old.model_dump()
    data["vllm"]["max_num_seqs"] = 7                 # new files: deploy and regen would restart it
    changed = Manifest.model_validate(data)
    same = deploy(e, old)                            # deployed with these files: nothing to do
    assert same.ok and same.extra["history"]["noop"], same.error
    assert "is asleep" in same.plan.actions[-1].summary
    refused = deploy(e, changed)
    assert isinstance(refused.error, RefusedError), refused.error
    assert new.name in refused.error.message and "asleep" in refused.error.message, refused.error.message
    assert f"vllm-orch swap {old.name} --host sim" in (refused.error.hint or ""), refused.error.hint
    regen = run_regen(e, {old.name: changed, new.name: new}, opts(), Reporter(None, quiet=True), dry_run=False,
                      restart=True)
    assert regen.ok, regen.error
    assert old.name in regen.extra["changed"] and old.name not in regen.plan.info["restarts"]
    assert any(old.name in w and "asleep" in w for w in regen.plan.warnings), regen.plan.warnings
    assert is_sleeping(Endpoint(sim_host.host, old.serving.port)) is True
    assert main_pid(sim_host, e, old.name) == pid, "the sleeper was restarted"
    assert read_record(sim_host.host, e, old.name).asleep is not None
    assert health(Endpoint(sim_host.host, new.serving.port)) == 200
    assert is_sleeping(Endpoint(sim_host.host, new.serving.port)) is False


def test_deploy_of_a_sleeper_alone_on_its_gpus_refuses_and_leaves_it_asleep(sim_host):
    """Nothing awake beside it: a deploy with new files would restart it awake (it would no longer
    sleep, and its record would say so wrongly); it refuses and names the swap that wakes it."""
    from orchestrator.ops.stop import stop_model

    old, new = sleepy("kimi-k25-int4"), sleepy("kimi-k25-nvfp4")
    e = entry(sim_host)
    assert deploy(e, old).ok
    assert swap(e, new, {old.name: old, new.name: new}, sleep_old=True).ok
    stop_model(sim_host.host, e, new.name)
    pid = main_pid(sim_host, e, old.name)
    data = old.model_dump()
    data["vllm"]["max_num_seqs"] = 7                 # new files: a deploy would restart it awake
    refused = deploy(e, Manifest.model_validate(data), no_progress_s=5, budget_s=20)
    assert isinstance(refused.error, RefusedError) and "asleep" in refused.error.message, refused.error
    assert f"vllm-orch swap {old.name} --host sim" in (refused.error.hint or "")
    assert is_sleeping(Endpoint(sim_host.host, old.serving.port)) is True
    assert main_pid(sim_host, e, old.name) == pid


def test_the_first_wake_after_a_regen_restart_checks_the_canary_recorded_by_that_restart(sim_host):
    # `sleep:` added to a deployed manifest and applied with `regen --restart`: the restart's ready
    # answer was never recorded as the canary, so the first wake said "canary recorded" and checked
    # nothing (a corrupted wake would have served junk).
    from orchestrator.host.state import read_history

    plain, new = sleepy("kimi-k25-int4"), sleepy("kimi-k25-nvfp4")
    data = plain.model_dump()
    data["sleep"] = None
    plain = Manifest.model_validate(data)
    e = entry(sim_host)
    assert deploy(e, plain).ok
    assert read_record(sim_host.host, e, plain.name).canary is None       # no sleep mode: no canary
    old = sleepy("kimi-k25-int4")
    old = Manifest.model_validate({**old.model_dump(), "serving": plain.model_dump()["serving"]})
    manifests = {old.name: old, new.name: new}
    regen = run_regen(e, manifests, opts(), Reporter(None, quiet=True), dry_run=False, restart=True)
    assert regen.ok and old.name in regen.plan.info["restarts"], regen.error
    assert read_record(sim_host.host, e, old.name).canary is not None, "the restart's answer is its canary"
    assert swap(e, new, manifests, sleep_old=True).ok                          # int4 asleep
    assert swap(e, old, manifests, sleep_old=True).ok                          # int4 wakes
    woke = read_history(sim_host.host, e)[-1].shown()["sleep"]["woke"][old.name]
    assert woke["canary"] == "match", woke
