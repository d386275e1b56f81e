"""The planners are pure: (manifest, host entry, facts, options) -> Plan, with no host at all.

Facts here are made by hand (a fresh 8-GPU systemd host, one with a model serving, one short of
disk, one with leftovers and a stranger); the plans are pinned by golden files, recovery branches
included, so a dry run's text is reviewed whenever a planner changes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.config.effective import effective
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import load_all
from orchestrator.host.facts import HostFacts, Memory, ModelDir
from orchestrator.host.nvidia_smi import Gpu
from orchestrator.host.ownership import FOREIGN, LEFT, SERVICE, Proc
from orchestrator.host.records import InstalledRecord, ServiceRecord, SwapMarker
from orchestrator.host.services import ServiceState
from orchestrator.paths import shipped_dir
from orchestrator.plan.deploy import plan_deploy
from orchestrator.plan.inputs import DownloadPlan, LockFacts, PlanInput, RegenInput, ServiceInput, WarmFacts
from orchestrator.plan.preflight import OK, Check
from orchestrator.plan.regen import plan_regen
from orchestrator.plan.run import Options
from orchestrator.plan.swap import old_model_name, plan_swap
from orchestrator.render.artifacts import render

GOLDEN = Path(__file__).parents[1] / "golden" / "plans"
MODELS, _ = load_all(shipped_dir("models"))
ENTRY = HostEntry(name="gpu1", address="gpu1.example", sudo=True)
GIB = 1024 ** 3
RTX = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
CHECKS = [Check("flags", OK, "vLLM 0.33.0 parser accepts the command line"),
          Check("gpus", OK, f"8x {RTX}, 97887 MiB each (8 needed)")]


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1" or not path.exists():
        path.write_text(text + "\n")
    assert text + "\n" == path.read_text(), f"plan text changed: review and re-run with UPDATE_GOLDEN=1 ({path})"


VLLM_USER = {"vllm": {"uid": 998, "gid": 998, "home": "/var/lib/vllm-orch/home"}}
RAM = Memory(total=1536 * GIB, available=1100 * 10 ** 9)        # a typical 8-GPU server, one model serving


def facts(services=None, active=None, models=None, procs=(), disk_free=2000 * GIB, installed=None,
          users=None, memory=RAM) -> HostFacts:
    """Facts of an 8-GPU host; `active` (a legacy active.json) and `installed` as the JSON of the records."""
    gpus = [Gpu(index=i, name=RTX, memory_total_mib=97887, memory_used_mib=0, uuid=f"GPU-{i}") for i in range(8)]
    return HostFacts(hostname="gpu1", disk_path="/var/lib/vllm-orch/models", disk_total=4000 * GIB,
                     disk_free=disk_free, gpus=gpus, gpu_error=None, driver_version="580.95.05",
                     cuda_version="13.0", procs=list(procs), vllm_version="0.33.0", vllm_error=None,
                     models=models or {}, active=ServiceRecord(**active) if active is not None else None,
                     installed={n: InstalledRecord(**r) for n, r in (installed or {}).items()},
                     services=services or {}, usage={}, users=VLLM_USER if users is None else users, memory=memory)


def records(**by_name: dict) -> dict[str, ServiceRecord]:
    """services/NAME.json records from their JSON (a name with - as a keyword: pass a dict)."""
    return {n: ServiceRecord(**r) for n, r in by_name.items()}


def weights(name: str, shards: int, total: int, cached: int = 0) -> WarmFacts:
    """A model folder as the warm survey reports it: equal shards, the first `cached` bytes cached."""
    size = total // shards
    files, left = [], cached
    for i in range(1, shards + 1):
        files.append((f"model-{i:05d}-of-{shards:06d}.safetensors", size, min(size, left)))
        left -= min(size, left)
    return WarmFacts(f"/var/lib/vllm-orch/models/{name}", tuple(files))


def svc(name: str, *, installed: bool = False, serving: bool = False) -> ServiceInput:
    """A model's service as gather makes it on these RTX PRO 6000 facts (its hardware class applied)."""
    eff = effective(MODELS[name], ENTRY, {i: RTX for i in range(8)})
    r = render(eff.manifest, ENTRY, {})
    files = {f.path: (f.data() if installed else None) for f in r.files}
    return ServiceInput(manifest=eff.manifest, rendered=r, installed_files=files, serving=serving, effective=eff)


def running(*names: str) -> dict[str, ServiceState]:
    return {n: ServiceState(active=True, main_pid=1000 + i) for i, n in enumerate(names)}


