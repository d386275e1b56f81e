"""swap's planner, pure: replace the active model with another, staged, measured, with its rollback.
On a host with several services, `--replace OLD` names the one replaced; the others keep serving
(the new model takes OLD's GPUs and port unless given, ops/gather.for_swap).

    lock -> preflight -> disk (room for BOTH models) -> download while the old model serves ->
    install the new unit -> warm the new weights into the page cache (orchestrator.plan.warm) ->
    stop old -> GPUs free -> start new -> ready -> perf -> boot -> record
    if a step from `stop old` on fails (a performance floor the manifest says to fail on included):
    stop the new one, wait for the GPUs, start the old one with its unchanged unit, wait for its
    gates (the rollback, printed by --dry-run like every step).

The stop of the old model first writes state_dir/swap.json (the swap is half done); `record` (or a
finished rollback) removes it. A run that is killed or loses its connection in between leaves it,
and the next swap / deploy / status on the host reads it (half_done): swap to its new model again
resumes it (nothing to stop, the running new service is waited for, and a failure still rolls back
to the old model); deploy refuses and says what to run. `boot` moves the start-at-boot of the old
model to the new one once the new one serves (systemd `enable` / `disable`; the active record
says it too), so a reboot brings back the model vllm-orch's record names.

The old model's files are never touched by a staged swap. When the disk cannot hold both, the plan
explains the cost and refuses without --yes; with --yes the old model is stopped and its folder
deleted before the download (no rollback is possible then: the plan says so).
"""

from __future__ import annotations

from orchestrator.errors import ConfigError, RefusedError
from orchestrator.fmt import fmt_bytes
from orchestrator.host.facts import HostFacts
from orchestrator.plan import prepare, service
from orchestrator.plan.deploy import unpinned_warning
from orchestrator.plan.inputs import PlanInput
from orchestrator.plan.interrupted import half_done
from orchestrator.plan.model import Action, Plan
from orchestrator.plan.placements import clash_refusal, record_warnings, service_names
from orchestrator.plan.warm import warm_step

FIELD_DOWNLOAD_RATE = 547e9 / (28 * 60)    # field report: 547 GB in 28 min (~325 MB/s)


def old_model_name(facts: HostFacts, target: str, host: str = "", replace: str | None = None) -> str | None:
    """The service a swap to `target` replaces: the other side of a half-done swap; else `replace`
    (`swap NEW --replace OLD`); else, on a host with one service, that one (running, else recorded).
    A host with several services asks for --replace (ConfigError, exit 2, naming them)."""
    half = facts.half_swap
    if half is not None and target == half.to:
        return half.from_
    if half is not None and target == half.from_:
        return half.to
    names = service_names(facts)
    if replace is not None:
        if replace not in names:
            raise ConfigError(f"--replace {replace}: {host or 'the host'} runs no such service"
                              + (f" (it runs {', '.join(names)})" if names else " (it runs none)"))
        return replace
    others = [n for n in names if n != target]
    if len(names) > 1 and others:
        raise ConfigError(f"{host or 'the host'} runs several services ({', '.join(names)}): say which one "
                          f"{target} replaces with --replace NAME")
    running = [n for n in facts.running() if n != target]
    if running:
        return running[0]
    return names[0] if names else None


def already_done(inp: PlanInput) -> bool:
    """Swapping to the active, healthy, unchanged model does nothing."""
    f, t = inp.facts, inp.target
    st = f.services.get(t.name)
    rec = f.record(t.name)
    return bool(st and st.active and t.serving and rec is not None and rec.unit_hash == t.rendered.unit_hash)


