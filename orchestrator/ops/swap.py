"""swap: session -> gather (the target and the model it replaces) -> plan (orchestrator.plan.swap,
rollback branch included) -> show or run -> history records (the swap, and the rollback if one ran).
Downtime = old stopped -> new ready, stamped by those two steps in the run record.

A swap that ends with its old model stopped and no rollback finished (killed, interrupted twice,
or the host unreachable for the rollback) leaves state_dir/swap.json on the host; its error then
says which command finishes or undoes it (orchestrator.plan.interrupted).
"""

from __future__ import annotations

import time

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.config.placement import Request
from orchestrator.errors import Interrupted, OrchestratorError
from orchestrator.host import state
from orchestrator.host.records import HistoryEntry
from orchestrator.ops import gather
from orchestrator.ops.execute import Ask, Reporter, confirmation, run_plan
from orchestrator.ops.session import OpResult, session
from orchestrator.plan.run import Options, RunEnv
from orchestrator.plan.swap import plan_swap
from orchestrator.plan.warm import history_fields
from orchestrator.probe.readiness import failure_fields


def run_swap(entry: HostEntry, m: Manifest, manifests: dict[str, Manifest], opts: Options,
             reporter: Reporter, dry_run: bool, accept_new_host_key: bool = False,
             ask: Ask | None = None, request: Request = Request()) -> OpResult:
    """Swap to model M as the service `request` names (default: M's own)."""
    t0 = time.monotonic()
    with session(entry, f"swap to {request.name or m.name}", dry_run, accept_new_host_key) as s:
        inp = gather.for_swap(s.host, entry, m, request, manifests, opts, s.lock)
        m = inp.target.manifest                  # the service as it runs here (its name, its place)
        plan = plan_swap(inp)
        info = dict(plan.info)
        result = OpResult("swap", entry.name, m.name, ok=False, dry_run=dry_run, plan=plan, extra=dict(info))
        noop = bool(info.get("noop"))
        asking = not dry_run and not plan.refusal and bool(plan.confirmations()) and not opts.yes
        if dry_run or plan.refusal or noop or asking:
            reporter.plan(plan)
        if asking:                               # a staged swap that frees disk by deleting folders
            plan.refusal = confirmation(plan, opts.yes, ask, entry.name)
        if plan.refusal or dry_run or noop:
            result.error = plan.refusal
            result.ok = plan.refusal is None
            result.seconds = time.monotonic() - t0
            return result
        env = RunEnv(s.host, entry, opts, reporter, guard=s.guard)
        outcome = run_plan(plan, env, reporter)
        result.outcome, result.ok, result.error = outcome, outcome.ok, outcome.error
        ready = env.record.ready.get(m.name)
        if outcome.ok:
            result.extra["downtime_s"] = env.record.downtime_s() or 0.0
            if ready is not None:
                result.extra["load_s"] = round(ready.seconds, 3)
        rb = outcome.recovery
        stopped = any(r.step == "stop" and r.status in ("done", "failed") for r in outcome.results) or \
            bool(inp.facts.half_swap)
        if not outcome.ok and stopped and not (rb is not None and rb.ok) and result.error is not None \
                and inp.old is not None:
            old, host = inp.old.name, entry.name
            result.extra["half_done"] = True
            result.error.hint = (f"the swap is half done ({entry.state_dir}/swap.json says so): run `vllm-orch "
                                 f"swap {m.name} --host {host}` to finish it (it rolls back to {old} if {m.name} "
                                 f"fails), or `vllm-orch swap {old} --host {host}` to go back")
        if rb is not None and inp.old is not None and info.get("staged"):
            old_ready = env.record.ready.get(inp.old.name)
            text = (f"{inp.old.name} serves again ({old_ready.smoke.summary()})" if rb.ok and old_ready
                    else f"{inp.old.name} did not come back: {rb.error.message if rb.error else '?'}")
            result.extra["rollback"] = {"ok": rb.ok, "result": text, "seconds": round(rb.seconds, 3)}
            if result.error is not None and result.error.details:
                result.error.details[-1] = f"rollback: {text}"     # the executor's line, with the smoke answer
        result.seconds = time.monotonic() - t0
        record = {"operation": "swap", "from": info.get("from"), "model": inp.target.model, "service": m.name,
                  "ok": outcome.ok,
                  "staged": info.get("staged"), "seconds": round(result.seconds, 2), "steps": outcome.timings(),
                  "downtime_s": result.extra.get("downtime_s"), "unit_hash": inp.target.rendered.unit_hash}
        record.update(failure_fields(result.error))
        if isinstance(result.error, Interrupted):
            record["interrupted"] = result.error.step
        if result.extra.get("half_done"):
            record["half_done"] = True
        record.update(history_fields(env.record, m.name, info.get("expected_downtime_s")))
        result.extra.update({k: v for k, v in record.items() if k in ("warm", "weights_s")})
        if "rollback" in result.extra:
            record["rollback"] = result.extra["rollback"]
        if ready is not None:
            record["tokens_per_s"] = ready.smoke.tokens_per_s
        if m.name in env.record.perf:
            record["perf"] = result.extra["perf"] = env.record.perf[m.name]
        if env.record.warnings:
            result.extra["warnings"] = list(env.record.warnings)
        if not s.holds_lock():                   # without the lock, write nothing more
            return result
        records = [record]
        if "rollback" in result.extra:
            records.append({"operation": "rollback", "model": info.get("from"), "ok": result.extra["rollback"]["ok"],
                            "seconds": result.extra["rollback"]["seconds"],
                            "after": ("interrupted" if isinstance(result.error, Interrupted) else "failed")
                                     + f" swap to {m.name}"})
        for rec in records:
            try:
                state.append_history(s.host, entry, HistoryEntry(**rec))
            except OrchestratorError as exc:     # the connection is gone: the result still reaches the user
                if result.error is not None:
                    result.error.details.append(f"history not recorded: {exc}")
                break
        return result
