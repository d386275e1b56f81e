"""deploy's planner, pure: from nothing (or anything) to a verified, serving model.

    lock -> preflight -> disk -> download -> GPUs free -> install -> [warm, with --warm] -> start ->
    ready -> perf -> record
    if start, ready, perf (a floor the manifest says to fail on) or record fails: stop the service
    this run started (files kept), so a failed start cannot crash-loop while it holds the GPUs.

A refused safety check ends the plan before anything changes (exit 3), and so does a swap left half
done on the host (it says which swap to run). `--enable` (or a unit that already starts at boot)
is recorded in the service's record (state_dir/services/NAME.json); a swap hands it on to the new
model. A placement whose GPUs or port another service on the host takes is refused first (exit 3,
naming it): several services share a host on disjoint GPUs and ports.
"""

from __future__ import annotations

from orchestrator.errors import RefusedError
from orchestrator.host.ownership import gpu_list
from orchestrator.plan import prepare, service
from orchestrator.plan.inputs import PlanInput
from orchestrator.plan.interrupted import half_done
from orchestrator.plan.model import Action, Plan
from orchestrator.plan.placements import clash_refusal, record_warnings
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


def plan_deploy(*nodes: PlanInput) -> Plan:
    """The plan of a service over its nodes (head first; one for a one-host service)."""
    if len(nodes) > 1:
        from orchestrator.plan.multinode import plan_deploy_nodes

        return plan_deploy_nodes(list(nodes))
    inp = nodes[0]
    m, f, entry = inp.target.manifest, inp.facts, inp.entry
    plan = Plan("deploy", entry.describe(), m.name, warnings=unpinned_warning(inp) + record_warnings(f))
    plan.add(prepare.lock_action(inp.lock))
    half = half_done(f, entry.name)
    if half:
        return plan.refuse(Action("swap", half[0]), RefusedError(
            f"{half[0]}: deploy does not start anything while a swap is half done", host=entry.name,
            step="swap", hint=half[1]))
    clash = placement_refusal(inp)
    if clash:
        return plan.refuse(Action("placement", clash.message), clash)
    if plan.add_checked(*prepare.preflight_action(inp)):
        return plan
    if plan.add_checked(*prepare.disk_action(inp, keep=set())):
        return plan
    plan.add(prepare.download_action(inp))
    st = f.services.get(m.name)
    running = bool(st and st.active)
    install = service.install_action(entry, inp.target)
    unit_changed = not install.noop
    if running and not unit_changed:
        plan.add(Action("gpus", f"nothing to do, because {m.name} itself holds "
                                f"{gpu_list(m.serving.visible_devices)}", noop=True))
    elif plan.add_checked(*service.gpus_action(inp, stopping={m.name} if running else set())):
        return plan
    plan.add(prepare.user_action(entry, f.users))
    plan.add(install)
    start = service.start_action(inp, unit_changed)
    if inp.opts.warm and not start.noop:        # deploy --warm: a start after a stop reads from RAM
        warm_action, exp = warm_step(inp, prepare.model_path(entry, inp.target.model), before="the start", what="start-up")
        plan.add(warm_action)
        plan.info["expected_start_s"] = exp.as_dict()
    plan.add(start)
    recorded = (rec := f.record(m.name)) is not None and rec.unit_hash == inp.target.rendered.unit_hash
    # A running service that was never recorded (a deploy killed while waiting) goes through the
    # gates again, smoke test included, before it is recorded.
    serving = running and not unit_changed and recorded and inp.target.serving
    plan.add(service.ready_action(inp.target, inp.opts.budget_s, serving))
    plan.add(service.perf_action(inp, already_serving=serving))
    if serving:
        plan.add(Action("record", f"nothing to do, because {m.name} is recorded as active with these hashes",
                        noop=True))
    else:
        plan.add(service.record_action(inp, enabled=inp.opts.enable or service.enabled_at_boot(f, m.name)))
    if not start.noop:
        plan.recover(start, f"stop {m.name} so a failed start cannot hold the GPUs (model files kept)",
                     [service.stop_action(entry, m.name, "it failed to become ready", only_if_started=True,
                                          drain=False)])
    return plan