def plan_swap(inp: PlanInput) -> Plan:
    m, f, entry, old = inp.target.manifest, inp.facts, inp.entry, inp.old
    title = f"{old.name if old else '(nothing)'} -> {m.name}"
    half = half_done(f, entry.name)
    if half and f.half_swap is not None and m.name not in (f.half_swap.from_, f.half_swap.to):
        plan = Plan("swap", entry.describe(), title, info={"from": old.name if old else None, "to": m.name})
        return plan.refuse(Action("swap", half[0]), RefusedError(
            f"{half[0]}: finish or undo it before swapping to {m.name}", host=entry.name, step="swap", hint=half[1]))
    if old is None and not half and f.record(m.name) is not None and already_done(inp):
        plan = Plan("swap", entry.describe(), f"{m.name} -> {m.name}",
                    info={"from": m.name, "to": m.name, "staged": True, "noop": True})
        plan.add(Action("swap", f"nothing to do, because {m.name} is already active and healthy", noop=True))
        return plan
    plan = Plan("swap", entry.describe(), title, warnings=unpinned_warning(inp) + record_warnings(f),
                info={"from": old.name if old else None, "to": m.name, "staged": True})
    plan.add(prepare.lock_action(inp.lock))
    clash = clash_refusal(f, inp.target, entry.name, replacing={old.name} if old else set())
    if clash:
        return plan.refuse(Action("placement", clash.message), clash)
    if plan.add_checked(*prepare.preflight_action(inp)):
        return plan
    keep = {old.name, old.model} if old else set()
    disk, err = prepare.disk_action(inp, keep=keep)
    if err is not None and old is not None:
        return _unstaged(plan, inp, err)
    if plan.add_checked(disk, err):
        return plan
    plan.add(prepare.download_action(inp))
    plan.add(prepare.user_action(entry, f.users))
    install = plan.add(service.install_action(entry, inp.target))
    # After an interrupted swap the old model may already be stopped and the new one running:
    # then there is nothing to stop, and a running, unchanged new service is waited for, not restarted.
    old_running = old is not None and bool(f.services.get(old.name) and f.services[old.name].active)
    old_enabled = old is not None and service.enabled_at_boot(f, old.name)
    start = service.start_action(inp, unit_changed=not install.noop)
    if not start.noop:          # a new service already running (an interrupted swap) loads nothing
        warm_action, exp = warm_step(inp, prepare.model_path(entry, inp.target.model),
                                     before=f"{old.name} stops" if old is not None and old_running else "the start")
        plan.add(warm_action)
        plan.info["expected_downtime_s"] = exp.as_dict()
    stop = plan.add(service.stop_action(entry, old.name, "downtime starts", downtime_starts=True, swap_to=m.name,
                                        enabled=old_enabled)) \
        if old is not None and old_running else None
    gpus, refusal = service.gpus_action(inp, stopping={old.name} if old_running and old else set())
    if plan.add_checked(gpus, refusal):
        return plan
    plan.add(start)
    plan.add(service.ready_action(inp.target, inp.opts.budget_s, already_serving=False))
    plan.add(service.perf_action(inp))
    plan.add(boot_action(inp, old_enabled))
    enabled = old_enabled or inp.opts.enable or service.enabled_at_boot(f, m.name)
    plan.add(service.record_action(inp, enabled=enabled, ends_swap=True, replaces=old.name if old else None))
    # Going back from a half-done swap (to its old model) has nothing to roll back to: the model it
    # stops never served. Resuming one (to its new model) rolls back to the old model as usual, and
    # its rollback stops the new service although the run that was cut short started it.
    going_back = f.half_swap is not None and m.name == f.half_swap.from_
    if old is not None and (stop is not None or half) and not going_back:
        plan.recover(stop or gpus, f"roll back to {old.name}", rollback_actions(inp, new_started_before=stop is None))
    return plan


def boot_action(inp: PlanInput, old_enabled: bool) -> Action:
    """Once the new model serves: it takes over the old one's start at boot (or --enable's)."""
    f, entry, m, old = inp.facts, inp.entry, inp.target.manifest, inp.old
    enable = m.name if (old_enabled or inp.opts.enable) and not service.enabled_at_boot(f, m.name) else None
    disable = [old.name] if old is not None and old_enabled else []
    if not enable and not disable:
        why = f"{old.name} does not start at boot" if old is not None else f"{m.name}'s start at boot is unchanged"
        return service.boot_action(entry, None, [], why)
    what = [f"enable {enable} at boot"] if enable else []
    what += [f"disable {', '.join(disable)}"] if disable else []
    return service.boot_action(entry, enable, disable, " and ".join(what) + (
        f" ({m.name} takes {old.name}'s place at boot)" if old is not None and old_enabled else ""))


