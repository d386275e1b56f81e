"""Plans: an ordered list of actions, each "nothing to do, because ..." or the exact commands.

The same Plan object is printed by --dry-run and executed by execute.run_plan: there is no
`if dry_run` inside step code. Text rendering is deterministic (no timings) so golden tests can
pin it down.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from orchestrator.errors import RefusedError
from orchestrator.host.base import Command, printable


@dataclass
class Action:
    step: str                                   # short key: lock, preflight, disk, download, ...
    summary: str                                # one line: what will happen, or why nothing will
    noop: bool = False
    commands: list[Command] = field(default_factory=list)   # shown; run in order unless `run` is set
    details: list[str] = field(default_factory=list)         # extra lines (checks, diffs, folders)
    run: Callable[[Any], str | None] | None = None            # custom apply; returns a result line
    warn: bool = False                          # show the summary as a warning

    def lines(self) -> list[str]:
        out = [self.summary]
        out += [f"  {d}" for d in self.details]
        out += [f"  $ {printable(c)}" for c in self.commands]
        return out


@dataclass
class Plan:
    operation: str
    host_desc: str
    model: str
    actions: list[Action] = field(default_factory=list)
    refusal: RefusedError | None = None         # a safety check refused: nothing will be executed
    warnings: list[str] = field(default_factory=list)

    def add(self, action: Action) -> Action:
        self.actions.append(action)
        return action

    def add_checked(self, action: Action, refusal: RefusedError | None) -> bool:
        """Add a step that may refuse; True (stop planning) when it did."""
        self.add(action)
        if refusal is not None:
            self.refusal = refusal
        return refusal is not None

    @property
    def changes(self) -> bool:
        return any(not a.noop for a in self.actions if a.step not in ("lock", "preflight", "record"))

    def text(self) -> str:
        lines = [f"Plan: {self.operation} {self.model} on {self.host_desc}"]
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        width = max((len(a.step) for a in self.actions), default=6)
        for i, a in enumerate(self.actions, 1):
            first, *rest = a.lines()
            marker = "-" if a.noop else "*"
            lines.append(f"  {i:>2}. {a.step:<{width}} {marker} {first}")
            lines += [f"  {'':>2}  {'':<{width}}   {r}" for r in rest]
        if self.refusal:
            lines.append(f"  REFUSED: {self.refusal}")
            if self.refusal.hint:
                lines.append(f"  hint: {self.refusal.hint}")
        elif not self.changes:
            lines.append("  Nothing to change.")
        return "\n".join(lines)
