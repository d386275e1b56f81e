"""The multi-node deploy's planner, pure: one service across several hosts (a manifest with
`multinode:`), from the facts of every node, as ONE plan whose steps name the node they run on.

    lock per node -> preflight per node (the node's own argv through its vLLM's parser) -> disk per
    node -> download on all nodes in parallel -> verify-same (every node's verified record: the same
    commit, the same sha256 of every file) -> GPUs free per node -> user, install per node ->
    start the workers (rank > 0), then the head -> ready at the head, following every node's log ->
    perf at the head -> record on every node
    if a start, the readiness wait, perf (a floor to fail on) or a record fails: stop the service on
    every node this run started it on (workers, then the head; model files kept).

The per-node steps are the single-node deploy's own (plan/prepare.py, plan/service.py) built from
each node's PlanInput and tagged with its node (Action.node), so a node's step runs with that node's
host and lock (ops/execute.py). A refusal on any node ends the plan before anything changes. The
nodes start together or not at all: when any node's files change or its service is not running,
every node (re)starts, since a restarted rank takes the others down with it (vLLM's ranks die when a
peer's connection drops).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from orchestrator.config.inventory import HostEntry
from orchestrator.errors import DeployFailed, OrchestratorError, RefusedError
from orchestrator.host import modeldirs, state
from orchestrator.host.ownership import gpu_list
from orchestrator.plan import prepare, service
from orchestrator.plan.deploy import placement_refusal, unpinned_warning
from orchestrator.plan.inputs import LockFacts, PlanInput, ServiceInput
from orchestrator.plan.interrupted import half_done
from orchestrator.plan.model import Action, Plan
from orchestrator.plan.placements import clash_refusal
from orchestrator.plan.run import RunEnv


def on(node: str, action: Action) -> Action:
    """The action, run on one node."""
    action.node = node
    return action


def checked_on(node: str, pair: tuple[Action, RefusedError | None]) -> tuple[Action, RefusedError | None]:
    action, refusal = pair
    return on(node, action), refusal


def no_warm_warning(inp: PlanInput) -> list[str]:
    """--warm (swap's default) is a one-host step: say that a plan across nodes does not warm."""
    return ["the page cache is not warmed across nodes: each node loads its weights from disk"] if inp.opts.warm \
        else []


def nodes_desc(inputs: Sequence[PlanInput]) -> str:
    """`gpu1 (head), gpu2 (rank 1)`: the plan's hosts, head first."""
    return ", ".join(f"{i.entry.name} ({'head' if n == 0 else f'rank {n}'})" for n, i in enumerate(inputs))


# -- the same weights on every node ----------------------------------------------------------------

def weights_fingerprint(record: Mapping | None) -> tuple[str | None, dict[str, tuple]] | None:
    """What must be equal on every node: the resolved commit and every file's size and hash (sha256
    for LFS files, the git blob id for small ones), from the node's .vllm-orch/verified.json. None:
    no complete record."""
    if not isinstance(record, Mapping) or not record.get("complete"):
        return None
    files = record.get("files") if isinstance(record.get("files"), Mapping) else {}
    assert isinstance(files, Mapping)
    return record.get("commit") or record.get("revision"), {
        str(name): (f.get("size"), f.get("sha256") or f.get("blob_id")) for name, f in files.items()
        if isinstance(f, Mapping)}


def weights_differ(records: Mapping[str, Mapping | None], head: str) -> tuple[str, str] | None:
    """(node, why) for the first node whose verified weights differ from the head's; None when all
    are the same. `records`: each node's verified.json (None: missing or unreadable)."""
    prints = {n: weights_fingerprint(r) for n, r in records.items()}
    base = prints.get(head)
    if base is None:
        return head, "has no complete verified record of the model (.vllm-orch/verified.json)"
    for node, got in prints.items():
        if node == head:
            continue
        if got is None:
            return node, "has no complete verified record of the model (.vllm-orch/verified.json)"
        if got[0] != base[0]:
            return node, f"holds commit {str(got[0])[:12]}, the head {head} holds {str(base[0])[:12]}"
        names = sorted(set(got[1]) | set(base[1]))
        wrong = [n for n in names if got[1].get(n) != base[1].get(n)]
        if wrong:
            return node, (f"{len(wrong)} file{'s' if len(wrong) != 1 else ''} differ{'s' if len(wrong) == 1 else ''} "
                          f"from the head {head}'s: " + ", ".join(wrong[:3]) + (", ..." if len(wrong) > 3 else ""))
    return None


def verify_same_action(inputs: Sequence[PlanInput]) -> tuple[Action, RefusedError | None]:
    """Every node's verified record names the same commit and the same hash of every file, checked
    after the downloads and before any start. Refused at plan time already when the nodes resolve
    the revision to different commits (a node behind another mirror, a branch that moved)."""
    head, m, model = inputs[0], inputs[0].target.manifest, inputs[0].target.model
    names = [i.entry.name for i in inputs]
    planned = {i.entry.name: i.download.commit for i in inputs if i.download is not None and i.download.commit}
    base = planned.get(head.entry.name)
    for node, commit in planned.items():
        if base is not None and commit != base:
            err = RefusedError(f"{m.source.repo}@{m.source.revision} resolves to commit {commit[:12]} on {node} but "
                               f"{base[:12]} on the head {head.entry.name}: the nodes would load different weights",
                               host=node, step="verify-same",
                               hint="pin source.revision to a commit, or make every node reach the same Hub")
            return Action("verify-same", f"{node} would download other weights than the head"), err
    path = modeldirs.RECORD

    def run(env: RunEnv) -> str:
        records = {}
        for n in names:
            e = env.nodes[n]
            records[n] = state.read_json(e.host, f"{prepare.model_path(e.entry, model)}/{path}")
        differs = weights_differ(records, names[0])
        if differs is not None:
            bad, why = differs
            raise DeployFailed(f"{bad} {why}: the nodes must load the same weights", host=bad,
                               step="verify-same",
                               hint=f"delete {model} on {bad} (`vllm-orch gc --host {bad}`) and deploy again")
        fp = weights_fingerprint(records[names[0]])
        assert fp is not None
        return f"{len(names)} nodes hold commit {str(fp[0])[:12]}, {len(fp[1])} files with the same hashes"

    return Action("verify-same", f"check that {', '.join(names)} hold the same commit and the same sha256 of "
                                 f"every file ({path} of each), before any start", run=run), None


# -- downloads on all nodes at once ----------------------------------------------------------------

def download_all_action(inputs: Sequence[PlanInput]) -> Action:
    """Each node's download step (plan/prepare.py), all of them at once: one thread per node."""
    per = [(i.entry.name, prepare.download_action(i)) for i in inputs]
    todo = [(n, a) for n, a in per if not a.noop]
    details: list[str] = []
    for n, a in per:
        details += [f"{n}: {line}" for line in a.lines()]
    if not todo:
        return Action("download", f"nothing to do, because every node ({len(per)}) has the model downloaded and "
                                  f"verified", noop=True, details=details)

    def run(env: RunEnv) -> str:
        outcomes: dict[str, str | BaseException] = {}

        def one(node: str, action: Action) -> None:
            assert action.run is not None
            try:        # each node's download quiet: one live progress bar per node would fight over the terminal
                outcomes[node] = action.run(dataclasses.replace(env.nodes[node], reporter=None)) or ""
            except BaseException as exc:        # handed to the caller's thread below
                outcomes[node] = exc

        # Daemon threads: an interrupt ends the run at once (the downloads end with their connections)
        # instead of vllm-orch waiting at exit for every node's download to finish.
        threads = [threading.Thread(target=one, args=(n, a), name=f"download-{n}", daemon=True) for n, a in todo]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done = [f"{n}: {outcomes[n]}" for n, _ in todo if isinstance(outcomes.get(n), str)]
        errors = [(n, e) for n, _ in todo if isinstance(e := outcomes.get(n), BaseException)]
        for n, exc in errors:
            if not isinstance(exc, OrchestratorError):
                raise exc
            exc.host = exc.host or n
        if errors:
            first = errors[0][1]
            assert isinstance(first, OrchestratorError)
            first.details = first.details + [str(e) for _, e in errors[1:]] + done
            raise first
        return "; ".join(done)

    return Action("download", f"fetch on {', '.join(n for n, _ in todo)} in parallel (every node downloads and "
                              f"verifies its own copy)", details=details, run=run)


# -- the plan --------------------------------------------------------------------------------------

def plan_deploy_nodes(inputs: list[PlanInput]) -> Plan:
    """inputs: one PlanInput per node, head first, each with its node's role rendered
    (target.rendered.role)."""
    head = inputs[0]
    m = head.target.manifest
    names = [i.entry.name for i in inputs]
    plan = Plan("deploy", nodes_desc(inputs), m.name, warnings=unpinned_warning(head) + no_warm_warning(head))
    for i in inputs:
        plan.add(on(i.entry.name, prepare.lock_action(i.lock)))
    for i in inputs:
        node = i.entry.name
        half = half_done(i.facts, node)
        if half:
            return plan.refuse(on(node, Action("swap", half[0])), RefusedError(
                f"{half[0]}: deploy does not start anything while a swap is half done", host=node,
                step="swap", hint=half[1]))
        clash = placement_refusal(i)
        if clash:
            return plan.refuse(on(node, Action("placement", clash.message)), clash)
    refusals = []
    for i in inputs:
        action, refusal = checked_on(i.entry.name, prepare.preflight_action(i))
        plan.add(action)
        if refusal is not None:
            refusals.append(refusal)
    if refusals:
        first = refusals[0]
        first.details = first.details + [str(r) for r in refusals[1:]]
        plan.refusal = first
        return plan
    for i in inputs:
        if plan.add_checked(*checked_on(i.entry.name, prepare.disk_action(i, keep=set()))):
            return plan
    plan.add(download_all_action(inputs))
    if plan.add_checked(*verify_same_action(inputs)):
        return plan
    running = {i.entry.name: bool((st := i.facts.services.get(m.name)) and st.active) for i in inputs}
    installs = [on(i.entry.name, service.install_action(i.entry, i.target)) for i in inputs]
    # One node's new files or stopped service restarts them all, together: a rank cannot rejoin a
    # running group, and a new rank must not meet the old head's rendezvous. So every running node
    # stops first (the head first: it stops serving), and all start again, workers before the head.
    restart = any(not a.noop for a in installs) or not all(running.values())
    if restart:
        for i in [head, *inputs[1:]]:
            if running[i.entry.name]:
                plan.add(on(i.entry.name, service.stop_action(i.entry, m.name, "every node restarts together")))
    for i in inputs:
        node = i.entry.name
        if running[node] and not restart:
            plan.add(on(node, Action("gpus", f"nothing to do, because {m.name} itself holds "
                                             f"{gpu_list(i.target.manifest.serving.visible_devices)}", noop=True)))
        elif plan.add_checked(*checked_on(node, service.gpus_action(i, stopping={m.name} if running[node] else set()))):
            return plan
    for i in inputs:
        plan.add(on(i.entry.name, prepare.user_action(i.entry, i.facts.users)))
    for a in installs:
        plan.add(a)
    starts = []
    for rank, i in [*enumerate(inputs)][1:] + [(0, head)]:
        what = "the head: the API server, after its workers" if rank == 0 else f"rank {rank}, headless"
        boot = " and enable it at boot" if i.opts.enable else ""
        starts.append(on(i.entry.name, service.start_service_action(i.entry, m.name, enable=i.opts.enable,
                                                                    summary=f"start {m.name} ({what}){boot}")
                         if restart else service.start_action(i, False)))
    for a in starts:
        plan.add(a)
    recorded = all((rec := i.facts.record(m.name)) is not None and rec.unit_hash == i.target.rendered.unit_hash
                   for i in inputs)
    serving = not restart and recorded and head.target.serving
    plan.add(on(head.entry.name, service.ready_action(head.target, head.opts.budget_s, serving, workers=names[1:])))
    plan.add(on(head.entry.name, service.perf_action(head, already_serving=serving)))
    enabled = head.opts.enable or service.enabled_at_boot(head.facts, m.name)
    for i in inputs:
        if serving:
            plan.add(on(i.entry.name, Action("record", f"nothing to do, because {m.name} is recorded as active "
                                                       f"with these hashes", noop=True)))
        else:
            plan.add(on(i.entry.name, service.record_action(i, enabled=enabled)))
    first_start = next((a for a in starts if not a.noop), None)
    if first_start is not None:
        plan.recover(first_start, f"stop {m.name} on every node it was started on, so a failed start cannot hold "
                                  f"their GPUs (model files kept)",
                     [on(i.entry.name, service.stop_action(i.entry, m.name, "it failed to become ready",
                                                           only_if_started=True, drain=False))
                      for i in [*inputs[1:], head]])
    return plan


# -- a swap between a one-node and a multi-node service --------------------------------------------

@dataclass(frozen=True)
class OldService:
    """The service a multi-node swap replaces: its name, its nodes (head first; one for a one-host
    service) and, on the head, how it serves (its manifest and files: the rollback's gates)."""

    name: str
    nodes: tuple[str, ...]
    head: ServiceInput
    running: frozenset[str]                     # the nodes it runs on now


def plan_swap_nodes(inputs: list[PlanInput], old: OldService | None, entries: Mapping[str, HostEntry],
                    locks: Mapping[str, LockFacts]) -> Plan:
    """A swap whose old or new service (or both) spans several hosts: the new one is downloaded,
    verified identical and installed on all its nodes while the old one serves; then the old one
    stops on every node it runs on, the new one starts (workers, then the head) and must pass its
    gates at its head. From the old one's stop on, a failure rolls back: the new one stops on every
    node, the old one starts again on every node (workers first) and must pass its gates.

    inputs: one per node of the new service, head first (target rendered with the node's role;
    `old` set on the nodes the old service runs on). entries/locks: every host the swap touches (the
    old service's nodes too), by name. The old service's head must be a node of the new one (its
    swap record, swap.json, is kept there)."""
    head = inputs[0]
    m = head.target.manifest
    names = [i.entry.name for i in inputs]
    old_name = old.name if old is not None else None
    plan = Plan("swap", nodes_desc(inputs) if len(inputs) > 1 else head.entry.describe(),
                f"{old_name or '(nothing)'} -> {m.name}", warnings=unpinned_warning(head) + no_warm_warning(head),
                info={"from": old_name, "to": m.name, "staged": True, "nodes": names})
    hosts = names + [n for n in (old.nodes if old else ()) if n not in names]
    for n in hosts:
        plan.add(on(n, prepare.lock_action(locks[n])))
    for i in inputs:
        node = i.entry.name
        replacing = {old_name} if old_name and i.old is not None else set()
        clash = clash_refusal(i.facts, i.target, node, replacing=replacing)
        if clash:
            return plan.refuse(on(node, Action("placement", clash.message)), clash)
        half = half_done(i.facts, node)
        if half:
            return plan.refuse(on(node, Action("swap", half[0])), RefusedError(
                f"{half[0]}: finish or undo it first", host=node, step="swap", hint=half[1]))
    refusals = []
    for i in inputs:
        action, refusal = checked_on(i.entry.name, prepare.preflight_action(i))
        plan.add(action)
        if refusal is not None:
            refusals.append(refusal)
    if refusals:
        refusals[0].details = refusals[0].details + [str(r) for r in refusals[1:]]
        plan.refusal = refusals[0]
        return plan
    for i in inputs:
        keep = {i.old.name, i.old.model} if i.old is not None else set()
        action, refusal = checked_on(i.entry.name, prepare.disk_action(i, keep=keep))
        if refusal is not None:
            refusal.hint = (refusal.hint or "") + "; a swap across nodes always stages (free space, or stop " \
                                                  "the old service and deploy)"
        if plan.add_checked(action, refusal):
            return plan
    plan.add(download_all_action(inputs))
    if len(inputs) > 1 and plan.add_checked(*verify_same_action(inputs)):
        return plan
    for i in inputs:
        plan.add(on(i.entry.name, prepare.user_action(i.entry, i.facts.users)))
    for i in inputs:
        plan.add(on(i.entry.name, service.install_action(i.entry, i.target)))
    stops: list[Action] = []
    if old is not None:
        for n in [o for o in old.nodes if o in old.running]:
            first = not stops
            stops.append(plan.add(on(n, service.stop_action(
                entries[n], old.name, "downtime starts" if first else "with its head",
                downtime_starts=first, swap_to=m.name if n == old.nodes[0] else None))))
    for i in inputs:
        stopping = {old_name} if old_name and i.old is not None else set()
        if plan.add_checked(*checked_on(i.entry.name, service.gpus_action(i, stopping=stopping))):
            return plan
    starts = []
    for rank, i in [*enumerate(inputs)][1:] + [(0, head)]:
        what = "" if len(inputs) == 1 else (" (the head, after its workers)" if rank == 0 else f" (rank {rank}, headless)")
        starts.append(plan.add(on(i.entry.name, service.start_service_action(
            i.entry, m.name, restart=bool((st := i.facts.services.get(m.name)) and st.active),
            summary=f"start {m.name}{what}"))))
    plan.add(on(head.entry.name, service.ready_action(head.target, head.opts.budget_s, False, workers=names[1:])))
    plan.add(on(head.entry.name, service.perf_action(head)))
    swap_host = old.nodes[0] if old is not None else None
    for i in inputs:
        n = i.entry.name
        plan.add(on(n, service.record_action(i, enabled=i.opts.enable, ends_swap=n == swap_host,
                                             replaces=old_name if i.old is not None else None)))
    if old is not None:
        for n in old.nodes:
            if n not in names:
                plan.add(on(n, forget_record_action(entries[n], old.name)))
    if old is not None and stops:
        plan.recover(stops[0], f"roll back to {old.name} on {', '.join(old.nodes)}",
                     swap_back_actions(inputs, old, entries))
    elif starts:
        plan.recover(starts[0], f"stop {m.name} on every node it was started on (model files kept)",
                     [on(i.entry.name, service.stop_action(i.entry, m.name, "it failed to become ready",
                                                           only_if_started=True, drain=False))
                      for i in [*inputs[1:], head]])
    return plan


def forget_record_action(entry: HostEntry, name: str) -> Action:
    """A node of the old service that is no node of the new one: its record of the old one goes."""
    def run(env: RunEnv) -> str:
        state.write_record(env.host, env.entry, name, None)
        return f"removed {name}'s record"

    return Action("record", f"remove {name}'s record (this host is no node of the new service)", run=run)


def swap_back_actions(inputs: Sequence[PlanInput], old: OldService, entries: Mapping[str, HostEntry]) -> list[Action]:
    """The rollback: the new service stops on every node, the old one starts again on every node it
    ran on (workers first), passes its gates at its head, and the swap record goes."""
    m = inputs[0].target.manifest
    out = [on(i.entry.name, service.stop_action(i.entry, m.name, "the swap failed", only_if_started=True,
                                                drain=False)) for i in [*inputs[1:], inputs[0]]]
    gpus = old.head.manifest.serving.visible_devices
    for n in old.nodes:
        if n in old.running:
            out.append(on(n, service.release_action(gpus, f"for {old.name}")))
    for n in [*old.nodes[1:], old.nodes[0]]:
        if n in old.running:
            out.append(on(n, service.start_service_action(entries[n], old.name,
                                                          summary=f"start {old.name} with its previous unit")))
    out.append(on(old.nodes[0], service.ready_action(old.head, inputs[0].opts.budget_s, False, marks_ready=False,
                                                     workers=[n for n in old.nodes[1:] if n in old.running])))
    out.append(on(old.nodes[0], service.forget_swap_action(entries[old.nodes[0]], f"{old.name} serves again")))
    return out
