"""The multi-node deploy: one service across the selected hosts (a manifest with `multinode:`; the
first host is the head, rank 0).

    sessions on every node (the deploy locks taken in sorted host order, so two runs over the same
    nodes cannot deadlock) -> gather on every node at once (each with its own role rendered) ->
    ONE plan (orchestrator.plan.multinode) -> show or run it, each step on its node -> a history
    record on every node (with the nodes and its rank)

A wrong number of hosts, a host given twice or a node without a cluster address is bad input
(exit 2) before any host is reached (config/placement.node_roles).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import TypeVar

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.config.placement import Request, node_roles
from orchestrator.errors import ConfigError
from orchestrator.host import state
from orchestrator.host.connect import open_host
from orchestrator.host.facts import gather as host_facts
from orchestrator.host.records import HistoryEntry, NodeFields
from orchestrator.ops import gather
from orchestrator.ops.deploy import history_record, not_run, refused_record
from orchestrator.ops.execute import Ask, Reporter, run_plan
from orchestrator.ops.session import OpResult, Session, session
from orchestrator.ops.stop import recorded_nodes
from orchestrator.plan.inputs import PlanInput
from orchestrator.plan.multinode import OldService, plan_deploy_nodes, plan_swap_nodes
from orchestrator.plan.run import Options, RunEnv
from orchestrator.plan.swap import old_model_name
from orchestrator.probe.readiness import failure_fields

T = TypeVar("T")


def open_sessions(stack: ExitStack, entries: Sequence[HostEntry], operation: str, dry_run: bool,
                  accept_new_host_key: bool) -> dict[str, Session]:
    """A session on every node, entered in sorted host order (the locks too): two runs over the
    same nodes wait for each other instead of each holding one lock the other needs."""
    return {e.name: stack.enter_context(session(e, operation, dry_run, accept_new_host_key))
            for e in sorted(entries, key=lambda e: e.name)}


def parallel(entries: Sequence[HostEntry], one: Callable[[HostEntry], T]) -> list[T]:
    """one(entry) on every node at once (one thread per node, each on its own connection), in order."""
    with ThreadPoolExecutor(max_workers=len(entries), thread_name_prefix="gather") as pool:
        return list(pool.map(one, entries))


def gather_nodes(sessions: dict[str, Session], entries: Sequence[HostEntry], m: Manifest, request: Request,
                 opts: Options) -> list[PlanInput]:
    """Every node's facts at once, the service value over all of them, then every node's input, head first."""
    facts = dict(zip([e.name for e in entries],
                     parallel(entries, lambda e: gather.host_facts(sessions[e.name].host, e, m, request)), strict=True))
    spec = gather.service_spec(m, list(entries), request, facts)
    return parallel(entries, lambda e: gather.for_deploy(sessions[e.name].host, e, m, spec, opts, sessions[e.name].lock,
                                                         facts[e.name]))


def run_deploy_nodes(entries: Sequence[HostEntry], m: Manifest, opts: Options, reporter: Reporter, dry_run: bool,
                     accept_new_host_key: bool = False, ask: Ask | None = None,
                     request: Request = Request()) -> OpResult:
    """Deploy the multi-node manifest M on `entries` (its nodes, head first). `ask` as for run_deploy."""
    t0 = time.monotonic()
    roles = node_roles(m, entries)
    names = [e.name for e in entries]
    name = request.name or m.name
    with ExitStack() as stack:
        sessions = open_sessions(stack, entries, f"deploy {name}", dry_run, accept_new_host_key)
        inputs = gather_nodes(sessions, entries, m, request, opts)
        plan = plan_deploy_nodes(inputs)
        result = OpResult("deploy", ", ".join(names), name, ok=False, dry_run=dry_run, plan=plan)
        if not_run(plan, result, reporter, opts, ask, names[0]):
            if plan.refusal and not dry_run:
                for e, role in zip(entries, roles, strict=True):
                    state.append_history(sessions[e.name].host, e,
                                         HistoryEntry(**refused_record(inputs[0], plan), **NodeFields.of(role)))
            result.seconds = time.monotonic() - t0
            return result
        if not plan.changes and all(a.noop for a in plan.actions if a.step not in ("lock", "verify-same")):
            reporter.print(f"[green]{name} is already deployed and serving on {', '.join(names)}: nothing to do.[/]")
        envs = {e.name: RunEnv(sessions[e.name].host, e, opts, reporter, guard=sessions[e.name].guard)
                for e in entries}
        head = envs[names[0]]
        head.nodes = envs
        outcome = run_plan(plan, head, reporter)
        result.outcome, result.ok, result.error = outcome, outcome.ok, outcome.error
        result.seconds = time.monotonic() - t0
        record = history_record(inputs[0], plan, outcome, head, result)
        for e, inp, role in zip(entries, inputs, roles, strict=True):
            if sessions[e.name].holds_lock():              # without its lock, write nothing more there
                state.append_history(sessions[e.name].host, e, HistoryEntry(**{
                    **record, "unit_hash": inp.target.rendered.unit_hash,
                    "manifest_hash": inp.target.rendered.manifest_hash, **NodeFields.of(role)}))
        result.extra["history"] = {**record, **NodeFields.of(roles[0])}
        result.extra["nodes"] = names
        return result


def swap_source(entry: HostEntry, m: Manifest, request: Request, opts: Options,
                accept_new_host_key: bool) -> tuple[str | None, list[str]]:
    """(the service a swap to M on `entry` replaces, its nodes, head first), read before any lock
    (the locks are taken once every host is known; the planner re-reads the facts under them)."""
    name = request.name or m.name
    with open_host(entry, accept_new_host_key) as host:
        facts = host_facts(host, entry, [name])
        old = old_model_name(facts, name, entry.name, opts.replace)
        if old is None or old == name:
            return None, []
        return old, recorded_nodes(host, entry, old) or [entry.name]


def run_swap_nodes(entries: Sequence[HostEntry], m: Manifest, manifests: dict[str, Manifest], opts: Options,
                   reporter: Reporter, dry_run: bool, accept_new_host_key: bool = False, ask: Ask | None = None,
                   node_entry: Callable[[str], HostEntry | None] | None = None,
                   request: Request = Request()) -> OpResult:
    """A swap where the old or the new service spans several hosts (orchestrator.plan.multinode.
    plan_swap_nodes): `entries` are the new service's nodes (head first; one host for a one-host
    model), the old service's nodes come from its records (`node_entry` looks them up)."""
    t0 = time.monotonic()
    names = [e.name for e in entries]
    name = request.name or m.name
    old_name, old_nodes = swap_source(entries[0], m, request, opts, accept_new_host_key)
    if old_nodes and old_nodes[0] not in names:
        raise ConfigError(f"{old_name} has its head on {old_nodes[0]}, which is no node of {name} here "
                          f"({', '.join(names)}): a swap keeps the old head among the new nodes",
                          hint=f"select {old_nodes[0]} among the hosts, or stop {old_name} and deploy {name}")
    by_name = {e.name: e for e in entries}
    for n in old_nodes:
        if n not in by_name:
            found = node_entry(n) if node_entry is not None else None
            if found is None:
                raise ConfigError(f"{old_name} runs on {n} too (its records say so), which is not in the inventory")
            by_name[n] = found
    with ExitStack() as stack:
        sessions = open_sessions(stack, list(by_name.values()), f"swap to {name}", dry_run, accept_new_host_key)
        facts = dict(zip(names, parallel(entries, lambda e: gather.host_facts(sessions[e.name].host, e, m, request,
                                                                              manifests)), strict=True))
        spec = gather.service_spec(m, list(entries), request, facts)

        def one(e: HostEntry) -> PlanInput:
            s = sessions[e.name]
            if old_name and e.name in old_nodes:
                inp = gather.for_swap(s.host, e, m, request, manifests, opts, s.lock, spec=spec, facts=facts[e.name])
                if inp.old is None or inp.old.name != old_name:
                    raise ConfigError(f"{e.name} does not say {name} replaces {old_name} there "
                                      f"({inp.old.name if inp.old else 'nothing'} instead)", host=e.name,
                                      hint=f"name it: --replace {old_name}")
                return inp
            return gather.for_deploy(s.host, e, m, spec, opts, s.lock, facts[e.name])

        inputs = parallel(entries, one)
        old = None
        if old_name:
            by_input = {i.entry.name: i for i in inputs}
            head_old = by_input[old_nodes[0]].old
            if head_old is None:
                raise ConfigError(f"{old_name} has no manifest in the models folder, so it could not be rolled back to",
                                  host=old_nodes[0], hint=f"restore models/{old_name}.yaml, or stop it first")
            running = set()
            for n in old_nodes:
                f = by_input[n].facts if n in by_input else host_facts(sessions[n].host, by_name[n], [old_name])
                if (st := f.services.get(old_name)) is not None and st.active:
                    running.add(n)
            old = OldService(old_name, tuple(old_nodes), head_old, frozenset(running))
        plan = plan_swap_nodes(inputs, old, by_name, {n: s.lock for n, s in sessions.items()})
        result = OpResult("swap", ", ".join(names), name, ok=False, dry_run=dry_run, plan=plan,
                          extra=dict(plan.info))
        if not_run(plan, result, reporter, opts, ask, names[0]):
            result.seconds = time.monotonic() - t0
            return result
        envs = {n: RunEnv(sessions[n].host, e, opts, reporter, guard=sessions[n].guard) for n, e in by_name.items()}
        head = envs[names[0]]
        head.nodes = envs
        outcome = run_plan(plan, head, reporter)
        result.outcome, result.ok, result.error = outcome, outcome.ok, outcome.error
        result.seconds = time.monotonic() - t0
        stopped = [e.record.stopped_at for e in envs.values() if e.record.stopped_at is not None]
        if outcome.ok and stopped and head.record.ready_at is not None:
            result.extra["downtime_s"] = round(head.record.ready_at - min(stopped), 3)
        record = {"operation": "swap", "from": old_name, "model": spec.model, "service": name, "ok": outcome.ok,
                  "staged": True, "seconds": round(result.seconds, 2), "steps": outcome.timings(),
                  "downtime_s": result.extra.get("downtime_s"), "nodes": names, "from_nodes": old_nodes}
        record.update(failure_fields(result.error))
        if outcome.recovery is not None:
            record["rollback"] = result.extra["rollback"] = outcome.recovery.as_dict()
        for n, e in by_name.items():
            if sessions[n].holds_lock():
                rank = {"rank": names.index(n)} if n in names else {}
                state.append_history(sessions[n].host, e, HistoryEntry(**record, **rank))
        return result
