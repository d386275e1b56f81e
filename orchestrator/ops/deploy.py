"""deploy: sessions on the service's nodes (one host, or the hosts of a multi-node service) ->
gather on every node at once -> ONE plan (orchestrator.plan.deploy) -> show or run it, each step on
its node -> a history record on every node (with the nodes and its rank).

A refused safety check stops before anything changes (exit 3). A start that fails its readiness
gates is stopped again by the plan's recovery branch, so it cannot crash-loop holding the GPUs
(exit 1). A wrong number of hosts for a multi-node model, a host given twice or a node without a
cluster address is bad input (exit 2) before any host is reached (config/placement.node_roles).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.config.placement import Request, node_roles
from orchestrator.errors import Interrupted
from orchestrator.host import state
from orchestrator.host.records import HistoryEntry, NodeFields
from orchestrator.ops import gather
from orchestrator.ops.execute import Ask, Reporter, RunOutcome, confirmation, run_plan
from orchestrator.ops.nodes import as_nodes, node_envs, open_sessions, parallel
from orchestrator.ops.session import OpResult
from orchestrator.plan import gateway
from orchestrator.plan.deploy import plan_deploy
from orchestrator.plan.engine import service_vllm_version
from orchestrator.plan.inputs import PlanInput
from orchestrator.plan.model import Plan
from orchestrator.plan.run import Options, RunEnv
from orchestrator.plan.warm import history_fields
from orchestrator.probe.readiness import failure_fields


def run_deploy(nodes: HostEntry | Sequence[HostEntry], m: Manifest, opts: Options, reporter: Reporter, dry_run: bool,
               accept_new_host_key: bool = False, ask: Ask | None = None, request: Request = Request()) -> OpResult:
    """Deploy model M as the service `request` names (--name, --gpus, --port; default: M's own
    service, kept where an earlier run placed it) on its nodes (head first; one host for a one-host
    model). `ask` (a terminal's yes/no question) is put when the plan deletes model folders and
    opts.yes is not set; without it such a plan is refused."""
    t0 = time.monotonic()
    entries = as_nodes(nodes)
    name, names = request.name or m.name, [e.name for e in entries]
    if m.multinode is not None:
        node_roles(m, entries)                  # the wrong hosts: exit 2 before any is reached
    with ExitStack() as stack:
        sessions = open_sessions(stack, entries, f"deploy {name}", dry_run, accept_new_host_key)
        facts = dict(zip(names, parallel(entries, lambda e: gather.host_facts(sessions[e.name].host, e, m, request,
                                                                                   nodes=entries)),
                         strict=True))
        spec = gather.service_spec(m, entries, request, facts)
        inputs = parallel(entries, lambda e: gather.for_deploy(sessions[e.name].host, e, m, spec, opts,
                                                               sessions[e.name].lock, facts[e.name]))
        plan = plan_deploy(*inputs)
        # the head's gateway (a service across nodes is reached at its head; its steps go around the head's)
        plan = gateway.with_gateway(plan, gateway.read(sessions[names[0]].host, entries[0]), entries[0])
        result = OpResult("deploy", ", ".join(names), name, ok=False, dry_run=dry_run, plan=plan)
        if not_run(plan, result, reporter, opts, ask, names[0]):
            if plan.refusal and not dry_run:
                for e, inp in zip(entries, inputs, strict=True):
                    state.append_history(sessions[e.name].host, e,
                                         HistoryEntry(**refused_record(inp, plan), **NodeFields.of(inp.target.rendered.role)))
            result.seconds = time.monotonic() - t0
            return result
        if not plan.changes and all(a.noop for a in plan.actions if a.step not in ("lock", "verify-same")):
            reporter.print(f"[green]{name} is already deployed and serving on {', '.join(names)}: nothing to do.[/]")
        head = node_envs(sessions, {e.name: e for e in entries}, names[0], opts, reporter)
        outcome = run_plan(plan, head, reporter)
        result.outcome, result.ok, result.error = outcome, outcome.ok, outcome.error
        result.seconds = time.monotonic() - t0
        record = history_record(inputs[0], plan, outcome, head, result)
        for e, inp in zip(entries, inputs, strict=True):
            if sessions[e.name].holds_lock():              # without its lock, write nothing more there
                state.append_history(sessions[e.name].host, e, HistoryEntry(**{
                    **record, "unit_hash": inp.target.rendered.unit_hash,
                    "manifest_hash": inp.target.rendered.manifest_hash, **NodeFields.of(inp.target.rendered.role)}))
        result.extra["history"] = {**record, **NodeFields.of(inputs[0].target.rendered.role)}
        if len(entries) > 1:
            result.extra["nodes"] = names
        return result


def not_run(plan: Plan, result: OpResult, reporter: Reporter, opts: Options, ask: Ask | None, host: str) -> bool:
    """Whether the plan stops before it runs: a dry run (ok: the plan was shown), a refusal, or a
    deletion the user did not accept (result.error: the refusal). The plan is shown for each."""
    dry_run = result.dry_run
    asking = not dry_run and not plan.refusal and bool(plan.confirmations()) and not opts.yes
    if dry_run or plan.refusal or asking:
        reporter.plan(plan)                  # a dry run, a refusal, or what the question is about
    if asking:
        plan.refusal = confirmation(plan, opts.yes, ask, host)
    if plan.refusal:
        result.error = plan.refusal
        return True
    result.ok = dry_run
    return dry_run


def refused_record(inp: PlanInput, plan: Plan) -> dict:
    return {"operation": "deploy", "model": inp.target.model, "service": inp.name, "ok": False,
            "refused": str(plan.refusal)}


def history_record(inp: PlanInput, plan: Plan, outcome: RunOutcome, env: RunEnv, result: OpResult) -> dict:
    """A deploy's line in history.jsonl (with what the result shows: perf, warnings, the record): its
    steps and timings, hashes, gates and smoke result, recovery, failure kind."""
    m = inp.target.manifest
    ready = env.record.ready.get(m.name)
    record = {"operation": "deploy", "model": inp.target.model, "service": m.name, "ok": outcome.ok,
              "seconds": round(result.seconds, 2),
              "steps": outcome.timings(), "manifest_hash": inp.target.rendered.manifest_hash,
              "unit_hash": inp.target.rendered.unit_hash, "vllm_version": service_vllm_version(inp),
              "noop": not plan.changes}
    if ready is not None:
        record["smoke"] = ready.smoke.summary()
        record["tokens_per_s"] = ready.smoke.tokens_per_s
        record["gates"] = {g: round(t, 2) for g, t in ready.gates}
    if m.name in env.record.perf:
        record["perf"] = result.extra["perf"] = env.record.perf[m.name]
    if env.record.warnings:
        result.extra["warnings"] = list(env.record.warnings)
    if outcome.recovery is not None:
        record["recovery"] = outcome.recovery.as_dict()
    record.update(failure_fields(result.error))
    if isinstance(result.error, Interrupted):
        record["interrupted"] = result.error.step
    record.update(history_fields(env.record, m.name, plan.info.get("expected_start_s")))
    return record
