"""deploy's planner, pure: from nothing (or anything) to a verified, serving service over its
nodes: one host, or the hosts of a multi-node service (a manifest with `multinode:`), as ONE plan
whose steps name the node they run on when there are several (Action.node; a one-host plan's steps
name none).

    lock -> preflight -> disk -> download (every node at once) -> verify-same (several nodes: the
    same commit and sha256 of every file on each) -> GPUs free -> user -> install -> [warm, with
    --warm: each node its own page cache] -> start (the workers, then the head) -> ready (at the
    head, following every node's log) -> perf -> record (on every node)
    if a start, ready, perf (a floor the manifest says to fail on) or a record fails: stop the
    service on every node this run started it on (workers, then the head; files kept), so a failed
    start cannot crash-loop while it holds the GPUs.

A refused safety check on any node ends the plan before anything changes (exit 3), and so does a
swap left half done (it says which swap to run), and a sleeping service's deploy with other files
than it sleeps with (its restart would bring it up awake beside the awake one: `swap` wakes it);
with the same files there is nothing to do. `--enable` (or a unit that already starts at boot)
is recorded in the service's record (state_dir/services/NAME.json); a swap hands it on to the new
service. A placement whose GPUs or port another service on the host takes is refused first (exit 3,
naming it): several services share a host on disjoint GPUs and ports. The nodes of a multi-node
service start together or not at all: when any node's files change or its service is not running,
every node (re)starts, since a restarted rank takes the others down with it (vLLM's ranks die when
a peer's connection drops).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from orchestrator.errors import RefusedError
from orchestrator.host.ownership import gpu_list
from orchestrator.plan import prepare, service, sleep
from orchestrator.plan.engine import engine_action
from orchestrator.plan.inputs import PlanInput
from orchestrator.plan.interrupted import half_done
from orchestrator.plan.model import Action, Plan
from orchestrator.plan.multinode import download_all_action, nodes_desc, on, verify_same_action
from orchestrator.plan.placements import clash_refusal, name_refusal, record_warnings
from orchestrator.plan.warm import warm_step


def unpinned_warning(inp: PlanInput) -> list[str]:
    src = inp.target.manifest.source
    if src.pinned:
        return []
    return [f"source.revision is {src.revision!r}, not a commit: the weights may change between "
            f"downloads (the resolved commit is recorded)"]


def placement_refusal(inp: PlanInput) -> RefusedError | None:
    """Another service on the host takes this placement's GPUs or port (plan/placements.py)."""
    return clash_refusal(inp.facts, inp.target, inp.entry.name)


def tagger(nodes: Sequence[PlanInput]) -> Callable[[str, Action], Action]:
    """How a plan over these nodes names a step's node: not at all on one host (its plan text is
    the one-host plan's), else Action.node."""
    return (lambda _node, action: action) if len(nodes) == 1 else on


def preflights(plan: Plan, nodes: Sequence[PlanInput], tag: Callable[[str, Action], Action]) -> bool:
    """Every node's preflight step; True (stop planning) when any refused, with every refusal named."""
    refusals = []
    for i in nodes:
        action, refusal = prepare.preflight_action(i)
        plan.add(tag(i.entry.name, action))
        if refusal is not None:
            refusals.append(refusal)
    if refusals:
        refusals[0].details = refusals[0].details + [str(r) for r in refusals[1:]]
        plan.refusal = refusals[0]
    return bool(refusals)


def hosts_desc(nodes: Sequence[PlanInput]) -> str:
    return nodes[0].entry.describe() if len(nodes) == 1 else nodes_desc(nodes)