def rollback_actions(inp: PlanInput, new_started_before: bool = False) -> list[Action]:
    """Stop the new model, free the GPUs, start the old one with its installed unit, wait for it,
    give it back its start at boot, and end the swap."""
    old, entry, new, f = inp.old, inp.entry, inp.target, inp.facts
    assert old is not None
    half = f.half_swap
    old_enabled = half.from_enabled if half is not None and half.from_ == old.name \
        else service.enabled_at_boot(f, old.name)
    actions = [service.stop_action(entry, new.name, "the swap failed", only_if_started=not new_started_before,
                                   drain=False),
               service.release_action(old.manifest.serving.visible_devices, f"for {old.name}"),
               service.start_service_action(entry, old.name, summary=f"start {old.name} with its previous unit"),
               service.ready_action(old, inp.opts.budget_s, already_serving=False, marks_ready=False)]
    if old_enabled:       # the boot step may have run: the old model starts at boot again, the new not
        keep_new = service.enabled_at_boot(f, new.name)
        actions.append(service.boot_action(entry, old.name, [] if keep_new else [new.name],
                                           f"{old.name} starts at boot again"))
    actions.append(service.forget_swap_action(entry, f"{old.name} serves again"))
    return actions


def _unstaged(plan: Plan, inp: PlanInput, err: RefusedError) -> Plan:
    """The disk cannot hold both models: stop the old one and delete its folder first (--yes)."""
    m, f, entry, old = inp.target.manifest, inp.facts, inp.entry, inp.old
    assert old is not None and inp.download is not None
    folder = old.model
    sharing = sorted(n for n in f.records if n != old.name and f.model_of(n) == folder)
    if sharing:
        return plan.refuse(Action("disk", f"{prepare.model_path(entry, folder)} is used by {', '.join(sharing)}"),
                           RefusedError(f"the disk cannot stage {m.name} next to {old.name}, and {old.name}'s "
                                        f"weights are also {', '.join(sharing)}'s: they are not deleted",
                                        host=entry.name, step="disk", hint="free space on the models disk first"))
    need = inp.download.to_fetch_bytes
    extra = f.models[folder].bytes if folder in f.models else 0
    minutes = need / FIELD_DOWNLOAD_RATE / 60
    plan.info["staged"] = False
    available, limit_txt = prepare.disk_available(inp)
    old_dir = f.models.get(folder)
    if old_dir is not None and not old_dir.ours:
        return plan.refuse(Action("disk", f"{prepare.model_path(entry, folder)} was not made by vllm-orch"),
                           RefusedError(
            f"the disk cannot stage {m.name} next to {old.name}, and {prepare.model_path(entry, folder)} "
            f"has no .vllm-orch/verified.json: vllm-orch only deletes folders it made", host=entry.name,
            step="disk", hint="free space on the models disk yourself, then swap again"))
    # What the unstaged plan deletes: the old model's folder (the staged check above already counted
    # every other inactive folder of ours).
    deletable = old_dir.bytes if old_dir is not None else 0
    if available + deletable < need:
        return plan.refuse(Action("disk", f"short even without {old.name}"), RefusedError(
            f"not enough disk even after deleting {old.name}: the download "
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
    old_enabled = service.enabled_at_boot(f, old.name)
    if old_running:
        plan.add(service.stop_action(entry, old.name, "downtime starts; not staged", downtime_starts=True,
                                     swap_to=m.name, enabled=old_enabled))
    plan.add(Action("disk", f"delete {prepare.model_path(entry, folder)} to make room (accepted with --yes)",
                    commands=[prepare.delete_command(entry, folder)],
                    confirm=f"delete {prepare.model_path(entry, folder)} on {entry.name} ({fmt_bytes(extra)})"))
    plan.add(prepare.download_action(inp))
    plan.add(prepare.user_action(entry, f.users))
    plan.add(service.install_action(entry, inp.target))
    plan.add(service.gpus_action(inp, stopping={old.name})[0])
    start = plan.add(service.start_action(inp, unit_changed=True))
    plan.add(service.ready_action(inp.target, inp.opts.budget_s, already_serving=False))
    plan.add(service.perf_action(inp))
    plan.add(boot_action(inp, old_enabled))
    enabled = old_enabled or inp.opts.enable or service.enabled_at_boot(f, m.name)
    plan.add(service.record_action(inp, enabled=enabled, ends_swap=True, replaces=old.name if old else None))
    plan.recover(start, f"stop {m.name} (no rollback: {old.name} was deleted to make room)",
                 [service.stop_action(entry, m.name, "it failed to become ready", only_if_started=True,
                                      drain=False)])
    return plan
