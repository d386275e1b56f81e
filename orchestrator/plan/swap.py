"""swap's planner, pure: replace a service with another, staged, measured, with its rollback, over
the new service's nodes (one host, or the hosts of a multi-node service) and the old one's. On a
host with several services, `--replace OLD` names the one replaced; the others keep serving (the
new one takes OLD's GPUs and port unless given: config/placement.resolve).

    lock -> preflight -> disk (room for BOTH models) -> download while the old model serves (every
    node at once) -> verify-same (several nodes) -> install the new unit -> warm the new weights into
    each node's page cache (orchestrator.plan.warm) -> stop old (on every node it runs on) -> GPUs
    free -> start new (workers, then the head) -> ready -> perf -> boot -> record
    if a step from `stop old` on fails (a performance floor the manifest says to fail on included):
    stop the new one on every node, wait for the GPUs, start the old one with its unchanged unit
    (workers first), wait for its gates, give it back its start at boot (the rollback, printed by
    --dry-run like every step). A swap from nothing stops what it started instead.

The stop of the old model first writes state_dir/swap.json on its head (the swap is half done);
`record` (or a finished rollback) removes it. A run that is killed or loses its connection in
between leaves it, and the next swap / deploy / status on the host reads it (half_done): swap to
its new model again resumes it (nothing to stop, the running new service is waited for, and a
failure still rolls back to the old model); deploy refuses and says what to run. `boot` moves the
start-at-boot of the old model to the new one once the new one serves (systemd `enable` /
`disable`; the record says it too), so a reboot brings back the model vllm-orch's record names.

The old model's files are never touched by a staged swap. When one host's disk cannot hold both,
the plan explains the cost and refuses without --yes; with --yes the old model is stopped and its
folder deleted before the download (no rollback is possible then: the plan says so). A swap across
nodes always stages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from orchestrator.config.inventory import HostEntry
from orchestrator.errors import ConfigError, RefusedError
from orchestrator.fmt import fmt_bytes
from orchestrator.host import state
from orchestrator.host.facts import HostFacts
from orchestrator.plan import prepare, service, sleep
from orchestrator.plan.deploy import (
    engines,
    hosts_desc,
    preflights,
    start_actions,
    stop_everywhere,
    stop_title,
    tagger,
    unpinned_warning,
    warm_before,
)
from orchestrator.plan.inputs import LockFacts, PlanInput, ServiceInput
from orchestrator.plan.interrupted import half_done, sleep_half
from orchestrator.plan.model import Action, Plan
from orchestrator.plan.multinode import OldService, download_all_action, forget_record_action, on, verify_same_action
from orchestrator.plan.placements import clash_refusal, name_refusal, record_warnings, service_names
from orchestrator.plan.run import RunEnv
from orchestrator.plan.warm import cpu_need, warm_step

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
    names = [n for n in names if n == target or facts.asleep(n) is None]    # a sleeping one stays asleep
    others = [n for n in names if n != target]
    if facts.asleep(target) is not None and len(others) == 1:       # waking it: the awake one gives way
        return others[0]
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


def plan_swap(*nodes: PlanInput, old: OldService | None = None,
              elsewhere: Mapping[str, tuple[HostEntry, LockFacts]] | None = None) -> Plan:
    """nodes: the new service's nodes, head first (one for a one-host service), each with the old
    service's ServiceInput (`old`) on the nodes it runs on. `old`: the service replaced across its
    nodes; by default the head's `old` as a one-host service. `elsewhere`: the entry and lock of
    each node of the old service that is no node of the new one."""
    head = nodes[0]
    m, f, entry = head.target.manifest, head.facts, head.entry
    if old is None and head.old is not None:
        old = OldService(head.old.name, (entry.name,), head.old,
                         frozenset({entry.name} if (st := f.services.get(head.old.name)) and st.active else ()))
    elsewhere = elsewhere or {}
    one = len(nodes) == 1 and (old is None or old.nodes == (entry.name,))
    tag = tagger(nodes) if one else on          # several hosts (the old service's too): each step names its node
    names = [i.entry.name for i in nodes]
    title = f"{old.name if old else '(nothing)'} -> {m.name}"
    info: dict = {"from": old.name if old else None, "to": m.name, "staged": True,
                  **({} if one else {"nodes": names})}
    half = half_done(f, entry.name)
    swap_of_it = f.half_swap is not None and m.name in (f.half_swap.from_, f.half_swap.to)
    if half and one and not swap_of_it:
        plan = Plan("swap", entry.describe(), title, info=info)
        return plan.refuse(Action("swap", half[0]), RefusedError(
            f"{half[0]}: finish or undo it before swapping to {m.name}", host=entry.name, step="swap", hint=half[1]))
    if old is None and not half and all(already_done(i) for i in nodes):
        plan = Plan("swap", hosts_desc(nodes), f"{m.name} -> {m.name}", info={**info, "from": m.name, "noop": True})
        plan.add(Action("swap", f"nothing to do, because {m.name} is already active and healthy", noop=True))
        return plan
    plan = Plan("swap", hosts_desc(nodes), title, info=info,
                warnings=unpinned_warning(head) + [w for i in nodes for w in record_warnings(i.facts)])
    ended = _stage(plan, nodes, old, elsewhere, tag, one)
    if ended is not None:
        return ended
    for i in nodes:
        plan.add(tag(i.entry.name, prepare.user_action(i.entry, i.facts.users)))
    installs = [plan.add(tag(i.entry.name, service.install_action(i.entry, i.target))) for i in nodes]
    # After an interrupted swap the old model may already be stopped and the new one running: then
    # there is nothing to stop, and a running, unchanged new service is waited for, not restarted.
    running = {i.entry.name: bool((st := i.facts.services.get(m.name)) and st.active) for i in nodes}
    changed = any(not a.noop for a in installs) or not all(running.values()) or \
        any(service.runs_older_files(i.facts, i.target) for i in nodes)
    starts = start_actions(nodes, changed, tag)
    old_running = [n for n in old.nodes if n in old.running] if old is not None else []
    warm_before(plan, nodes, starts, tag, what="downtime",
                before=f"{old.name} stops" if old is not None and old_running else "the start")
    old_enabled = old is not None and service.enabled_at_boot(facts_of(nodes, old.nodes[0], f), old.name)
    stops = [plan.add(tag(n, service.stop_action(
        entry_of(nodes, elsewhere, n), old.name, "downtime starts" if k == 0 else "with its head",
        downtime_starts=k == 0, swap_to=m.name if n == old.nodes[0] else None,
        enabled=old_enabled if n == old.nodes[0] else False)))
        for k, n in enumerate(old_running)] if old is not None else []
    gpus: Action | None = None
    for i in nodes:
        stopping = {old.name} if old is not None and i.entry.name in old_running else set()
        action, refusal = service.gpus_action(i, stopping=stopping)
        gpus = gpus or tag(i.entry.name, action)
        if plan.add_checked(tag(i.entry.name, action), refusal):
            return plan
    for a in starts:
        plan.add(a)
    plan.add(tag(entry.name, service.ready_action(head.target, head.opts.budget_s, already_serving=False,
                                                  workers=names[1:])))
    plan.add(tag(entry.name, service.perf_action(head)))
    _hand_over(plan, nodes, old, elsewhere, tag, old_enabled)
    # Going back from a half-done swap (to its old model) has nothing to roll back to: the model it
    # stops never served. Resuming one (to its new model) rolls back to the old model as usual, and
    # its rollback stops the new service although the run that was cut short started it.
    going_back = f.half_swap is not None and m.name == f.half_swap.from_
    if old is not None and (stops or half) and not going_back:
        first = stops[0] if stops else gpus
        assert first is not None
        plan.recover(first, f"roll back to {old.name}" + ("" if one else f" on {', '.join(old.nodes)}"),
                     rollback_actions(nodes, old, elsewhere, tag, new_started_before=not stops))
    elif (first_start := next((a for a in starts if not a.noop), None)) is not None and one and old is None \
            and running[entry.name] and not installs[0].noop and head.target.installed_files.get(
                head.target.rendered.unit.path) is not None:
        # the same service with new files (an engine upgrade: its unit names another venv): a failed
        # start or gate puts its previous files back (the old venv stays: its record still names it)
        # and starts it again
        plan.recover(first_start, f"roll back to {m.name}'s previous unit (its previous engine)",
                     upgrade_rollback(head))
    elif (first_start := next((a for a in starts if not a.noop), None)) is not None:
        # nothing to roll back to (a swap from nothing, or from a service that does not run): a
        # failed start is stopped, so it cannot hold the GPUs
        plan.recover(first_start, stop_title(m.name, len(nodes) == 1), stop_everywhere(nodes, tag))
    return plan


def _hand_over(plan: Plan, nodes: Sequence[PlanInput], old: OldService | None,
               elsewhere: Mapping[str, tuple[HostEntry, LockFacts]], tag: Callable[[str, Action], Action],
               old_enabled: bool) -> None:
    """Once the new service serves: it takes the old one's start at boot (each node), its records
    are written and the old one's removed (the swap ends on the old head, where swap.json is), and
    the old one's nodes that are none of the new one's let it go."""
    head = nodes[0]
    m = head.target.manifest
    for i in nodes:
        plan.add(tag(i.entry.name, boot_action(i, old_enabled and i.old is not None)))
    enabled = old_enabled or head.opts.enable or service.enabled_at_boot(head.facts, m.name)
    swap_host = old.nodes[0] if old is not None else head.entry.name        # where swap.json is kept
    for i in nodes:
        plan.add(tag(i.entry.name, service.record_action(i, enabled=enabled, ends_swap=i.entry.name == swap_host,
                                                         replaces=old.name if old and i.old is not None else None)))
    for n, (e, _lock) in elsewhere.items():
        if old is not None and old_enabled:
            plan.add(on(n, service.boot_action(e, None, [old.name], f"disable {old.name} (this host is no node "
                                                                     f"of the new service)")))
        plan.add(on(n, forget_record_action(e, old.name if old else "")))


def _stage(plan: Plan, nodes: Sequence[PlanInput], old: OldService | None,
           elsewhere: Mapping[str, tuple[HostEntry, LockFacts]], tag: Callable[[str, Action], Action],
           one: bool, unstaged_ok: bool = True) -> Plan | None:
    """The swap's steps while the old service still serves: every lock, the overlap and half-done
    refusals, preflight, disk room for both (one host without it: the unstaged swap), the download
    on every node, verify-same. The plan to return when they end it (a refusal, an unstaged swap)."""
    head = nodes[0]
    for i in nodes:
        plan.add(tag(i.entry.name, prepare.lock_action(i.lock)))
    for n, (_e, lock) in elsewhere.items():
        plan.add(on(n, prepare.lock_action(lock)))
    for i in nodes:
        node = i.entry.name
        clash = name_refusal(i.facts, i.target, node) or \
            clash_refusal(i.facts, i.target, node, replacing={old.name} if old and i.old is not None else set())
        if clash:
            return plan.refuse(tag(node, Action("placement", clash.message)), clash)
        node_half = half_done(i.facts, node)
        if node_half and not one:
            return plan.refuse(on(node, Action("swap", node_half[0])), RefusedError(
                f"{node_half[0]}: finish or undo it first", host=node, step="swap", hint=node_half[1]))
    if preflights(plan, nodes, tag):
        return plan
    for i in nodes:
        keep = {i.old.name, i.old.folder} if i.old is not None else set()
        disk, err = prepare.disk_action(i, keep=keep)
        if err is not None and one and i.old is not None and unstaged_ok:
            return _unstaged(plan, i, err)
        if err is not None and not one:
            err.hint = (err.hint or "") + "; a swap across nodes always stages (free space, or stop the old " \
                                          "service and deploy)"
        if plan.add_checked(tag(i.entry.name, disk), err):
            return plan
    plan.add(prepare.download_action(head) if one else download_all_action(nodes))
    if len(nodes) > 1 and plan.add_checked(*verify_same_action(nodes)):
        return plan
    engines(plan, nodes, tag)
    return None


def facts_of(nodes: Sequence[PlanInput], host: str, default: HostFacts) -> HostFacts:
    return next((i.facts for i in nodes if i.entry.name == host), default)


def entry_of(nodes: Sequence[PlanInput], elsewhere: Mapping[str, tuple[HostEntry, LockFacts]], host: str) -> HostEntry:
    return next((i.entry for i in nodes if i.entry.name == host), None) or elsewhere[host][0]


def boot_action(inp: PlanInput, old_enabled: bool) -> Action:
    """Once the new model serves: it takes over the old one's start at boot (or --enable's), on
    this node."""
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


def rollback_actions(nodes: Sequence[PlanInput], old: OldService,
                     elsewhere: Mapping[str, tuple[HostEntry, LockFacts]], tag: Callable[[str, Action], Action],
                     new_started_before: bool = False) -> list[Action]:
    """Stop the new service on every node (workers first), free the old one's GPUs, start the old
    one with its installed unit on every node it ran on (workers first), wait for it at its head,
    give it back its start at boot, and end the swap."""
    head = nodes[0]
    new = head.target.manifest.name
    f = facts_of(nodes, old.nodes[0], head.facts)
    half = f.half_swap
    old_enabled = half.from_enabled if half is not None and half.from_ == old.name \
        else service.enabled_at_boot(f, old.name)
    ran = [n for n in old.nodes if n in old.running] or list(old.nodes)      # stopped already: every node
    actions = [tag(i.entry.name, service.stop_action(i.entry, new, "the swap failed", drain=False,
                                                     only_if_started=not new_started_before))
               for i in [*nodes[1:], head]]
    gpus = old.head.manifest.serving.visible_devices
    actions += [tag(n, service.release_action(gpus, f"for {old.name}")) for n in ran]
    actions += [tag(n, service.start_service_action(entry_of(nodes, elsewhere, n), old.name,
                                                    summary=f"start {old.name} with its previous unit"))
                for n in [*ran[1:], ran[0]]]
    actions.append(tag(old.nodes[0], service.ready_action(old.head, head.opts.budget_s, already_serving=False,
                                                          marks_ready=False, workers=ran[1:])))
    # the old service started from its installed files, which may be newer than those it ran (regen
    # without --restart since its start): its record says how it runs now
    for i in nodes:
        rec, inst = i.facts.record(old.name), i.facts.installed.get(old.name)
        if i.entry.name in ran and rec is not None and inst is not None and rec.unit_hash != inst.unit_hash:
            actions.append(tag(i.entry.name, service.rerecord_installed_action(i.entry, old.name)))
    if old_enabled:       # the boot step may have run: the old model starts at boot again, the new not
        for n in ran:
            keep_new = service.enabled_at_boot(facts_of(nodes, n, f), new)
            actions.append(tag(n, service.boot_action(entry_of(nodes, elsewhere, n), old.name,
                                                      [] if keep_new or n not in {i.entry.name for i in nodes}
                                                      else [new], f"{old.name} starts at boot again")))
    actions.append(tag(old.nodes[0], service.forget_swap_action(entry_of(nodes, elsewhere, old.nodes[0]),
                                                                f"{old.name} serves again")))
    return actions


def upgrade_rollback(inp: PlanInput) -> list[Action]:
    """Stop the new start, put the service's previous files back, start it with them, wait for it."""
    t, entry = inp.target, inp.entry
    return [service.stop_action(entry, t.name, "the upgrade failed", drain=False),
            service.restore_action(t, inp.facts.installed.get(t.name)),
            service.start_service_action(entry, t.name, restart=True,
                                         summary=f"start {t.name} with its previous unit"),
            service.ready_action(t, inp.opts.budget_s, already_serving=False, marks_ready=False)]


