"""regen: session -> gather (every installed model, each rendered with its own manifest) -> plan
(orchestrator.plan.regen) -> show or run -> history record."""

from __future__ import annotations

import time

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.host import state
from orchestrator.host.records import HistoryEntry
from orchestrator.ops import gather
from orchestrator.ops.deploy import not_run
from orchestrator.ops.execute import Reporter, run_plan
from orchestrator.ops.session import OpResult, session
from orchestrator.plan import gateway
from orchestrator.plan.regen import plan_regen
from orchestrator.plan.run import Options, RunEnv


def run_regen(entry: HostEntry, manifests: dict[str, Manifest], opts: Options, reporter: Reporter,
              dry_run: bool, restart: bool, accept_new_host_key: bool = False) -> OpResult:
    t0 = time.monotonic()
    with session(entry, "regen", dry_run, accept_new_host_key) as s:
        inp = gather.for_regen(s.host, entry, manifests, opts, s.lock, restart)
        plan = gateway.with_gateway(plan_regen(inp), gateway.read(s.host, entry), entry)
        result = OpResult("regen", entry.name, plan.model, ok=False, dry_run=dry_run, plan=plan)
        if not_run(plan, result, reporter, opts, None, entry.name):     # a dry run, or refused (a clash)
            if plan.refusal and not dry_run:
                state.append_history(s.host, entry, HistoryEntry(operation="regen", ok=False, refused=str(plan.refusal)))
            result.seconds = time.monotonic() - t0
            return result
        outcome = run_plan(plan, RunEnv(s.host, entry, opts, reporter, guard=s.guard), reporter)
        result.outcome, result.ok, result.error = outcome, outcome.ok, outcome.error
        result.seconds = time.monotonic() - t0
        changed = [a.step.split(" ", 1)[1] for a in plan.actions if a.step.startswith("install ") and not a.noop]
        result.extra["changed"] = changed
        record = {"operation": "regen", "ok": outcome.ok, "changed": changed,
                  "restarted": plan.info.get("restarts", []), "seconds": round(result.seconds, 2),
                  "error": str(outcome.error) if outcome.error else None}
        if outcome.recovery is not None:
            record["recovery"] = outcome.recovery.as_dict()
        if s.holds_lock():                       # without the lock, write nothing more
            state.append_history(s.host, entry, HistoryEntry(**record))
        return result
