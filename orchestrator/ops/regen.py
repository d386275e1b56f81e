"""regen: re-render the unit and env file of every model vllm-orch installed on a host, show a
unified diff per file, install what changed, daemon-reload. Running services keep running unless
--restart; then each changed, running model is restarted through the readiness gates and, if it
fails them, its previous files are put back and it is restarted again (rollback)."""

from __future__ import annotations

import time

from orchestrator.host import state
from orchestrator.plan import steps
from orchestrator.ops.deploy import OpResult, session
from orchestrator.ops.execute import Reporter, run_plan
from orchestrator.host.facts import gather
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.plan.model import Action, Plan
from orchestrator.probe.readiness import NotReady, wait_ready
from orchestrator.render.artifacts import render, secrets_from_environ
from orchestrator.plan.steps import Ctx, Options


def run_regen(entry: HostEntry, manifests: dict[str, Manifest], opts: Options, reporter: Reporter,
              dry_run: bool, restart: bool, accept_new_host_key: bool = False) -> OpResult:
    t0 = time.monotonic()
    with session(entry, "regen", dry_run, accept_new_host_key) as (host, holder, held):
        facts = gather(host, entry)
        installed = sorted(facts.installed)
        plan = Plan("regen", entry.describe(), ", ".join(installed) or "(no models installed)")
        ctxs: list[Ctx] = []
        for name in installed:
            m = manifests.get(name)
            if m is None:
                plan.warnings.append(f"{name} is installed but has no manifest now: left as it is")
                continue
            ctx = Ctx(host=host, entry=entry, manifest=m, rendered=render(m, entry, secrets_from_environ(m)),
                      facts=facts, opts=opts, reporter=reporter)
            ctxs.append(ctx)
        plan.add(steps.lock_action(entry, holder, held))
        restarts = []
        for ctx in ctxs:
            old_files = {f.path: host.get(f.path) for f in ctx.rendered.files}
            action = steps.install_action(ctx)
            action.step = f"install {ctx.name}"
            plan.add(action)
            running = facts.services.get(ctx.name) and facts.services[ctx.name].active
            if not action.noop and running:
                if restart:
                    plan.add(_restart_action(ctx, old_files))
                    restarts.append(ctx.name)
                else:
                    plan.add(Action(f"restart {ctx.name}", f"nothing to do, because {ctx.name} keeps running "
                                    f"with its old settings until restarted (--restart)", noop=True))
        result = OpResult("regen", entry.name, ", ".join(installed), ok=False, dry_run=dry_run, plan=plan)
        if dry_run:
            reporter.plan(plan)
            result.ok, result.seconds = True, time.monotonic() - t0
            return result
        outcome = run_plan(plan, ctxs[0] if ctxs else _NullCtx(host, entry), reporter)
        result.outcome, result.ok, result.error = outcome, outcome.ok, outcome.error
        result.seconds = time.monotonic() - t0
        changed = [a.step.split(" ", 1)[1] for a in plan.actions if a.step.startswith("install ") and not a.noop]
        result.extra["changed"] = changed
        state.append_history(host, entry, {"operation": "regen", "ok": outcome.ok, "changed": changed,
                                           "restarted": restarts, "seconds": round(result.seconds, 2),
                                           "error": str(outcome.error) if outcome.error else None})
        return result


class _NullCtx:
    def __init__(self, host, entry):
        self.host, self.entry = host, entry


def _restart_action(ctx: Ctx, old_files: dict[str, bytes | None]) -> Action:
    svc = ctx.service

    def run(_c) -> str:
        cursor = svc.log_cursor()
        svc.run_all(svc.stop_commands() + svc.start_commands(), f"restart {ctx.name}", timeout=600)
        try:
            ready = wait_ready(ctx.host, svc, ctx.manifest, cursor, on_event=ctx.event,
                               budget_s=ctx.opts.budget_s, no_progress_s=ctx.opts.no_progress_s,
                               poll_s=ctx.opts.poll_s)
        except NotReady as err:
            # Roll back: the previous files, daemon-reload, restart, gates again.
            for f in ctx.rendered.files:
                data = old_files.get(f.path)
                if data is not None:
                    ctx.host.put(f.path, data, f.mode)
            svc.run_all(svc.reload_commands(), "daemon-reload")
            cursor = svc.log_cursor()
            svc.run_all(svc.stop_commands() + svc.start_commands(), f"restart {ctx.name} (rollback)", timeout=600)
            back = wait_ready(ctx.host, svc, ctx.manifest, cursor, on_event=ctx.event,
                              budget_s=ctx.opts.budget_s, no_progress_s=ctx.opts.no_progress_s,
                              poll_s=ctx.opts.poll_s)
            err.details.append(f"rollback: previous unit restored; {ctx.name} serves again "
                               f"({back.smoke.summary()})")
            raise
        state.write_active(ctx.host, ctx.entry, steps.active_record(ctx))
        return f"restarted; {ready.smoke.summary()}"

    return Action(f"restart {ctx.name}", f"restart {ctx.name} with the new unit, through the readiness gates "
                                         f"(the previous unit comes back if it fails)",
                  commands=svc.stop_commands() + svc.start_commands(), run=run)
