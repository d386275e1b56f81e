"""Running a plan: each action in order, timed, shown live; the first failure stops the run and
runs the plan's recovery branch for that step, if it has one (a swap's rollback).

The Reporter is the only thing that prints: a live step list for people (rich), or nothing until
the end for --json. Readiness shows the loading phase and the latest log line while it waits.

An interrupt is cooperative (host/cancel.py): Ctrl-C, SIGTERM and SIGHUP cancel the operation's
token, which is checked before every step and inside every wait and host command, where it stops
the running step as a KeyboardInterrupt. That is a failure of the step it stopped: the recovery
branch covering that step runs as for any failure (a swap's rollback), and the run ends with an
`Interrupted` error (exit 130). A second interrupt during the recovery abandons it; the host's
records then say what is half done (orchestrator.plan.swap).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from orchestrator.errors import Interrupted, OrchestratorError, RefusedError
from orchestrator.fmt import escape
from orchestrator.fmt import printable as printable_text  # host.base.printable quotes commands
from orchestrator.host import cancel
from orchestrator.host.base import printable
from orchestrator.host.state import LockLost
from orchestrator.plan.model import Action, Plan, Recovery
from orchestrator.plan.run import Progress, RunEnv


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


WAIT_LINE_S = 30.0       # without a terminal: one "waiting: silent for ..." line per this many seconds


class Reporter:
    """Live human output. `quiet` (for --json) prints nothing."""

    def __init__(self, console=None, quiet: bool = False):
        self.console = console
        self.quiet = quiet or console is None
        self._status: Any = None                     # a rich Status while readiness waits
        self._last_log = ""                          # the service's last log line (the status shows it)
        self._waited_at: float | None = None         # when a non-terminal last got a "waiting" line

    def _emit(self, *args, **kw) -> None:
        try:
            self.console.print(*args, **kw)
        except OSError:            # the terminal went away (SIGHUP, a closed pipe): the run goes on
            self.gone()

    def print(self, text: str = "", **kw) -> None:
        if not self.quiet:
            self._emit(text, **kw)

    def gone(self) -> None:
        """The terminal went away (SIGHUP, a closed pipe): stay quiet, the run itself goes on."""
        self._status = None
        self.quiet = True

    def plan(self, plan: Plan) -> None:
        if not self.quiet:
            self._emit(plan.text(), markup=False, highlight=False, soft_wrap=True)

    def step_start(self, index: int | str, total: int, action: Action) -> None:
        if self.quiet:
            return
        self._emit(f"[bold]\\[{index}/{total}] {escape(action.key)}[/]: {escape(action.summary)}",
                   soft_wrap=True)
        for c in action.commands:
            self._emit(f"      $ {printable(c)}", markup=False, highlight=False, soft_wrap=True)
        if action.step == "ready" and not self.quiet:
            try:
                self._status = self.console.status("starting...", spinner="dots")
                self._status.start()
            except OSError:
                self.gone()

    def step_skip(self, index: int | str, total: int, action: Action) -> None:
        if not self.quiet:
            self._emit(f"[dim]\\[{index}/{total}] {escape(action.key)}: {escape(action.summary)}[/]",
                       soft_wrap=True)

    def step_end(self, res: StepResult) -> None:
        self._stop_status()
        self._waited_at, self._last_log = None, ""
        if self.quiet:
            return
        style = {"done": "green", "skipped": "dim", "failed": "red"}.get(res.status, "")
        mark = {"done": "ok", "skipped": "skip", "failed": "FAILED"}.get(res.status, res.status)
        text = res.result or (res.summary if res.status == "skipped" else "")
        self._emit(f"      [{style}]{mark}[/] {res.seconds:6.1f}s  {escape(text)}", soft_wrap=True)

    def _stop_status(self) -> None:
        if self._status is not None:
            try:
                self._status.stop()
            except OSError:
                self.gone()
            self._status = None

    def event(self, kind: str, text: str) -> None:
        if self.quiet:
            return
        if kind == "gate":
            self._emit(f"      [green]gate passed[/]: {escape(text)}")
        elif kind == "phase":
            self._emit(f"      [cyan]loading[/]: {escape(text)}")
        elif kind == "log":
            self._last_log = text
            if self._status is not None:
                self._status.update(f"[dim]{escape(text[:110])}[/]")
        elif kind == "wait":
            # how long the loading service has been silent: in the spinner on a terminal; elsewhere (a
            # pipe, a CI log, nohup) a line every WAIT_LINE_S, so a long load is never a mute stretch
            if self._status is not None and self.console.is_terminal:
                self._status.update(f"[dim]{escape(self._last_log[:80])}[/] ({escape(text)})")
            elif self._waited_at is None:
                self._waited_at = time.monotonic()
            elif time.monotonic() - self._waited_at >= WAIT_LINE_S:
                self._waited_at = time.monotonic()
                last = f"; last line: {self._last_log[:100]}" if self._last_log else ""
                self._emit(f"      waiting: {text}{last}", markup=False, highlight=False, soft_wrap=True)
        elif kind == "warn":
            self.console.print(f"      [yellow]warning[/]: {escape(text)}", soft_wrap=True)
        else:
            self._emit(f"      {printable_text(text)}", markup=False)

    @contextmanager
    def progress(self, kind: str, label: str, total: int = 0) -> Iterator[Progress | None]:
        """A live progress bar of a download or a warm-up (ops/progress.py); None when quiet."""
        if self.quiet:
            yield None
            return
        from orchestrator.ops.progress import DownloadProgress, WarmProgress

        bar: DownloadProgress | WarmProgress = DownloadProgress(self.console, label=label) if kind == "download" \
            else WarmProgress(total, self.console, label=label)
        with bar:
            yield bar

    def close(self) -> None:
        self._stop_status()


@dataclass
class RecoveryOutcome:
    title: str
    ok: bool
    results: list[StepResult] = field(default_factory=list)
    error: OrchestratorError | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"title": self.title, "ok": self.ok, "seconds": round(self.seconds, 3),
                "error": str(self.error) if self.error else None,
                "steps": [r.as_dict() for r in self.results]}


@dataclass
class RunOutcome:
    ok: bool
    results: list[StepResult] = field(default_factory=list)
    error: OrchestratorError | None = None
    seconds: float = 0.0
    recovery: RecoveryOutcome | None = None

    def timings(self) -> dict[str, float]:
        return {r.step: round(r.seconds, 3) for r in self.results if r.status in ("done", "failed")}


def node_env(env: RunEnv, action: Action) -> RunEnv:
    """The env an action runs with: its node's (env.nodes) when it names one, else the plan's own."""
    if action.node is None:
        return env
    try:
        return env.nodes[action.node]
    except KeyError:
        raise OrchestratorError(f"the plan's step {action.key} names a node this run has no connection to",
                                step=action.step, host=action.node) from None


def _guard(env: RunEnv, action: Action) -> str | None:
    """Prove the lock is still ours before a step: its node's lock; for a step over all nodes (a
    multi-node plan's parallel download), every node's. A note when one was re-taken."""
    envs = [node_env(env, action)] if action.node is not None or not env.nodes else list(env.nodes.values())
    notes = [note for e in envs if e.guard is not None and (note := e.guard())]
    return "; ".join(notes) or None


def _run_actions(actions: list[Action], env: RunEnv, reporter: Reporter, label, results: list[StepResult],
                 total: int) -> OrchestratorError | None:
    """Run actions in order, each after the guard of the host it runs on (the host lock is still
    ours); an action naming a node runs with that node's env. The first OrchestratorError stops
    them and is returned."""
    for i, action in enumerate(actions, 1):
        t0 = time.monotonic()
        try:
            target = node_env(env, action)
            note = _guard(env, action)
        except OrchestratorError as err:          # the lock is not ours any more: stop before the step
            res = StepResult(action.key, "failed", action.summary, 0.0, str(err.message))
            results.append(res)
            reporter.step_end(res)
            return err
        if note:
            reporter.event("note", note)
        if not action.noop:
            reporter.step_start(label(i), total, action)
        try:                     # a no-op runs only its bookkeeping `run`, which can fail or be interrupted too
            cancel.check()       # an interrupt between two steps stops the next one before it starts
            if action.noop:
                result = action.run(target) if action.run is not None else None
            elif action.run is not None:
                result = action.run(target)
            else:
                for cmd in action.commands:
                    target.host.run(cmd, timeout=600).check(target.entry.name, f"{action.step}: {printable(cmd)}")
                result = None
        except OrchestratorError as err:
            err.step = err.step or action.step
            err.host = err.host or target.entry.name
            res = StepResult(action.key, "failed", action.summary, time.monotonic() - t0, str(err.message))
            results.append(res)
            reporter.step_end(res)
            return err
        except KeyboardInterrupt:
            token = cancel.current()
            if token is not None:   # answered: this step failed for it (its recovery, the records, still run)
                token.tolerate()
            res = StepResult(action.key, "failed", action.summary, time.monotonic() - t0, "interrupted")
            results.append(res)
            reporter.step_end(res)
            return Interrupted(f"interrupted during {action.key}", step=action.step, host=target.entry.name)
        except BaseException:
            reporter.close()
            raise
        if action.noop:
            results.append(StepResult(action.key, "skipped", action.summary, time.monotonic() - t0))
            reporter.step_skip(label(i), total, action)
            continue
        res = StepResult(action.key, "done", action.summary, time.monotonic() - t0, result)
        results.append(res)
        reporter.step_end(res)
    return None


def run_recovery(recovery: Recovery, env: RunEnv, reporter: Reporter, interrupted: bool = False) -> RecoveryOutcome:
    t0 = time.monotonic()
    token = cancel.current()
    if token is not None:
        token.tolerate()         # the interrupt that led here is answered: only a further one stops the recovery
    note = " (interrupted: press Ctrl-C again to abandon it)" if interrupted else ""
    reporter.print(f"[yellow]recovery: {escape(recovery.title)}{note}[/]")
    out = RecoveryOutcome(recovery.title, ok=True)
    err = _run_actions(recovery.actions, env, reporter, lambda i: f"r{i}", out.results, len(recovery.actions))
    if isinstance(err, Interrupted):
        err = Interrupted(f"interrupted again during {err.step}: {recovery.title} abandoned", step=err.step,
                          host=err.host)
    out.ok, out.error, out.seconds = err is None, err, time.monotonic() - t0
    return out


Ask = Callable[[str], bool]


def confirmation(plan: Plan, yes: bool, ask: Ask | None, host: str) -> RefusedError | None:
    """None when the plan may run: it deletes nothing, or --yes accepted it, or the user said yes to
    `ask` (only given on a terminal). Else the refusal: nothing has changed yet."""
    needed = plan.confirmations()
    if not needed or yes:
        return None
    what = "; ".join(needed)
    if ask is None:
        return RefusedError(f"the plan would {what}, and needs confirmation", host=host, step="confirm",
                            hint="pass --yes to accept it (there is no terminal to ask on), or --dry-run to look")
    if not ask(f"{what[0].upper()}{what[1:]}?"):
        return RefusedError(f"not confirmed: nothing changed (the plan would {what})", host=host, step="confirm")
    return None


def run_plan(plan: Plan, env: RunEnv, reporter: Reporter) -> RunOutcome:
    """Execute the actions; a no-op runs only its bookkeeping `run` (if any) and counts as skipped.
    On a failure, the recovery branch covering the failed step runs, and its outcome is kept."""
    outcome = RunOutcome(ok=True)
    t_all = time.monotonic()
    err = _run_actions(plan.actions, env, reporter, lambda i: i, outcome.results, len(plan.actions))
    for action in plan.actions[len(outcome.results):]:
        outcome.results.append(StepResult(action.key, "not-run", action.summary))
    if err is not None:
        outcome.ok, outcome.error = False, err
        failed_at = next(i for i, r in enumerate(outcome.results, 1) if r.status == "failed")
        recovery = plan.recovery_for(failed_at)
        if recovery is not None and isinstance(err, LockLost):
            err.details = err.details + [f"{recovery.title}: not run (the host lock is not ours any more)"]
        elif recovery is not None:
            outcome.recovery = run_recovery(recovery, env, reporter, interrupted=isinstance(err, Interrupted))
            err.details = err.details + [f"{recovery.title}: " + (
                "done" if outcome.recovery.ok else f"FAILED: {outcome.recovery.error}")]
    outcome.seconds = time.monotonic() - t_all
    reporter.close()
    return outcome