def plan_deploy(*nodes: PlanInput) -> Plan:
    """The plan of a service over its nodes: one PlanInput per node, head first, each with its
    node's role rendered (one for a one-host service)."""
    head = nodes[0]
    m, entry = head.target.manifest, head.entry
    tag, one = tagger(nodes), len(nodes) == 1
    names = [i.entry.name for i in nodes]
    plan = Plan("deploy", hosts_desc(nodes), m.name,
                warnings=unpinned_warning(head) + [w for i in nodes for w in record_warnings(i.facts)])
    for i in nodes:
        plan.add(tag(i.entry.name, prepare.lock_action(i.lock)))
    for i in nodes:
        half = half_done(i.facts, i.entry.name)
        if half:
            return plan.refuse(tag(i.entry.name, Action("swap", half[0])), RefusedError(
                f"{half[0]}: deploy does not start anything while a swap is half done", host=i.entry.name,
                step="swap", hint=half[1]))
        # a sleeping service is deployed: with these files nothing to do, with others a (re)start would
        # bring it up awake (beside the awake one on its GPUs): refused, with the swap that wakes it
        asleep = sleep.asleep_refusal(i.facts, m.name, i.entry.name, "deploy")
        if asleep and one and not service.runs_older_files(i.facts, i.target) and \
                service.install_action(i.entry, i.target).noop:
            plan.add(Action("sleep", f"nothing to do, because {m.name} is asleep with these files "
                                     f"(`vllm-orch swap {m.name} --host {i.entry.name}` wakes it)", noop=True))
            return plan
        if asleep:
            return plan.refuse(tag(i.entry.name, Action("sleep", asleep.message)), asleep)
        clash = name_refusal(i.facts, i.target, i.entry.name) or placement_refusal(i)
        if clash:
            return plan.refuse(tag(i.entry.name, Action("placement", clash.message)), clash)
    if preflights(plan, nodes, tag):
        return plan
    for i in nodes:
        if plan.add_checked(*checked(tag, i.entry.name, prepare.disk_action(i, keep=set()))):
            return plan
    plan.add(prepare.download_action(head) if one else download_all_action(nodes))
    if not one and plan.add_checked(*verify_same_action(nodes)):
        return plan
    engines(plan, nodes, tag)
    running = {i.entry.name: bool((st := i.facts.services.get(m.name)) and st.active) for i in nodes}
    installs = [tag(i.entry.name, service.install_action(i.entry, i.target)) for i in nodes]
    # Any node's new files or stopped service restarts them all, together: a rank cannot rejoin a
    # running group, and a new rank must not meet the old head's rendezvous. So every running node
    # stops first (the head first: it stops serving), and all start again, workers before the head.
    # One host restarts its own service in its start step.
    changed = any(not a.noop for a in installs) or (not one and not all(running.values())) or \
        any(service.runs_older_files(i.facts, i.target) for i in nodes)
    if changed and not one:
        for i in nodes:
            if running[i.entry.name]:
                plan.add(on(i.entry.name, service.stop_action(i.entry, m.name, "every node restarts together")))
    for i in nodes:
        node = i.entry.name
        if running[node] and not changed:
            plan.add(tag(node, Action("gpus", f"nothing to do, because {m.name} itself holds "
                                              f"{gpu_list(i.target.manifest.serving.visible_devices)}", noop=True)))
        elif plan.add_checked(*checked(tag, node, service.gpus_action(i, stopping={m.name} if running[node]
                                                                      else set()))):
            return plan
    for i in nodes:
        plan.add(tag(i.entry.name, prepare.user_action(i.entry, i.facts.users)))
    for a in installs:
        plan.add(a)
    starts = start_actions(nodes, changed, tag)
    warm_before(plan, nodes, starts, tag, before="the start", what="start-up")
    for a in starts:
        plan.add(a)
    recorded = all((rec := i.facts.record(m.name)) is not None and rec.unit_hash == i.target.rendered.unit_hash
                   for i in nodes)
    # A running service that was never recorded (a deploy killed while waiting) goes through the
    # gates again, smoke test included, before it is recorded.
    serving = not changed and all(running.values()) and recorded and head.target.serving
    plan.add(tag(entry.name, service.ready_action(head.target, head.opts.budget_s, serving, workers=names[1:])))
    plan.add(tag(entry.name, service.perf_action(head, already_serving=serving)))
    enabled = head.opts.enable or service.enabled_at_boot(head.facts, m.name)
    for i in nodes:
        if serving:
            plan.add(tag(i.entry.name, Action("record", f"nothing to do, because {m.name} is recorded as active "
                                                        f"with these hashes", noop=True)))
        else:
            plan.add(tag(i.entry.name, service.record_action(i, enabled=enabled)))
    first = next((a for a in starts if not a.noop), None)
    if first is not None:
        plan.recover(first, stop_title(m.name, one), stop_everywhere(nodes, tag))
    return plan