def download(to_fetch: int, total: int | None = None) -> DownloadPlan:
    total = total if total is not None else to_fetch
    return DownloadPlan(total_bytes=total, have_bytes=total - to_fetch, to_fetch_bytes=to_fetch, files=86,
                        to_fetch=tuple(f"model-{i:05d}.safetensors" for i in range(64 if to_fetch else 0)),
                        commit="a" * 40)


def inp(target: ServiceInput, f: HostFacts, dl: DownloadPlan | None, old: ServiceInput | None = None,
        survey: WarmFacts | None = None, **opts) -> PlanInput:
    lock = LockFacts(held=False, path="/var/lib/vllm-orch/state/lock/deploy.lock")
    return PlanInput(entry=ENTRY, facts=f, opts=Options(**opts), lock=lock, target=target, download=dl,
                     preflight=CHECKS, old=old, warm=survey)


def test_deploy_on_a_fresh_host_and_its_recovery():
    plan = plan_deploy(inp(svc("kimi-k25-int4"), facts(users={}), download(547 * 10 ** 9)))
    assert plan.refusal is None and [a.step for a in plan.actions] == \
        ["lock", "preflight", "disk", "download", "gpus", "user", "install", "start", "ready", "perf", "record"]
    assert plan.recovery_for(8).actions[0].step == "stop" and plan.recovery_for(4) is None
    golden("plan-deploy-fresh-systemd.txt", plan.text())


def test_deploy_kills_leftovers_and_refuses_a_stranger_unless_kill_foreign():
    procs = [Proc(pid=4242, name="VLLM::Worker_TP0", used_mib=90000, gpu_index=0, kind=LEFT, model="old", start_time=424200),
             Proc(pid=5151, name="python3 train.py", used_mib=4000, gpu_index=3, kind=FOREIGN, start_time=515100)]
    plan = plan_deploy(inp(svc("kimi-k25-int4"), facts(procs=procs), download(1)))
    assert plan.refusal is not None and plan.refusal.step == "gpus" and "5151" in str(plan.refusal)
    plan = plan_deploy(inp(svc("kimi-k25-int4"), facts(procs=procs), download(1), kill_foreign=True))
    gpus = next(a for a in plan.actions if a.step == "gpus")
    assert plan.refusal is None and "kill 2 leftover processes" in gpus.summary


def test_deploy_of_a_serving_unchanged_model_is_all_noops():
    name = "kimi-k25-int4"
    t = svc(name, installed=True, serving=True)
    f = facts(services=running(name), active={"model": name, "unit_hash": t.rendered.unit_hash, "gpus": list(range(8))})
    plan = plan_deploy(inp(t, f, download(0, 547 * 10 ** 9)))
    assert not plan.changes and not plan.recoveries
    assert all(a.noop for a in plan.actions if a.step not in ("lock",))


def test_staged_swap_carries_its_rollback_branch():
    old, new = "kimi-k25-int4", "kimi-k25-nvfp4"
    f = facts(services=running(old), active={"model": old, "gpus": list(range(8))},
              models={old: ModelDir(old, 547 * 10 ** 9, {"repo": "moonshotai/Kimi-K2.5", "files": {}}, 1.0)})
    assert old_model_name(f, new) == old
    plan = plan_swap(inp(svc(new), f, download(593 * 10 ** 9), old=svc(old, installed=True),
                         survey=weights(new, 119, 540 * 10 ** 9), warm=True))
    steps = [a.step for a in plan.actions]
    assert steps == ["lock", "preflight", "disk", "download", "user", "install", "warm", "stop", "gpus", "start", "ready",
                     "perf", "boot",
                     "record"]
    rb = plan.recovery_for(steps.index("ready") + 1)
    assert rb is not None and rb.first == steps.index("stop") + 1 and rb.title == f"roll back to {old}"
    assert [a.step for a in rb.actions] == ["stop", "gpus", "start", "ready", "record"]
    assert "swap.json" in rb.actions[-1].summary                          # the rollback ends the swap
    assert "swap.json" in plan.actions[steps.index("stop")].details[0]   # ... which the stop began
    assert plan.recovery_for(steps.index("download") + 1) is None     # the old model still serves then
    assert plan.recovery_for(steps.index("warm") + 1) is None         # ... and during the warm-up
    assert {k: plan.info[k] for k in ("from", "to", "staged")} == {"from": old, "to": new, "staged": True}
    expected = plan.info["expected_downtime_s"]
    assert expected["warm_s"] < 0.3 * expected["cold_s"]
    golden("plan-swap-staged.txt", plan.text())


