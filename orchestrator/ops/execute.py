"""Running a plan: each action in order, timed, shown live; the first failure stops the run.

The Reporter is the only thing that prints: a live step list for people (rich), or nothing until
the end for --json. Readiness shows the loading phase and the latest log line while it waits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from orchestrator.errors import OrchestratorError
from orchestrator.host.base import printable
from orchestrator.plan.model import Action, Plan


@dataclass
class StepResult:
    step: str
    status: str                  # done | skipped | failed | not-run
    summary: str
    seconds: float = 0.0
    result: str | None = None

    def as_dict(self) -> dict:
        return {"step": self.step, "status": self.status, "summary": self.summary,
                "seconds": round(self.seconds, 3), "result": self.result}


class Reporter:
    """Live human output. `quiet` (for --json) prints nothing."""

    def __init__(self, console=None, quiet: bool = False):
        self.console = console
        self.quiet = quiet or console is None
        self._status = None
        self._last_log = ""

    def print(self, text: str = "", **kw) -> None:
        if not self.quiet:
            self.console.print(text, **kw)

    def plan(self, plan: Plan) -> None:
        if not self.quiet:
            self.console.print(plan.text(), markup=False, highlight=False, soft_wrap=True)

    def step_start(self, index: int, total: int, action: Action) -> None:
        if self.quiet:
            return
        self.console.print(f"[bold]\\[{index}/{total}] {action.step}[/]: {action.summary}", soft_wrap=True)
        for c in action.commands:
            self.console.print(f"      $ {printable(c)}", markup=False, highlight=False, soft_wrap=True)
        if action.step == "ready":
            self._status = self.console.status("starting...", spinner="dots")
            self._status.start()

    def step_skip(self, index: int, total: int, action: Action) -> None:
        if not self.quiet:
            self.console.print(f"[dim]\\[{index}/{total}] {action.step}: {action.summary}[/]", soft_wrap=True)

    def step_end(self, res: StepResult) -> None:
        self._stop_status()
        if self.quiet:
            return
        style = {"done": "green", "skipped": "dim", "failed": "red"}.get(res.status, "")
        mark = {"done": "ok", "skipped": "skip", "failed": "FAILED"}.get(res.status, res.status)
        text = res.result or (res.summary if res.status == "skipped" else "")
        self.console.print(f"      [{style}]{mark}[/] {res.seconds:6.1f}s  {text}", soft_wrap=True)

    def _stop_status(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def event(self, kind: str, text: str) -> None:
        if self.quiet:
            return
        if kind == "gate":
            self.console.print(f"      [green]gate passed[/]: {text}")
        elif kind == "phase":
            self.console.print(f"      [cyan]loading[/]: {text}")
        elif kind == "log":
            self._last_log = text
            if self._status is not None:
                self._status.update(f"[dim]{text[:110]}[/]")
        else:
            self.console.print(f"      {text}", markup=False)

    def close(self) -> None:
        self._stop_status()


@dataclass
class RunOutcome:
    ok: bool
    results: list[StepResult] = field(default_factory=list)
    error: OrchestratorError | None = None
    seconds: float = 0.0

    def timings(self) -> dict[str, float]:
        return {r.step: round(r.seconds, 3) for r in self.results if r.status in ("done", "failed")}


def run_plan(plan: Plan, ctx, reporter: Reporter, start_at: int = 0) -> RunOutcome:
    """Execute the actions; a no-op runs only its bookkeeping `run` (if any) and counts as skipped."""
    outcome = RunOutcome(ok=True)
    t_all = time.monotonic()
    total = len(plan.actions)
    for i, action in enumerate(plan.actions[start_at:], start_at + 1):
        t0 = time.monotonic()
        if action.noop:
            if action.run is not None:
                action.run(ctx)
            res = StepResult(action.step, "skipped", action.summary, time.monotonic() - t0)
            outcome.results.append(res)
            reporter.step_skip(i, total, action)
            continue
        reporter.step_start(i, total, action)
        try:
            if action.run is not None:
                result = action.run(ctx)
            else:
                for cmd in action.commands:
                    ctx.host.run(cmd, timeout=600).check(ctx.entry.name, f"{action.step}: {printable(cmd)}")
                result = None
        except OrchestratorError as err:
            err.step = err.step or action.step
            err.host = err.host or ctx.entry.name
            res = StepResult(action.step, "failed", action.summary, time.monotonic() - t0, str(err.message))
            outcome.results.append(res)
            reporter.step_end(res)
            outcome.ok, outcome.error = False, err
            break
        except BaseException:
            reporter.close()
            raise
        res = StepResult(action.step, "done", action.summary, time.monotonic() - t0, result)
        outcome.results.append(res)
        reporter.step_end(res)
    for action in plan.actions[len(outcome.results) + start_at:]:
        outcome.results.append(StepResult(action.step, "not-run", action.summary))
    outcome.seconds = time.monotonic() - t_all
    reporter.close()
    return outcome
