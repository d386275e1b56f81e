"""swap: replace the active model with another, staged, measured, and rolled back on failure.

    lock -> preflight -> disk (room for BOTH models) -> download while the old model serves ->
    install the new unit -> stop old -> GPUs free -> start new -> ready -> record
On a failure after the old model stopped: stop the new one, free the GPUs, start the old one with
its unchanged unit, wait for its gates, and report both the failure and that the old model serves.
The old model's files are never touched by a staged swap. Downtime = old stopped -> new ready.
"""

from __future__ import annotations

import time

from orchestrator.host import state
from orchestrator.plan import steps
from orchestrator.ops.deploy import OpResult, make_ctx, session, unpinned_warning
from orchestrator.errors import ConfigError, OrchestratorError, RefusedError
from orchestrator.ops.execute import Reporter, run_plan
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.plan.model import Action, Plan
from orchestrator.probe.readiness import failure_fields, wait_ready
from orchestrator.host.services import Service
from orchestrator.plan.steps import Ctx, Options

FIELD_DOWNLOAD_RATE = 547e9 / (28 * 60)    # field report: 547 GB in 28 min (~325 MB/s)


def _old_model(ctx: Ctx) -> str | None:
    active = (ctx.facts.active or {}).get("model")
    if active and ctx.facts.services.get(active) and ctx.facts.services[active].active:
        return active
    running = [n for n in ctx.facts.running() if n != ctx.name]
    return running[0] if running else active


def build_swap_plan(ctx: Ctx, old: Manifest | None, holder: dict | None, held: bool,
                    yes: bool) -> tuple[Plan, dict]:
    m, f = ctx.manifest, ctx.facts
    info: dict = {"from": old.name if old else None, "to": m.name, "staged": True}
    plan = Plan("swap", ctx.entry.describe(), f"{old.name if old else '(nothing)'} -> {m.name}",
                warnings=unpinned_warning(m))
    plan.add(steps.lock_action(ctx.entry, holder, held))

    if plan.add_checked(*steps.preflight_action(ctx)):
        return plan, info
    ctx.download = steps.plan_download(ctx)
    keep = {old.name} if old else set()
    disk, err = steps.disk_action(ctx, keep=keep)
    if err is not None and old is not None:
        # Not enough room for both: the only way is to delete the old model after stopping it.
        need = ctx.download["to_fetch_bytes"]
        extra = f.models.get(old.name).bytes if f.models.get(old.name) else 0
        minutes = need / FIELD_DOWNLOAD_RATE / 60
        info["staged"] = False
        available, limit_txt = steps.disk_available(ctx)
        running = set(f.running()) - {old.name}
        deletable = sum(d.bytes for n, d in f.models.items() if n not in running | {m.name})
        if available + deletable < need:
            plan.add(Action("disk", f"short even without {old.name}", warn=True))
            plan.refusal = RefusedError(
                f"not enough disk even after deleting {old.name} and every inactive model: the download "
                f"needs {steps.fmt_bytes(need)}, {steps.fmt_bytes(max(available, 0))} is available "
                f"({limit_txt}) and deleting would free {steps.fmt_bytes(deletable)}",
                host=ctx.entry.name, step="disk", hint="free space on the models disk first")
            return plan, info
        text = (f"cannot stage: the disk cannot hold {m.name} next to {old.name} ({err.message}). Without "
                f"staging, {old.name} is stopped and its {steps.fmt_bytes(extra)} deleted before the "
                f"download, which adds about {minutes:.0f} min of downtime at the field's 325 MB/s, and a "
                f"failed start cannot be rolled back without downloading {old.name} again")
        if not yes:
            plan.add(Action("disk", text, warn=True))
            plan.refusal = RefusedError(
                f"the disk cannot stage {m.name} while {old.name} serves: an unstaged swap adds about "
                f"{minutes:.0f} min of downtime and loses the rollback", host=ctx.entry.name, step="disk",
                hint="pass --yes to accept, or free space (vllm-orch gc) and swap again")
            return plan, info
        plan.warnings.append(text)
        return plan, info
    if plan.add_checked(disk, err):
        return plan, info
    plan.add(steps.download_action(ctx))
    install = plan.add(steps.install_action(ctx))
    # After an interrupted swap the old model may already be stopped and the new one running:
    # then there is nothing to stop, and a running, unchanged new service is waited for, not restarted.
    old_running = old is not None and bool(f.services.get(old.name) and f.services[old.name].active)
    if old_running:
        plan.add(steps.stop_action(ctx, old.name, "downtime starts"))
    gpus, err = steps.gpus_action(ctx, stopping={old.name} if old_running else set())
    if plan.add_checked(gpus, err):
        return plan, info
    plan.add(steps.start_action(ctx, unit_changed=not install.noop))
    plan.add(steps.ready_action(ctx, already_serving=False))
    plan.add(steps.record_action(ctx, "swap"))
    return plan, info


def _unstaged_actions(ctx: Ctx, old: Manifest) -> list[Action]:
    """With --yes when the disk cannot hold both: stop old, delete its folder, then as deploy."""
    path = steps.model_path(ctx.entry, old.name)
    return [steps.stop_action(ctx, old.name, "downtime starts; not staged"),
            Action("disk", f"delete {path} to make room (accepted with --yes)",
                   commands=[["rm", "-rf", "--one-file-system", path]])]