def test_swap_that_cannot_stage_is_refused_then_unstaged_with_yes():
    old, new = "kimi-k25-int4", "kimi-k25-nvfp4"
    f = facts(services=running(old), active={"model": old, "gpus": list(range(8))}, disk_free=500 * GIB,
              models={old: ModelDir(old, 547 * 10 ** 9, {"repo": "moonshotai/Kimi-K2.5", "files": {}}, 1.0)})
    refused = plan_swap(inp(svc(new), f, download(593 * 10 ** 9), old=svc(old, installed=True)))
    assert refused.refusal is not None and "--yes" in refused.refusal.hint
    plan = plan_swap(inp(svc(new), f, download(593 * 10 ** 9), old=svc(old, installed=True), yes=True))
    assert plan.refusal is None and plan.info["staged"] is False
    assert [a.step for a in plan.actions][2:5] == ["stop", "disk", "download"]
    assert "no rollback" in plan.recoveries[0].title
    golden("plan-swap-unstaged.txt", plan.text())


def test_swap_to_the_active_healthy_model_is_nothing_to_do():
    name = "minimax-m25"
    t = svc(name, installed=True, serving=True)
    f = facts(services=running(name), active={"model": name, "unit_hash": t.rendered.unit_hash})
    assert old_model_name(f, name) == name
    plan = plan_swap(inp(t, f, None))
    assert not plan.changes and plan.info.get("noop") and "already active and healthy" in plan.text()


def test_regen_plans_each_service_with_its_own_files_and_recovery():
    a, b = "kimi-k25-int4", "minimax-m25"
    stale = svc(a, installed=True)
    unit = stale.rendered.unit
    older = unit.text.replace("--max-num-batched-tokens 4096", "--max-num-batched-tokens 8192").encode()
    assert older != unit.data()
    stale = ServiceInput(manifest=stale.manifest, rendered=stale.rendered,
                         installed_files={**stale.installed_files, unit.path: older})
    services = [stale, svc(b, installed=True)]
    f = facts(services=running(a), installed={a: {}, b: {}})
    plan = plan_regen(RegenInput(entry=ENTRY, facts=f, opts=Options(), lock=LockFacts(held=False, path="/l"),
                                 services=services, orphaned=["gone"], restart=True))
    steps = [a_.step for a_ in plan.actions]
    assert steps == ["lock", f"install {a}", f"restart {a}", f"ready {a}", f"record {a}", f"install {b}"]
    assert plan.actions[steps.index(f"install {b}")].noop          # b's files are as rendered
    rec = plan.recovery_for(steps.index(f"ready {a}") + 1)
    assert rec is not None and [x.step for x in rec.actions] == ["restore", "start", "ready"]
    assert "gone is installed but has no manifest" in plan.text()
    golden("plan-regen-restart.txt", plan.text())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_shipped_manifest_plans_on_fake_facts(name):
    plan = plan_deploy(inp(svc(name), facts(), download(10 ** 9)))
    assert plan.refusal is None and plan.changes


def test_a_swap_hands_the_start_at_boot_to_the_new_model_and_its_rollback_hands_it_back():
    old, new = "kimi-k25-int4", "kimi-k25-nvfp4"
    services = {old: ServiceState(active=True, main_pid=1000, ready=True, enabled=True)}
    f = facts(services=services, active={"model": old, "gpus": list(range(8)), "enabled": True},
              models={old: ModelDir(old, 547 * 10 ** 9, {"revision": "x"}, 1.0)})
    plan = plan_swap(inp(svc(new), f, download(593 * 10 ** 9), old=svc(old, installed=True)))
    boot = next(a for a in plan.actions if a.step == "boot")
    assert not boot.noop and [c[1:] for c in boot.commands] == [["enable", f"vllm-{new}.service"],
                                                               ["disable", f"vllm-{old}.service"]]
    assert "enabled at boot" in plan.actions[-1].summary          # the active record says so
    rb = plan.recovery_for(len(plan.actions))
    back = next(a for a in rb.actions if a.step == "boot")
    assert [c[1:] for c in back.commands] == [["enable", f"vllm-{old}.service"], ["disable", f"vllm-{new}.service"]]


def test_deploy_with_enable_records_it():
    plan = plan_deploy(inp(svc("minimax-m25"), facts(), download(10 ** 9), enable=True))
    start = next(a for a in plan.actions if a.step == "start")
    assert ["systemctl", "enable", "vllm-minimax-m25.service"] in start.commands
    assert "enabled at boot" in plan.actions[-1].summary