def engines(plan: Plan, nodes: Sequence[PlanInput], tag: Callable[[str, Action], Action]) -> None:
    """Each node's engine venv (a manifest with `engine:`, plan/engine.py), built before anything stops."""
    for i in nodes:
        action = engine_action(i)
        if action is not None:
            plan.add(tag(i.entry.name, action))


def checked(tag: Callable[[str, Action], Action], node: str,
            pair: tuple[Action, RefusedError | None]) -> tuple[Action, RefusedError | None]:
    action, refusal = pair
    return tag(node, action), refusal


def start_actions(nodes: Sequence[PlanInput], changed: bool, tag: Callable[[str, Action], Action]) -> list[Action]:
    """The service's start on every node, the workers before the head (the head's API server waits
    for them). One host: started, restarted when its unit changed, or nothing to do."""
    if len(nodes) == 1:
        return [service.start_action(nodes[0], changed)]
    m = nodes[0].target.manifest
    out = []
    for rank, i in [*enumerate(nodes)][1:] + [(0, nodes[0])]:
        what = "the head: the API server, after its workers" if rank == 0 else f"rank {rank}, headless"
        boot = " and enable it at boot" if i.opts.enable else ""
        running = bool((st := i.facts.services.get(m.name)) and st.active)
        out.append(tag(i.entry.name, service.start_service_action(i.entry, m.name, enable=i.opts.enable,
                                                                  restart=running,
                                                                  summary=f"start {m.name} ({what}){boot}")
                       if changed else service.start_action(i, False)))
    return out


def warm_before(plan: Plan, nodes: Sequence[PlanInput], starts: Sequence[Action],
                tag: Callable[[str, Action], Action], *, before: str, what: str,
                reserve: tuple[int, str] | None = None) -> None:
    """With --warm: each node whose service starts reads its own copy of the weights into its page
    cache first (plan/warm.py), before `before`; the plan's expectation is the head's. A swap
    shows the step (and its expected downtime) with warming off too; a deploy only with --warm."""
    if not nodes[0].opts.warm and what != "downtime":
        return
    by_node = {a.node: a for a in starts}
    for i in nodes:
        start = by_node.get(i.entry.name if len(nodes) > 1 else None)
        if start is None or start.noop:
            continue
        action, exp = warm_step(i, prepare.model_path(i.entry, i.target.folder), before=before, what=what,
                                reserve=reserve if i is nodes[0] else None)
        plan.add(tag(i.entry.name, action))
        if i is nodes[0]:
            plan.info["expected_start_s" if what == "start-up" else "expected_downtime_s"] = exp.as_dict()


def stop_title(name: str, one: bool) -> str:
    return (f"stop {name} so a failed start cannot hold the GPUs (model files kept)" if one else
            f"stop {name} on every node it was started on, so a failed start cannot hold their GPUs "
            f"(model files kept)")


def stop_everywhere(nodes: Sequence[PlanInput], tag: Callable[[str, Action], Action]) -> list[Action]:
    """Stop the service on every node this run started it on: the workers, then the head."""
    m = nodes[0].target.manifest
    return [tag(i.entry.name, service.stop_action(i.entry, m.name, "it failed to become ready", only_if_started=True,
                                                  drain=False)) for i in [*nodes[1:], nodes[0]]]
