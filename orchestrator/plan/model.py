"""Plans: an ordered list of actions, each "nothing to do, because ..." or the exact commands, and the
recovery branches that run when a step fails.

A planner (orchestrator.plan.deploy / swap / regen) builds the whole Plan from facts gathered before
it, with no I/O: what is printed by --dry-run is what runs. A step's work is either its command list
or a `run` callable bound when the plan was built; run callables receive the RunEnv (the host, the
inventory entry, the options, the reporter) and write what they produce into the typed RunRecord.

Recovery is part of the plan: a `Recovery` covers a range of step numbers, and when one of them
fails its actions run (a swap's rollback: stop the new model, free the GPUs, restart the previous
unit, wait for its gates). --dry-run prints recovery branches too. Text rendering is deterministic
(no timings) so golden tests pin it down.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orchestrator import fmt
from orchestrator.errors import RefusedError
from orchestrator.host.base import Command, printable

if TYPE_CHECKING:
    from orchestrator.plan.run import RunEnv


# Steps that change nothing on a host by themselves: a plan of only these (and no-ops) changes nothing.
CHECKS_ONLY = ("lock", "preflight", "record", "verify-same")


@dataclass
class Action:
    step: str                                   # short key: lock, preflight, disk, download, ...
    summary: str                                # one line: what will happen, or why nothing will
    noop: bool = False
    commands: list[Command] = field(default_factory=list)   # shown; run in order unless `run` is set
    details: list[str] = field(default_factory=list)         # extra lines (checks, diffs, folders)
    run: Callable[[RunEnv], str | None] | None = None        # custom apply; returns a result line
    confirm: str | None = None                  # what the user must accept first (a deletion), or None
    node: str | None = None                     # the inventory host the step runs on (None: the plan's own)
    subject: str | None = None                  # the service it starts, stops, sleeps or wakes (the gateway's steps)
    restart: bool = False                       # (a start) it stops the running service first: a restart in place

    @property
    def key(self) -> str:
        """The step as a plan shows it: `download`, or `download[gpu2]` for a step on one node."""
        return f"{self.step}[{self.node}]" if self.node else self.step

    def lines(self) -> list[str]:
        out = [self.summary]
        out += [f"  {d}" for d in self.details]
        out += [f"  $ {printable(c)}" for c in self.commands]
        return out


@dataclass
class Recovery:
    """What runs when one of the plan's steps first..last (1-based, inclusive) fails."""

    first: int
    last: int
    title: str                                  # e.g. "roll back to kimi-k25-int4"
    actions: list[Action] = field(default_factory=list)

    def covers(self, number: int) -> bool:
        return self.first <= number <= self.last


@dataclass
class Plan:
    operation: str
    host_desc: str
    model: str
    actions: list[Action] = field(default_factory=list)
    recoveries: list[Recovery] = field(default_factory=list)
    refusal: RefusedError | None = None         # a safety check refused: nothing will be executed
    warnings: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)   # planner's notes for the operation (staged, ...)

    def add(self, action: Action) -> Action:
        self.actions.append(action)
        return action

    def add_checked(self, action: Action, refusal: RefusedError | None) -> bool:
        """Add a step that may refuse; True (stop planning) when it did."""
        self.add(action)
        if refusal is not None:
            self.refusal = refusal
        return refusal is not None

    def refuse(self, action: Action, refusal: RefusedError) -> Plan:
        self.add_checked(action, refusal)
        return self

    def number_of(self, action: Action) -> int:
        """1-based position of an action already in the plan."""
        return next(i for i, a in enumerate(self.actions, 1) if a is action)

    def recover(self, first: Action, title: str, actions: list[Action], last: Action | None = None) -> None:
        """A recovery branch for a failure anywhere from `first` to `last` (default: the last step)."""
        end = self.number_of(last) if last is not None else len(self.actions)
        self.recoveries.append(Recovery(self.number_of(first), end, title, actions))

    def recovery_for(self, number: int) -> Recovery | None:
        """The innermost recovery covering a failed step (the one that starts latest)."""
        covering = [r for r in self.recoveries if r.covers(number)]
        return max(covering, key=lambda r: r.first) if covering else None

    def confirmations(self) -> list[str]:
        """What this plan deletes that the user must accept (--yes, or a question on a terminal)."""
        return [a.confirm for a in self.actions if a.confirm and not a.noop]

    @property
    def changes(self) -> bool:
        return any(not a.noop for a in self.actions if a.step not in CHECKS_ONLY)

    def text(self) -> str:
        """The plan as printed: each line through the one sanitiser (a plan quotes the host: process
        names, holders, file names), so it reaches the terminal without control characters."""
        return "\n".join(fmt.printable(line) for line in self._lines())

    def _lines(self) -> list[str]:
        lines = [f"Plan: {self.operation} {self.model} on {self.host_desc}"]
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        every = self.actions + [a for r in self.recoveries for a in r.actions]
        width = max((len(a.key) for a in every), default=6)
        lines += _action_lines(self.actions, width, lambda i: f"{i:>2}.")
        if self.refusal:
            lines.append(f"  REFUSED: {self.refusal}")
            if self.refusal.hint:
                lines.append(f"  hint: {self.refusal.hint}")
            return lines
        if not self.changes:
            lines.append("  Nothing to change.")
        for r in self.recoveries:
            span = f"step {r.first}" if r.first == r.last else f"steps {r.first}-{r.last}"
            lines.append(f"  If {span} fail{'s' if r.first == r.last else ''}: {r.title}")
            lines += _action_lines(r.actions, width, lambda i: f"r{i}.")
        return lines


def _action_lines(actions: list[Action], width: int, label: Callable[[int], str]) -> list[str]:
    out = []
    for i, a in enumerate(actions, 1):
        first, *rest = a.lines()
        marker = "-" if a.noop else "*"
        out.append(f"  {label(i):>3} {a.key:<{width}} {marker} {first}")
        out += [f"  {'':>3} {'':<{width}}   {r}" for r in rest]
    return out