def _unstaged(plan: Plan, inp: PlanInput, err: RefusedError) -> Plan:
    """The disk cannot hold both models: stop the old one and delete its folder first (--yes)."""
    m, f, entry, old = inp.target.manifest, inp.facts, inp.entry, inp.old
    assert old is not None and inp.download is not None
    folder = old.folder
    sharing = sorted(n for n in f.records if n != old.name and f.folder_of(n) == folder)
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
    engines(plan, [inp], lambda _node, action: action)       # the venv needs no room of the models disk
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


# -- sleep mode (plan/sleep.py's steps) ------------------------------------------------------------

def plan_sleep_swap(inp: PlanInput) -> Plan:
    """A swap on one host with vLLM's sleep mode. To a service that sleeps there: the awake one
    sleeps (--sleep-old) or stops, the target wakes, its canary matches, a warm-up request; a failure
    puts the target back to sleep (level 2: its weights are read again at the next wake) and wakes
    the other back (or starts it), a cold start as the last resort. To a service that does not run:
    `swap --sleep-old` stages it like every swap and puts the old one to sleep instead of stopping it
    (the level its host RAM allows, said in the plan); a failure stops the new one and wakes the old."""
    m, f, entry = inp.target.manifest, inp.facts, inp.entry
    # A sleep swap cut short (swap.json names this service; one side sleeps): this run finishes it
    # (to its new service) or undoes it (to its old one). The other side is the old one here,
    # running or not, asleep or not: each step below skips what the cut run already did.
    resuming = sleep_half(f, m.name)
    old = inp.old if inp.old is not None and ((st := f.services.get(inp.old.name)) is not None and st.active
                                              or resuming) else None
    asleep = f.asleep(m.name)
    info: dict = {"from": old.name if old else None, "to": m.name, "staged": True,
                  "sleep": "wake" if asleep is not None else "sleep-old"}
    plan = Plan("swap", entry.describe(), f"{old.name if old else '(nothing)'} -> {m.name}", info=info,
                warnings=record_warnings(f))
    half = half_done(f, entry.name)
    if half and not resuming:
        plan.add(prepare.lock_action(inp.lock))
        ours = inp.opts.sleep_old and f.half_swap is not None and m.name in (f.half_swap.from_, f.half_swap.to)
        return plan.refuse(Action("swap", half[0]), RefusedError(
            f"{half[0]}: " + ("it stopped its old service: finish or undo it without --sleep-old" if ours
                              else f"finish or undo it before swapping to {m.name}"),
            host=entry.name, step="swap", hint=half[1]))
    if asleep is not None:
        return _wake_target(plan, inp, old, resuming)
    if old is None or old.manifest.sleep is None or not (inp.opts.sleep_old or resuming):
        why = (f"{old.name} has no sleep section in its manifest (add `sleep: {{level: 1}}`, then `vllm-orch regen "
               f"--restart`)" if old is not None and old.manifest.sleep is None else "nothing serves to put to sleep")
        plan.add(prepare.lock_action(inp.lock))
        return plan.refuse(Action("sleep", why), RefusedError(f"--sleep-old: {why}", host=entry.name, step="sleep",
                                                              hint="swap without --sleep-old stops it instead"))
    rec = f.record(old.name)
    if rec is not None and "--enable-sleep-mode" not in rec.argv:
        plan.add(prepare.lock_action(inp.lock))
        return plan.refuse(Action("sleep", f"{old.name} runs without --enable-sleep-mode"), RefusedError(
            f"--sleep-old: {old.name} was started without --enable-sleep-mode: a sleep would free nothing",
            host=entry.name, step="sleep", hint=f"`vllm-orch regen --restart --host {entry.name}` restarts it with its "
                                                f"sleep section first"))
    if m.serving.port == old.manifest.serving.port:
        plan.add(prepare.lock_action(inp.lock))
        return plan.refuse(Action("placement", f"{old.name} keeps port {m.serving.port} while it sleeps"), RefusedError(
            f"{old.name} keeps listening on port {m.serving.port} while it sleeps: {m.name} needs another port",
            host=entry.name, step="placement", hint="give it one with --port"))
    one = OldService(old.name, (entry.name,), old, frozenset({entry.name}))
    ended = _stage(plan, [inp], one, {}, lambda _n, a: a, True, unstaged_ok=False)
    if ended is not None:
        return ended
    old_asleep = f.asleep(old.name)
    may, why_not = (True, "") if old_asleep is not None else sleep.sleep_or_stop(f, old, m, entry.name)
    if not may:
        return plan.refuse(Action("sleep", why_not), RefusedError(
            f"--sleep-old: {why_not}", host=entry.name, step="sleep", hint="swap without --sleep-old stops it"))
    plan.add(prepare.user_action(entry, f.users))
    install = plan.add(service.install_action(entry, inp.target))
    starts = start_actions([inp], not install.noop or not bool((st := f.services.get(m.name)) and st.active),
                           lambda _n, a: a)
    need, _ = cpu_need(m, entry)
    level, why, pinned = (old_asleep.level, "asleep already: an interrupted swap put it to sleep", 0) if old_asleep \
        else sleep.level_for(f, old, need)
    # the warm-up and the pinning share host RAM: the pinning would evict what the warm-up cached
    warm_before(plan, [inp], starts, lambda _n, a: a, what="downtime", before=f"{old.name} sleeps",
                reserve=(pinned, f"{old.name}'s level-1 sleep pins") if pinned else None)
    if level != old.manifest.sleep.level and old_asleep is None:
        plan.warnings.append(f"{old.name} sleeps at level {level}: {why}")
    info["sleep_level"] = level
    first = plan.add(sleep.sleep_action(entry, old, level, f"downtime starts; {why}" if old_asleep is None else why,
                                        downtime_starts=old_asleep is None, weights=sleep.weights_bytes(f, old),
                                        swap_to=m.name))
    plan.add(sleep.room_action(m, f"{old.name} asleep"))
    for a in starts:
        plan.add(a)
    plan.add(service.ready_action(inp.target, inp.opts.budget_s, already_serving=False))
    plan.add(service.perf_action(inp))
    plan.add(service.record_action(inp, enabled=inp.opts.enable or service.enabled_at_boot(f, m.name),
                                   ends_swap=True))
    # resuming, the service to stop was started by the run cut short
    plan.recover(first, f"wake {old.name} back", [
        service.stop_action(entry, m.name, "the swap failed", drain=False, only_if_started=not resuming),
        sleep.room_action(old.manifest, f"{m.name} stopped"),
        sleep.wake_action(entry, old, "it serves again", marks_ready=False, cold_fallback=True,
                          budget_s=inp.opts.budget_s),
        service.forget_swap_action(entry, f"{old.name} serves again")])
    return plan


