"""What every host-changing operation shares: the session (connect, and hold the host's deploy lock
unless it is a dry run) and the operation's result (plan, outcome, error, JSON shape)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from orchestrator.config.inventory import HostEntry
from orchestrator.errors import OrchestratorError
from orchestrator.host import cancel, state
from orchestrator.host.base import Host
from orchestrator.host.connect import open_host
from orchestrator.ops.execute import RunOutcome
from orchestrator.ops.gather import lock_facts
from orchestrator.plan.inputs import LockFacts
from orchestrator.plan.model import Plan


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

    @property
    def exit_code(self) -> int:
        """0 ok, else the error's (2 bad input, 3 refused, 130 interrupted, 1 failed)."""
        return 0 if self.ok else (self.error.exit_code if self.error is not None else 1)

    def as_dict(self) -> dict:
        d = {"operation": self.operation, "host": self.host, "model": self.model, "ok": self.ok,
             "dry_run": self.dry_run, "seconds": round(self.seconds, 3),
             "plan": [{"step": a.step, "noop": a.noop, "summary": a.summary} for a in self.plan.actions],
             "recoveries": [{"steps": [r.first, r.last], "title": r.title,
                             "plan": [{"step": a.step, "summary": a.summary} for a in r.actions]}
                            for r in self.plan.recoveries],
             "refused": str(self.plan.refusal) if self.plan.refusal else None,
             "steps": [r.as_dict() for r in self.outcome.results] if self.outcome else [],
             "recovery": self.outcome.recovery.as_dict() if self.outcome and self.outcome.recovery else None,
             "error": str(self.error) if self.error else None, **self.extra}
        if self.error is not None:
            d["error_details"] = self.error.details
            d["exit_code"] = self.error.exit_code
        return d


@dataclass
class Session:
    host: Host
    entry: HostEntry
    lock: LockFacts
    holder: state.HostLock | None = None        # None for dry runs, which never take the lock

    @property
    def guard(self) -> Callable[[], str | None] | None:
        """What the executor calls before every step (orchestrator.plan.run.RunEnv.guard)."""
        return self.holder.ensure if self.holder is not None else None

    def holds_lock(self) -> bool:
        """The lock is (still, or again) ours: only then is anything written on the host, the
        history record included. Always True for a dry run (it writes nothing)."""
        if self.holder is None:
            return True
        try:
            self.holder.ensure()
        except state.LockLost:
            return False
        return True


@contextmanager
def session(entry: HostEntry, operation: str, dry_run: bool, accept_new_host_key: bool = False) -> Iterator[Session]:
    """Open the host and, unless dry-run, hold its deploy lock for the whole operation, which
    Ctrl-C, SIGTERM and SIGHUP cancel cooperatively (host/cancel.py)."""
    with cancel.cancellation(), _session(entry, operation, dry_run, accept_new_host_key) as s:
        yield s


@contextmanager
def _session(entry: HostEntry, operation: str, dry_run: bool, accept_new_host_key: bool) -> Iterator[Session]:
    host = open_host(entry, accept_new_host_key)
    lock = None
    try:
        if not dry_run:
            lock = state.HostLock(host, entry, operation)
            lock.acquire()
            state.upgrade_records(host, entry)      # a host's legacy active.json -> services/MODEL.json
        yield Session(host, entry, lock_facts(host, entry, held=not dry_run), lock)
    finally:
        if lock is not None:
            lock.release()
        host.close()