def run_alone(action) -> list:
    """Run one action's `run` on a host that records commands and answers 0 (a fresh RunRecord)."""
    from orchestrator.host.base import Result
    from orchestrator.plan.run import RunEnv

    class Recorder:
        name, commands = "gpu1", []

        def run(self, cmd, **kw):
            self.commands.append(cmd)
            return Result(str(cmd), 0)

    host = Recorder()
    action.run(RunEnv(host, ENTRY, Options()))
    return host.commands


def half_done_facts(old: str, new: str, new_state: ServiceState | None) -> HostFacts:
    services = {old: ServiceState(active=False, main_pid=None, ready=False, enabled=True)}
    if new_state is not None:
        services[new] = new_state
    f = facts(services=services, active={"model": old, "gpus": list(range(8))},
              models={old: ModelDir(old, 547 * 10 ** 9, {"revision": "x"}, 1.0)})
    f.half_swap = SwapMarker.model_validate({"from": old, "to": new, "since": "2026-11-30T10:00:00+00:00",
                                             "by": "me@ctl pid 7", "from_enabled": True})
    return f


def test_a_half_done_swap_is_resumed_by_swapping_to_its_new_model_with_a_rollback():
    old, new = "kimi-k25-int4", "kimi-k25-nvfp4"
    loading = ServiceState(active=True, main_pid=2000, ready=False, enabled=False)
    f = half_done_facts(old, new, loading)
    assert old_model_name(f, new) == old and old_model_name(f, old) == new
    t = svc(new, installed=True)
    plan = plan_swap(inp(t, f, download(0, 593 * 10 ** 9), old=svc(old, installed=True)))
    steps = [a.step for a in plan.actions]
    assert "stop" not in steps and plan.actions[steps.index("start")].noop   # waited for, not restarted
    rb = plan.recovery_for(steps.index("ready") + 1)
    assert rb is not None and rb.title == f"roll back to {old}"
    ran = run_alone(rb.actions[0])                  # the previous run started it: stopped all the same
    # it never served: no drain window, SIGKILL after a short wait (Service.ABORT_WAIT_S)
    assert [c.text for c in ran] == [f"timeout 10 systemctl stop vllm-{new}.service || "
                                     f"{{ systemctl kill --signal=SIGKILL vllm-{new}.service; "
                                     f"systemctl stop vllm-{new}.service; systemctl reset-failed vllm-{new}.service; }}"], ran
    assert [a.step for a in rb.actions] == ["stop", "gpus", "start", "ready", "boot", "record"]
    boot = next(a for a in plan.actions if a.step == "boot")
    assert [c[1:] for c in boot.commands] == [["enable", f"vllm-{new}.service"], ["disable", f"vllm-{old}.service"]]


def test_a_half_done_swap_refuses_deploy_and_other_swaps_and_says_what_to_run():
    old, new = "kimi-k25-int4", "kimi-k25-nvfp4"
    f = half_done_facts(old, new, None)
    for plan in (plan_deploy(inp(svc("minimax-m25"), f, download(1))),
                 plan_swap(inp(svc("minimax-m25"), f, download(1), old=svc(old, installed=True)))):
        assert plan.refusal is not None and plan.refusal.exit_code == 3 and plan.refusal.step == "swap"
        assert f"{old} is stopped, {new} is stopped" in str(plan.refusal)
        assert f"vllm-orch swap {new} --host gpu1" in plan.refusal.hint
        assert f"vllm-orch swap {old} --host gpu1" in plan.refusal.hint


def test_going_back_from_a_half_done_swap_has_no_rollback_to_the_model_that_never_served():
    old, new = "kimi-k25-int4", "kimi-k25-nvfp4"
    f = half_done_facts(old, new, ServiceState(active=True, main_pid=2000, ready=False, enabled=False))
    plan = plan_swap(inp(svc(old, installed=True), f, download(0, 547 * 10 ** 9), old=svc(new, installed=True)))
    steps = [a.step for a in plan.actions]
    assert plan.refusal is None and steps.index("stop") < steps.index("start")
    assert plan.actions[steps.index("stop")].summary.startswith(f"stop {new}")
    # nothing to roll back to; a failed start is stopped so it cannot hold the GPUs (as a deploy's)
    assert [(r.title, [a.step for a in r.actions]) for r in plan.recoveries] == [
        (f"stop {old} so a failed start cannot hold the GPUs (model files kept)", ["stop"])]


