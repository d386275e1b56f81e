"""swap's planner, pure: replace the active model with another, staged, measured, with its rollback.

    lock -> preflight -> disk (room for BOTH models) -> download while the old model serves ->
    install the new unit -> warm the new weights into the page cache (orchestrator.plan.warm) ->
    stop old -> GPUs free -> start new -> ready -> record
    if a step from `stop old` on fails: stop the new one, wait for the GPUs, start the old one with
    its unchanged unit, wait for its gates (the rollback, printed by --dry-run like every step).

The old model's files are never touched by a staged swap. When the disk cannot hold both, the plan
explains the cost and refuses without --yes; with --yes the old model is stopped and its folder
deleted before the download (no rollback is possible then: the plan says so).
"""

from __future__ import annotations

from orchestrator.errors import RefusedError
from orchestrator.fmt import fmt_bytes
from orchestrator.host.facts import HostFacts
from orchestrator.plan import prepare, service
from orchestrator.plan.deploy import unpinned_warning
from orchestrator.plan.inputs import PlanInput
from orchestrator.plan.model import Action, Plan
from orchestrator.plan.warm import warm_step

FIELD_DOWNLOAD_RATE = 547e9 / (28 * 60)    # field report: 547 GB in 28 min (~325 MB/s)


def old_model_name(facts: HostFacts, target: str) -> str | None:
    """The model a swap to `target` replaces: the recorded active one while it runs, else a running
    managed model, else the recorded one (stopped, e.g. by an interrupted swap)."""
    active = (facts.active or {}).get("model")
    if active and facts.services.get(active) and facts.services[active].active:
        return active
    running = [n for n in facts.running() if n != target]
    return running[0] if running else active


def already_done(inp: PlanInput) -> bool:
    """Swapping to the active, healthy, unchanged model does nothing."""
    f, t = inp.facts, inp.target
    st = f.services.get(t.name)
    return bool(st and st.active and t.serving and (f.active or {}).get("unit_hash") == t.rendered.unit_hash)


def plan_swap(inp: PlanInput) -> Plan:
    m, f, entry, old = inp.target.manifest, inp.facts, inp.entry, inp.old
    title = f"{old.name if old else '(nothing)'} -> {m.name}"
    if old is None and (f.active or {}).get("model") == m.name and already_done(inp):
        plan = Plan("swap", entry.describe(), f"{m.name} -> {m.name}",
                    info={"from": m.name, "to": m.name, "staged": True, "noop": True})
        plan.add(Action("swap", f"nothing to do, because {m.name} is already active and healthy", noop=True))
        return plan
    plan = Plan("swap", entry.describe(), title, warnings=unpinned_warning(inp),
                info={"from": old.name if old else None, "to": m.name, "staged": True})
    plan.add(prepare.lock_action(inp.lock))
    if plan.add_checked(*prepare.preflight_action(inp)):
        return plan
    keep = {old.name} if old else set()
    disk, err = prepare.disk_action(inp, keep=keep)
    if err is not None and old is not None:
        return _unstaged(plan, inp, err)
    if plan.add_checked(disk, err):
        return plan
    plan.add(prepare.download_action(inp))
    install = plan.add(service.install_action(entry, inp.target))
    # After an interrupted swap the old model may already be stopped and the new one running:
    # then there is nothing to stop, and a running, unchanged new service is waited for, not restarted.
    old_running = old is not None and bool(f.services.get(old.name) and f.services[old.name].active)
    start = service.start_action(inp, unit_changed=not install.noop)
    if not start.noop:          # a new service already running (an interrupted swap) loads nothing
        warm_action, exp = warm_step(inp, prepare.model_path(entry, m.name),
                                     before=f"{old.name} stops" if old is not None and old_running else "the start")
        plan.add(warm_action)
        plan.info["expected_downtime_s"] = exp.as_dict()
    stop = plan.add(service.stop_action(entry, old.name, "downtime starts", downtime_starts=True)) \
        if old is not None and old_running else None
    if plan.add_checked(*service.gpus_action(inp, stopping={old.name} if old_running and old else set())):
        return plan
    plan.add(start)
    plan.add(service.ready_action(inp.target, inp.opts.budget_s, already_serving=False))
    plan.add(service.record_action(inp))
    if stop is not None and old is not None:
        plan.recover(stop, f"roll back to {old.name}", rollback_actions(inp))
    return plan


