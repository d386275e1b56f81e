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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.config.placement import NodeRole, node_roles
from orchestrator.host import state
from orchestrator.ops import gather
from orchestrator.ops.deploy import history_record, not_run, refused_record
from orchestrator.ops.execute import Ask, Reporter, run_plan
from orchestrator.ops.session import OpResult, Session, session
from orchestrator.plan.inputs import PlanInput
from orchestrator.plan.multinode import plan_deploy_nodes
from orchestrator.plan.run import Options, RunEnv
from orchestrator.plan.service import node_fields


def open_sessions(stack: ExitStack, entries: Sequence[HostEntry], operation: str, dry_run: bool,
                  accept_new_host_key: bool) -> dict[str, Session]:
    """A session on every node, entered in sorted host order (the locks too): two runs over the
    same nodes wait for each other instead of each holding one lock the other needs."""
    return {e.name: stack.enter_context(session(e, operation, dry_run, accept_new_host_key))
            for e in sorted(entries, key=lambda e: e.name)}


def gather_nodes(sessions: dict[str, Session], entries: Sequence[HostEntry], roles: Sequence[NodeRole],
                 m: Manifest, opts: Options) -> list[PlanInput]:
    """Every node's facts at once (one thread per node, each on its own connection), head first."""
    def one(pair: tuple[HostEntry, NodeRole]) -> PlanInput:
        e, role = pair
        s = sessions[e.name]
        return gather.for_deploy(s.host, e, m, opts, s.lock, role=role)

    with ThreadPoolExecutor(max_workers=len(entries), thread_name_prefix="gather") as pool:
        return list(pool.map(one, zip(entries, roles, strict=True)))


def run_deploy_nodes(entries: Sequence[HostEntry], m: Manifest, opts: Options, reporter: Reporter, dry_run: bool,
                     accept_new_host_key: bool = False, ask: Ask | None = None) -> OpResult:
    """Deploy the multi-node manifest M on `entries` (its nodes, head first). `ask` as for run_deploy."""
    t0 = time.monotonic()
    roles = node_roles(m, entries)
    names = [e.name for e in entries]
    with ExitStack() as stack:
        sessions = open_sessions(stack, entries, f"deploy {m.name}", dry_run, accept_new_host_key)
        inputs = gather_nodes(sessions, entries, roles, m, opts)
        plan = plan_deploy_nodes(inputs)
        result = OpResult("deploy", ", ".join(names), m.name, ok=False, dry_run=dry_run, plan=plan)
        if not_run(plan, result, reporter, opts, ask, names[0]):
            if plan.refusal and not dry_run:
                for e, role in zip(entries, roles, strict=True):
                    state.append_history(sessions[e.name].host, e, {**refused_record(m, plan), **node_fields(role)})
            result.seconds = time.monotonic() - t0
            return result
        if not plan.changes and all(a.noop for a in plan.actions if a.step not in ("lock", "verify-same")):
            reporter.print(f"[green]{m.name} is already deployed and serving on {', '.join(names)}: nothing to do.[/]")
        envs = {e.name: RunEnv(sessions[e.name].host, e, opts, reporter, guard=sessions[e.name].guard)
                for e in entries}
        head = envs[names[0]]
        head.nodes = envs
        outcome = run_plan(plan, head, reporter)
        result.outcome, result.ok, result.error = outcome, outcome.ok, outcome.error
        result.seconds = time.monotonic() - t0
        record = history_record(m, inputs[0], plan, outcome, head, result)
        for e, inp, role in zip(entries, inputs, roles, strict=True):
            if sessions[e.name].holds_lock():              # without its lock, write nothing more there
                state.append_history(sessions[e.name].host, e, {
                    **record, "unit_hash": inp.target.rendered.unit_hash,
                    "manifest_hash": inp.target.rendered.manifest_hash, **node_fields(role)})
        result.extra["history"] = {**record, **node_fields(roles[0])}
        result.extra["nodes"] = names
        return result