def _wake_target(plan: Plan, inp: PlanInput, old: ServiceInput | None, resuming: bool) -> Plan:
    """Swap to a sleeping service: the awake one sleeps or stops, the target wakes (canary, warm-up).
    `resuming` a sleep swap cut short: the other side may be asleep already (nothing to do: the
    rollback wakes it), or stopped already (its stop does nothing; the rollback starts it)."""
    m, f, entry = inp.target.manifest, inp.facts, inp.entry
    plan.add(prepare.lock_action(inp.lock))
    half = f.half_swap if resuming else None
    rec = f.record(m.name)
    if rec is not None and rec.unit_hash and rec.unit_hash != inp.target.rendered.unit_hash:
        plan.warnings.append(f"{m.name} sleeps with the files it was started with, not those rendered now: "
                             f"it wakes as it ran (`vllm-orch regen --restart` applies the new ones)")
    # resuming: the cut run's choice for the other side (its sleep: swap.json's from_sleeps) stands
    sleep_old = inp.opts.sleep_old or (half is not None and half.to == m.name and half.from_sleeps)
    old_sleep = f.asleep(old.name) if old is not None else None
    old_asleep = old_sleep is not None
    sleeps = old is not None and (sleep_old or old_asleep) and old.manifest.sleep is not None
    if old is not None and sleep_old and not sleeps:
        plan.warnings.append(f"{old.name} has no sleep section: it is stopped, not put to sleep")
    if old is not None and sleeps and not old_asleep:
        sleeps, why = sleep.sleep_or_stop(f, old, m, entry.name)
        if not sleeps:
            plan.warnings.append(why)
    room = sleep.room_refusal(f, m, entry.name, awake_too={old.name} if old else set())
    if room is not None:
        return plan.refuse(Action("placement", room.message), room)
    first: Action | None = None
    asleep = f.asleep(m.name)
    level, why, pinned = (sleep.level_for(f, old, 0) if old is not None and sleeps and old_sleep is None
                          else (0, "", 0))
    if asleep is not None and asleep.level == 2:     # its wake reads the weights: from the page cache, warmed first
        action, exp = warm_step(inp, prepare.model_path(entry, inp.target.folder),
                                before=f"{old.name} {'sleeps' if sleeps else 'stops'}" if old else "the wake",
                                reserve=(pinned, f"{old.name}'s level-1 sleep pins") if pinned and old else None)
        plan.add(action)
        plan.info["expected_downtime_s"] = exp.as_dict()
    if old is not None and old_sleep is not None:      # asleep already: the cut run put it to sleep
        first = plan.add(sleep.sleep_action(entry, old, old_sleep.level, "asleep already: an interrupted swap put "
                                            "it to sleep", weights=sleep.weights_bytes(f, old), swap_to=m.name,
                                            to_wakes=True))
    elif old is not None and sleeps:
        assert old.manifest.sleep is not None
        if level != old.manifest.sleep.level:
            plan.warnings.append(f"{old.name} sleeps at level {level}: {why}")
        plan.info["sleep_level"] = level
        # its sleep reads what it keeps on the GPUs: /sleep returns once the memory is unmapped
        first = plan.add(sleep.sleep_action(entry, old, level, f"downtime starts; {why}", downtime_starts=True,
                                            weights=sleep.weights_bytes(f, old), swap_to=m.name, to_wakes=True))
    elif old is not None:
        first = plan.add(service.stop_action(entry, old.name, "downtime starts", downtime_starts=True,
                                             swap_to=m.name, to_wakes=True))
        plan.add(sleep.room_action(m, f"{old.name} stopped"))
    # going back from a half-done swap (to its old service): the other side never served, so there is
    # nothing to roll back to; a failed wake restarts it cold instead (the ordinary swap's return)
    going_back = half is not None and half.from_ == m.name
    wake = plan.add(sleep.wake_action(entry, inp.target, "it serves again", budget_s=inp.opts.budget_s,
                                      cold_fallback=going_back))
    first = first or wake
    gone = old.name if old is not None and not sleeps else None

    def record(env: RunEnv) -> str:
        if gone:
            state.write_record(env.host, env.entry, gone, None)
        if old is not None:
            state.clear_swap(env.host, env.entry)
        return f"{m.name} recorded awake" + (f"; {gone}'s record goes (stopped)" if gone else "") + \
            ("; the swap has ended" if old is not None else "")

    plan.add(Action("record", f"record {m.name} as serving" + (f"; {gone}'s record goes" if gone else "")
                    + ("; the swap has ended" if old is not None else ""), run=record))
    back: list[Action] = [sleep.resleep_action(entry, inp.target, "the swap failed")]
    if old is not None:
        back.append(sleep.room_action(old.manifest, f"{m.name} asleep again"))
        if sleeps:
            back.append(sleep.wake_action(entry, old, "it serves again", marks_ready=False, cold_fallback=True,
                                          budget_s=inp.opts.budget_s))
        else:
            back += [service.start_service_action(entry, old.name, summary=f"start {old.name} with its unit"),
                     service.ready_action(old, inp.opts.budget_s, already_serving=False, marks_ready=False)]
        back.append(service.forget_swap_action(entry, f"{old.name} serves again"))
    if not going_back:
        plan.recover(first, f"put {m.name} back to sleep" + (f" and bring {old.name} back" if old else ""), back)
    return plan