def rollback(ctx: Ctx, old: Manifest, reporter: Reporter, opts: Options) -> tuple[bool, str, float]:
    """Stop the new model, free the GPUs, start the old one with its installed unit, wait for it."""
    t0 = time.monotonic()
    host, entry = ctx.host, ctx.entry
    new_svc = ctx.service
    reporter.print(f"[yellow]rolling back to {old.name}[/]")
    try:
        new_svc.run_all(new_svc.stop_commands(), f"stop {ctx.name}", timeout=600)
        reporter.print(f"      stopped {ctx.name}")
        freed = steps.wait_gpus_free(host, entry, old.serving.visible_devices, opts.gpu_release_timeout_s,
                                     opts.poll_s)
        reporter.print(f"      {freed}")
        old_svc = Service.for_host(host, entry, old.name)
        cursor = old_svc.log_cursor()
        old_svc.run_all(old_svc.start_commands(), f"start {old.name}")
        reporter.print(f"      started {old.name} with its previous unit")
        ready = wait_ready(host, old_svc, old, cursor, on_event=reporter.event,
                           budget_s=opts.budget_s, no_progress_s=opts.no_progress_s, poll_s=opts.poll_s)
    except OrchestratorError as err:
        return False, f"{old.name} did not come back: {err.message}", time.monotonic() - t0
    state.touch_usage(host, entry, old.name, {})
    return True, f"{old.name} serves again ({ready.smoke.summary()})", time.monotonic() - t0


def run_swap(entry: HostEntry, m: Manifest, manifests: dict[str, Manifest], opts: Options,
             reporter: Reporter, dry_run: bool, accept_new_host_key: bool = False) -> OpResult:
    t0 = time.monotonic()
    with session(entry, f"swap to {m.name}", dry_run, accept_new_host_key) as (host, holder, held):
        ctx = make_ctx(host, entry, m, opts, reporter, extra_models=list(manifests))
        old_name = _old_model(ctx)
        if old_name == m.name:
            healthy = ctx.facts.services.get(m.name) and ctx.facts.services[m.name].active and steps.healthy_now(ctx)
            if healthy and (ctx.facts.active or {}).get("unit_hash") == ctx.rendered.unit_hash:
                plan = Plan("swap", entry.describe(), f"{m.name} -> {m.name}")
                plan.add(Action("swap", f"nothing to do, because {m.name} is already active and healthy",
                                noop=True))
                reporter.plan(plan)
                return OpResult("swap", entry.name, m.name, True, dry_run, plan, seconds=time.monotonic() - t0)
            old_name = None   # the target itself is active but broken or changed: a plain (re)deploy
        old = None
        if old_name:
            if old_name not in manifests:
                raise ConfigError(f"the active model {old_name!r} has no manifest in the models folder, so it "
                                  f"could not be rolled back to", host=entry.name,
                                  hint=f"restore models/{old_name}.yaml, or `vllm-orch stop {old_name}` first")
            old = manifests[old_name]
        plan, info = build_swap_plan(ctx, old, holder, held, opts.yes)
        result = OpResult("swap", entry.name, m.name, ok=False, dry_run=dry_run, plan=plan, extra=dict(info))
        if not info["staged"] and not plan.refusal:
            # --yes accepted an unstaged swap: stop + delete old first, then plan the rest as a deploy.
            plan.actions += _unstaged_actions(ctx, old)
            plan.add(steps.download_action(ctx))
            plan.add(steps.install_action(ctx))
            plan.add(steps.gpus_action(ctx, stopping={old.name})[0])
            plan.add(steps.start_action(ctx, unit_changed=True))
            plan.add(steps.ready_action(ctx, already_serving=False))
            plan.add(steps.record_action(ctx, "swap"))
        if dry_run or plan.refusal:
            reporter.plan(plan)
        if plan.refusal or dry_run:
            result.error = plan.refusal
            result.ok = plan.refusal is None
            result.seconds = time.monotonic() - t0
            return result
        outcome = run_plan(plan, ctx, reporter)
        result.outcome, result.ok = outcome, outcome.ok
        if outcome.ok:
            # steps.stop_action and steps.ready_action stamp these (downtime = old stopped -> new ready)
            stopped_at, ready_at = ctx.results.get("stopped_at"), ctx.results.get("ready_at")
            result.extra["downtime_s"] = round(ready_at - stopped_at, 3) if stopped_at and ready_at else 0.0
            if ctx.ready is not None:
                result.extra["load_s"] = round(ctx.ready.seconds, 3)
        else:
            result.error = outcome.error
            stopped_old = any(r.step == "stop" and r.status == "done" for r in outcome.results)
            if old is not None and stopped_old and info["staged"]:
                ok, text, secs = rollback(ctx, old, reporter, opts)
                result.extra["rollback"] = {"ok": ok, "result": text, "seconds": round(secs, 3)}
                if result.error is not None:
                    result.error.details = result.error.details + [f"rollback: {text}"]
            elif ctx.started:
                ctx.service.run_all(ctx.service.stop_commands(), f"stop {m.name}", timeout=600)
        result.seconds = time.monotonic() - t0
        record = {"operation": "swap", "from": info["from"], "model": m.name, "ok": outcome.ok,
                  "staged": info["staged"], "seconds": round(result.seconds, 2), "steps": outcome.timings(),
                  "downtime_s": result.extra.get("downtime_s"), "unit_hash": ctx.rendered.unit_hash}
        record.update(failure_fields(result.error))
        if "rollback" in result.extra:
            record["rollback"] = result.extra["rollback"]
        if ctx.ready is not None:
            record["tokens_per_s"] = ctx.ready.smoke.tokens_per_s
        state.append_history(host, entry, record)
        if "rollback" in result.extra:
            state.append_history(host, entry, {"operation": "rollback", "model": info["from"],
                                               "ok": result.extra["rollback"]["ok"],
                                               "seconds": result.extra["rollback"]["seconds"],
                                               "after": f"failed swap to {m.name}"})
        return result