def test_stop_is_a_plan_with_its_recovery_and_gc_a_plan_that_asks():
    from orchestrator.errors import RefusedError as Refused
    from orchestrator.plan.stop import StopInput, plan_gc, plan_stop

    name = "kimi-k25-int4"
    services = {name: ServiceState(active=True, main_pid=4242, enabled=True)}
    procs = [Proc(pid=4300 + i, name=f"VLLM::Worker_TP{i}", used_mib=90000, gpu_index=i, kind=SERVICE, model=name,
                  start_time=430000 + i) for i in range(2)]
    f = facts(services=services, active={"model": name, "gpus": list(range(8)), "port": 8000}, procs=procs)
    lock = LockFacts(held=False, path="/var/lib/vllm-orch/state/lock/deploy.lock")
    plan = plan_stop(StopInput(ENTRY, f, lock, name))
    assert [a.step for a in plan.actions] == ["lock", "stop", "boot", "leftovers", "gpus", "record"]
    rec = plan.recovery_for(4)
    assert rec is not None and (rec.first, rec.last) == (4, 5) and [a.step for a in rec.actions] == ["record"]
    golden("plan-stop-running.txt", plan.text())
    refused = plan_stop(StopInput(ENTRY, facts(), lock, "nothing"))
    assert isinstance(refused.refusal, Refused) and refused.refusal.exit_code == 3
    old = ModelDir("old", 10 ** 9, {"repo": "a/b", "files": {}, "complete": True}, 1.0)
    gc = plan_gc(ENTRY, facts(models={"old": old}), lock)
    assert gc.confirmations() == ["delete /var/lib/vllm-orch/models/old on gpu1 (1.0 GB)"]


def test_gc_of_named_folders_deletes_only_those_and_refuses_one_in_use_or_unknown():
    """`gc NAME...` (issue 43): only the named folders go; a name some service uses is refused (exit
    3) and one that is no folder is bad input (exit 2), and in both cases nothing is deleted."""
    from orchestrator.errors import ConfigError, RefusedError
    from orchestrator.plan.stop import plan_gc

    done = {"repo": "a/b", "files": {}, "complete": True}
    models = {n: ModelDir(n, 10 ** 9, done, float(i)) for i, n in enumerate(["old-a", "old-b", "kimi-k25-int4"])}
    models["by-hand"] = ModelDir("by-hand", 10 ** 9, None, 0.0)
    running = {"kimi-k25-int4": ServiceState(active=True, main_pid=4242, enabled=True)}
    f = facts(models=models, services=running, active={"model": "kimi-k25-int4", "gpus": list(range(8)), "port": 8000})
    lock = LockFacts(held=True)
    assert len(plan_gc(ENTRY, f, lock).confirmations()) == 2               # both unused folders
    one = plan_gc(ENTRY, f, lock, names=["old-b"])
    assert one.confirmations() == ["delete /var/lib/vllm-orch/models/old-b on gpu1 (1.0 GB)"]
    assert one.info["delete"] == [{"name": "old-b", "bytes": 10 ** 9, "last_used": 1.0, "verified": True,
                                   "enabled": ()}]
    with pytest.raises(RefusedError) as used:
        plan_gc(ENTRY, f, lock, names=["old-a", "kimi-k25-int4"])
    assert used.value.exit_code == 3 and "kimi-k25-int4 stays: the active model; nothing deleted" in used.value.message
    assert "vllm-orch stop kimi-k25-int4" in (used.value.hint or "")
    with pytest.raises(RefusedError) as theirs:
        plan_gc(ENTRY, f, lock, names=["by-hand"])
    assert "not made by vllm-orch" in theirs.value.message and "by hand" in (theirs.value.hint or "")
    with pytest.raises(ConfigError) as unknown:
        plan_gc(ENTRY, f, lock, names=["kimi-k25-int4-dcp8"])
    assert unknown.value.exit_code == 2 and "kimi-k25-int4-dcp8 is no folder under /var/lib/vllm-orch/models" in \
        unknown.value.message and "old-a, old-b" in (unknown.value.hint or "")
    with pytest.raises(RefusedError) as unlisted:       # the engine venvs could not be listed: it may be one
        plan_gc(ENTRY, f, lock, engines=None, engines_error="permission denied", names=["vllm-0.33.0-0123456789abcdef"])
    assert unlisted.value.exit_code == 3 and "are not listed (permission denied): none deleted" in \
        unlisted.value.message, unlisted.value.message
