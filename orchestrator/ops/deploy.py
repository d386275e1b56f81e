"""deploy: from nothing (or anything) to a verified, serving model - as a plan, then the same plan run.

Order: lock -> preflight -> disk -> download -> GPUs free -> install -> start -> ready -> record.
A refused safety check stops the plan before anything changes (exit 3). A start that fails its
readiness gates is stopped again so it cannot crash-loop while holding the GPUs (exit 1).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from orchestrator.host import state
from orchestrator.plan import steps
from orchestrator.host.connect import open_host
from orchestrator.errors import OrchestratorError, RefusedError
from orchestrator.ops.execute import Reporter, RunOutcome, run_plan
from orchestrator.host.facts import gather
from orchestrator.host.base import Host
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.plan.model import Action, Plan
from orchestrator.probe.readiness import failure_fields
from orchestrator.render.artifacts import render, secrets_from_environ
from orchestrator.plan.steps import Ctx, Options


@dataclass
class OpResult:
    operation: str
    host: str
    model: str
    ok: bool
    dry_run: bool
    plan: Plan
    outcome: RunOutcome | None = None
    error: OrchestratorError | None = None
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {"operation": self.operation, "host": self.host, "model": self.model, "ok": self.ok,
             "dry_run": self.dry_run, "seconds": round(self.seconds, 3),
             "plan": [{"step": a.step, "noop": a.noop, "summary": a.summary} for a in self.plan.actions],
             "refused": str(self.plan.refusal) if self.plan.refusal else None,
             "steps": [r.as_dict() for r in self.outcome.results] if self.outcome else [],
             "error": str(self.error) if self.error else None, **self.extra}
        if self.error is not None:
            d["error_details"] = self.error.details
            d["exit_code"] = self.error.exit_code
        return d


@contextmanager
def session(entry: HostEntry, operation: str, dry_run: bool, accept_new_host_key: bool = False):
    """Open the host and, unless dry-run, hold its deploy lock. Yields (host, lock holder or None)."""
    host = open_host(entry, accept_new_host_key)
    lock = None
    try:
        if dry_run:
            yield host, state.lock_holder(host, entry), False
        else:
            lock = state.HostLock(host, entry, operation)
            lock.acquire()
            yield host, None, True
    finally:
        if lock is not None:
            lock.release()
        host.close()


def make_ctx(host: Host, entry: HostEntry, m: Manifest, opts: Options, reporter, extra_models=()) -> Ctx:
    secrets = secrets_from_environ(m)
    ctx = Ctx(host=host, entry=entry, manifest=m, rendered=render(m, entry, secrets),
              facts=gather(host, entry, [m.name, *extra_models], ports=[m.serving.port]),
              opts=opts, reporter=reporter)
    ctx.results["secrets"] = secrets
    return ctx


def unpinned_warning(m: Manifest) -> list[str]:
    if m.source.pinned:
        return []
    return [f"source.revision is {m.source.revision!r}, not a commit: the weights may change between "
            f"downloads (the resolved commit is recorded)"]


def build_deploy_plan(ctx: Ctx, holder: dict | None, held: bool) -> Plan:
    m, f = ctx.manifest, ctx.facts
    plan = Plan("deploy", ctx.entry.describe(), m.name, warnings=unpinned_warning(m))
    plan.add(steps.lock_action(ctx.entry, holder, held))

    if plan.add_checked(*steps.preflight_action(ctx)):
        return plan
    # Another managed model serving on our GPUs: deploy never stops it (swap does).
    active = f.active or {}
    other = active.get("model")
    if other and other != m.name and f.services.get(other) and f.services[other].active \
            and set(active.get("gpus") or []) & set(m.serving.visible_devices):
        plan.refusal = RefusedError(
            f"{other} is the active model and serves on the GPUs {m.name} needs",
            host=ctx.entry.name, step="start",
            hint=f"use `vllm-orch swap {m.name} --host {ctx.entry.name}` to replace it with rollback")
        plan.add(Action("start", f"{other} serves on {steps.gpu_list(m.serving.visible_devices)}"))
        return plan
    ctx.download = steps.plan_download(ctx)
    if plan.add_checked(*steps.disk_action(ctx, keep=set())):
        return plan
    plan.add(steps.download_action(ctx))
    st = f.services.get(m.name)
    running = bool(st and st.active)
    install = steps.install_action(ctx)
    unit_changed = not install.noop
    if running and not unit_changed:
        plan.add(Action("gpus", f"nothing to do, because {m.name} itself holds "
                                f"{steps.gpu_list(m.serving.visible_devices)}", noop=True))
    elif plan.add_checked(*steps.gpus_action(ctx, stopping={m.name} if running else set())):
        return plan
    plan.add(install)
    plan.add(steps.start_action(ctx, unit_changed))
    recorded = (f.active or {}).get("model") == m.name and \
        (f.active or {}).get("unit_hash") == ctx.rendered.unit_hash
    # A running service that was never recorded (a deploy killed while waiting) goes through the
    # gates again, smoke test included, before it is recorded.
    serving = running and not unit_changed and recorded and steps.healthy_now(ctx)
    plan.add(steps.ready_action(ctx, serving))
    if serving:
        plan.add(Action("record", f"nothing to do, because {m.name} is recorded as active with these hashes",
                        noop=True))
    else:
        plan.add(steps.record_action(ctx, "deploy"))
    return plan


def run_deploy(entry: HostEntry, m: Manifest, opts: Options, reporter: Reporter, dry_run: bool,
               accept_new_host_key: bool = False) -> OpResult:
    t0 = time.monotonic()
    with session(entry, f"deploy {m.name}", dry_run, accept_new_host_key) as (host, holder, held):
        ctx = make_ctx(host, entry, m, opts, reporter)
        plan = build_deploy_plan(ctx, holder, held)
        result = OpResult("deploy", entry.name, m.name, ok=False, dry_run=dry_run, plan=plan)
        if dry_run or plan.refusal:
            reporter.plan(plan)
        if plan.refusal:
            result.error = plan.refusal
            if not dry_run:
                state.append_history(host, entry, {"operation": "deploy", "model": m.name, "ok": False,
                                                   "refused": str(plan.refusal)})
            result.seconds = time.monotonic() - t0
            return result
        if dry_run:
            result.ok = True
            result.seconds = time.monotonic() - t0
            return result
        if not plan.changes and all(a.noop for a in plan.actions if a.step not in ("lock",)):
            reporter.print(f"[green]{m.name} is already deployed and serving on {entry.name}: nothing to do.[/]")
        outcome = run_plan(plan, ctx, reporter)
        result.outcome, result.ok = outcome, outcome.ok
        if not outcome.ok:
            result.error = outcome.error
            if ctx.started:
                # A failed start must not crash-loop with the GPUs held: stop it, keep the files.
                svc = ctx.service
                for cmd in svc.stop_commands():
                    host.run(cmd, timeout=600)
                reporter.print(f"      stopped {m.name} after the failure (model files kept)")
        result.seconds = time.monotonic() - t0
        record = {"operation": "deploy", "model": m.name, "ok": outcome.ok, "seconds": round(result.seconds, 2),
                  "steps": outcome.timings(), "manifest_hash": ctx.rendered.manifest_hash,
                  "unit_hash": ctx.rendered.unit_hash, "vllm_version": ctx.facts.vllm_version,
                  "noop": not plan.changes}
        if ctx.ready is not None:
            record["smoke"] = ctx.ready.smoke.summary()
            record["tokens_per_s"] = ctx.ready.smoke.tokens_per_s
            record["gates"] = {g: round(t, 2) for g, t in ctx.ready.gates}
        record.update(failure_fields(result.error))
        state.append_history(host, entry, record)
        result.extra["history"] = record
        return result