def rollback_actions(inp: PlanInput) -> list[Action]:
    """Stop the new model, free the GPUs, start the old one with its installed unit, wait for it."""
    old, entry, new = inp.old, inp.entry, inp.target
    assert old is not None
    return [service.stop_action(entry, new.name, "the swap failed", only_if_started=True),
            service.release_action(old.manifest.serving.visible_devices, f"for {old.name}"),
            service.start_service_action(entry, old.name, summary=f"start {old.name} with its previous unit"),
            service.ready_action(old, inp.opts.budget_s, already_serving=False, marks_ready=False)]


def _unstaged(plan: Plan, inp: PlanInput, err: RefusedError) -> Plan:
    """The disk cannot hold both models: stop the old one and delete its folder first (--yes)."""
    m, f, entry, old = inp.target.manifest, inp.facts, inp.entry, inp.old
    assert old is not None and inp.download is not None
    need = inp.download.to_fetch_bytes
    extra = f.models[old.name].bytes if old.name in f.models else 0
    minutes = need / FIELD_DOWNLOAD_RATE / 60
    plan.info["staged"] = False
    available, limit_txt = prepare.disk_available(inp)
    running = set(f.running()) - {old.name}
    deletable = sum(d.bytes for n, d in f.models.items() if n not in running | {m.name})
    if available + deletable < need:
        return plan.refuse(Action("disk", f"short even without {old.name}"), RefusedError(
            f"not enough disk even after deleting {old.name} and every inactive model: the download "
            f"needs {fmt_bytes(need)}, {fmt_bytes(max(available, 0))} is available "
            f"({limit_txt}) and deleting would free {fmt_bytes(deletable)}",
            host=entry.name, step="disk", hint="free space on the models disk first"))
    text = (f"cannot stage: the disk cannot hold {m.name} next to {old.name} ({err.message}). Without "
            f"staging, {old.name} is stopped and its {fmt_bytes(extra)} deleted before the "
            f"download, which adds about {minutes:.0f} min of downtime at the field's 325 MB/s, and a "
            f"failed start cannot be rolled back without downloading {old.name} again")
    if not inp.opts.yes:
        return plan.refuse(Action("disk", text), RefusedError(
            f"the disk cannot stage {m.name} while {old.name} serves: an unstaged swap adds about "
            f"{minutes:.0f} min of downtime and loses the rollback", host=entry.name, step="disk",
            hint="pass --yes to accept, or free space (vllm-orch gc) and swap again"))
    plan.warnings.append(text)
    old_running = bool(f.services.get(old.name) and f.services[old.name].active)
    if old_running:
        plan.add(service.stop_action(entry, old.name, "downtime starts; not staged", downtime_starts=True))
    plan.add(Action("disk", f"delete {prepare.model_path(entry, old.name)} to make room (accepted with --yes)",
                    commands=[prepare.delete_command(entry, old.name)]))
    plan.add(prepare.download_action(inp))
    plan.add(service.install_action(entry, inp.target))
    plan.add(service.gpus_action(inp, stopping={old.name})[0])
    start = plan.add(service.start_action(inp, unit_changed=True))
    plan.add(service.ready_action(inp.target, inp.opts.budget_s, already_serving=False))
    plan.add(service.record_action(inp))
    plan.recover(start, f"stop {m.name} (no rollback: {old.name} was deleted to make room)",
                 [service.stop_action(entry, m.name, "it failed to become ready", only_if_started=True)])
    return plan
