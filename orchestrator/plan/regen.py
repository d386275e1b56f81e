"""regen's planner, pure: re-render the unit and env file of every model vllm-orch installed on a
host, each with its OWN manifest and rendered files, where it is placed (a service placed by a
command line or a swap's --replace stays there; ops/gather.recorded_spec); refuse when a service
would take another's GPUs or port (a changed manifest or inventory moved it); show a unified diff
per file; install what changed; daemon-reload. Running services keep running unless --restart; then each changed, running
model is restarted through its readiness gates, and if it fails them its previous files are put
back and it is restarted again (the recovery branch of that one step). A sleeping service (sleep
mode) gets its new files but is not restarted (it would come up awake): a warning says so.
"""

from __future__ import annotations

import dataclasses

from orchestrator.errors import RefusedError
from orchestrator.plan import prepare, service, sleep
from orchestrator.plan.inputs import RegenInput
from orchestrator.plan.model import Action, Plan
from orchestrator.plan.placements import clash_refusal, host_placements, placement_of, record_warnings


def regen_clash(inp: RegenInput) -> RefusedError | None:
    """Every service keeps its place (config/placement.resolve: a placed one where it was placed), but
    a changed manifest or inventory may move one that followed them: refuse when a service that takes
    GPUs and a port now (recorded or running) would take another's, as the others are re-rendered."""
    host = inp.entry.name
    taking = {p.name for p in host_placements(inp.facts, host)}
    asleep = inp.facts.sleeping()           # stay asleep (a regen never wakes or restarts them)
    planned = {s.name: dataclasses.replace(placement_of(s, host), asleep=s.name in asleep) for s in inp.services}
    for svc in inp.services:
        if svc.name in taking:
            clash = clash_refusal(inp.facts, svc, host, planned=planned, asleep=svc.name in asleep)
            if clash is not None:
                return clash
    return None


def plan_regen(inp: RegenInput) -> Plan:
    entry, facts = inp.entry, inp.facts
    names = [s.name for s in inp.services] + inp.orphaned
    plan = Plan("regen", entry.describe(), ", ".join(sorted(names)) or "(no models installed)")
    plan.warnings += [f"{name} is installed but has no manifest now: left as it is" for name in inp.orphaned]
    plan.warnings += record_warnings(facts)
    plan.add(prepare.lock_action(inp.lock))
    clash = regen_clash(inp)
    if clash is not None:
        return plan.refuse(Action("placement", clash.message), clash)
    user = prepare.user_action(entry, facts.users)
    if not user.noop and inp.services:           # the units name the service user: it must exist
        plan.add(user)
    for svc in inp.services:        # regen writes units; only the engine step builds the venv one names
        st_engine = inp.engines.get(svc.name)
        if svc.manifest.engine is not None and (st_engine is None or not st_engine.ok):
            why = f"{st_engine.state}: {st_engine.detail}" if st_engine is not None else "not checked"
            return plan.refuse(Action("engine", f"{svc.name}'s engine venv does not verify ({why})"), RefusedError(
                f"{svc.name}'s manifest names an engine that is not built on {entry.name} ({why}): regen would "
                "install a unit that cannot start", host=entry.name, step="engine",
                hint=f"`vllm-orch swap {svc.model} --host {entry.name}` builds it first and rolls back if it "
                     "fails (an engine change is an upgrade)"))
    restarts: list[str] = []
    for svc in inp.services:
        install = plan.add(service.install_action(entry, svc, step=f"install {svc.name}"))
        st = facts.services.get(svc.name)
        # restarted when its files change, or when it still runs older files than those installed
        # (an earlier regen without --restart)
        if (install.noop and not service.runs_older_files(facts, svc)) or not (st and st.active):
            continue
        if not inp.restart:
            plan.add(Action(f"restart {svc.name}", f"nothing to do, because {svc.name} keeps running with "
                                                   f"its old settings until restarted (--restart)", noop=True))
            continue
        asleep = sleep.asleep_refusal(facts, svc.name, entry.name, "regen --restart")
        if asleep is not None:         # a restart would start it awake (beside the awake one on its GPUs)
            plan.warnings.append(f"{asleep.message}: it stays asleep with its old settings ({asleep.hint})")
            plan.add(Action(f"restart {svc.name}", f"nothing to do, because {svc.name} is asleep: it keeps its "
                                                   f"old settings until it next starts", noop=True))
            continue
        restart = plan.add(service.start_service_action(
            entry, svc.name, restart=True, step=f"restart {svc.name}",
            summary=f"restart {svc.name} with the new unit (the previous unit comes back if it fails)"))
        ready = plan.add(service.ready_action(svc, inp.opts.budget_s, already_serving=False, marks_ready=False))
        ready.step = f"ready {svc.name}"
        plan.recover(restart, f"put {svc.name}'s previous unit back and restart it", [
            service.restore_action(svc, facts.installed.get(svc.name)),
            service.start_service_action(entry, svc.name, restart=True, summary=f"restart {svc.name} "
                                         f"with its previous unit"),
            service.ready_action(svc, inp.opts.budget_s, already_serving=False, marks_ready=False)],
            last=ready)
        plan.add(service.rerecord_action(svc, step=f"record {svc.name}"))
        restarts.append(svc.name)
    plan.info["restarts"] = restarts
    return plan
