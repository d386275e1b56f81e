"""Running one per-host operation on several hosts: bounded parallelism, a per-host phase board the
CLI's progress view reads, one row per host, and the fleet's exit code.

Pure scheduling: what runs on a host is the caller's callable (today's per-host function of each
command: run_deploy, run_swap, stop_model...), so a fleet run is the per-host runs side by side and
a host's failure (even an unreachable host, or a bug that raises) is that host's row, never the end
of the run. A rolling run (swap) bounds the hosts in flight with `parallel` (--max-unavailable) and
stops starting hosts after the first failure unless told to go on; the hosts never started keep
their row as `not run` (untouched).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.errors import OrchestratorError
from orchestrator.host import cancel
from orchestrator.ops.execute import Reporter

DEFAULT_PARALLEL_CAP = 16      # hosts at once when --parallel is not given: one thread and connection each

# Which exit code wins when hosts end differently: an interrupt, then a failure (something changed
# and did not work), then a refusal (nothing changed), then bad input, then ok.
SEVERITY = {130: 5, 1: 4, 3: 3, 2: 2, 0: 0}


def per_host(m: Manifest, hosts: Sequence[HostEntry]) -> bool:
    """Whether a command on these hosts is one run per host (a fleet: the same service on each) or
    ONE run of one service over them (one host, or the nodes of a multi-node model, head first)."""
    return m.multinode is None and len(hosts) > 1


def worst_exit(codes: Sequence[int]) -> int:
    """The fleet's exit code: the most severe of the hosts' (SEVERITY; an unknown code counts as a failure)."""
    return max(codes, key=lambda c: SEVERITY.get(c, 4), default=0)


@dataclass
class HostOutcome:
    """What a per-host callable returns: its exit code, the root cause of a failure in one line, a
    short note for the summary (e.g. what the host serves) and the host's --json object."""

    code: int
    cause: str | None = None
    note: str = ""
    data: dict = field(default_factory=dict)
    value: Any = None                  # the per-host function's own result (OpResult...), for the caller


@dataclass
class HostRow:
    host: str
    result: str                        # ok | failed | refused | bad input | interrupted | not run
    code: int
    seconds: float = 0.0
    cause: str | None = None
    note: str = ""
    data: dict = field(default_factory=dict)
    value: Any = None

    @property
    def ran(self) -> bool:
        return self.result != "not run"

    def as_dict(self) -> dict:
        return {"host": self.host, "result": self.result, "exit_code": self.code, "seconds": round(self.seconds, 3),
                "cause": self.cause, "note": self.note or None, **({"detail": self.data} if self.data else {})}


RESULT_NAMES = {0: "ok", 1: "failed", 2: "bad input", 3: "refused", 130: "interrupted"}


def root_cause(err: BaseException) -> str:
    """One line: `step: message` of an operation's error (the host is the row's), else the exception."""
    if isinstance(err, OrchestratorError):
        text = f"{err.step}: {err.message}" if err.step else err.message
    else:
        text = f"{type(err).__name__}: {err}"
    return " ".join(text.split())


def outcome_of(result: Any) -> HostOutcome:
    """The outcome of an OpResult (deploy, swap, regen): exit code and root cause from its error."""
    err = result.error
    code = 0 if result.ok else (err.exit_code if err is not None else 1)
    return HostOutcome(code, None if result.ok else (root_cause(err) if err is not None else "failed"),
                       data=result.as_dict(), value=result)


class Board:
    """Each host's phase and when it started, shared between the workers and the progress view.
    `on_change(host, phase)` (plain output) is called on every change, under the board's lock."""

    def __init__(self, hosts: Sequence[str], on_change: Callable[[str, str], None] | None = None):
        self._lock = threading.Lock()
        self._phase = {h: "waiting" for h in hosts}
        self._start: dict[str, float] = {}
        self._end: dict[str, float] = {}
        self._on_change = on_change

    def set(self, host: str, phase: str, *, start: bool = False, end: bool = False) -> None:
        with self._lock:
            if start:
                self._start[host] = time.monotonic()
            if end:
                self._end[host] = time.monotonic()
            if self._phase.get(host) == phase:
                return
            self._phase[host] = phase
            if self._on_change is not None:
                self._on_change(host, phase)

    def snapshot(self) -> list[tuple[str, str, float | None]]:
        """(host, phase, seconds since it started or None) in the hosts' order."""
        now = time.monotonic()
        with self._lock:
            return [(h, p, (self._end.get(h, now) - self._start[h]) if h in self._start else None)
                    for h, p in self._phase.items()]


class PhaseReporter(Reporter):
    """A quiet Reporter (the fleet prints no step lists) that posts each step and loading phase of
    its host to the board."""

    def __init__(self, board: Board, host: str):
        super().__init__(None, quiet=True)
        self.board, self.host = board, host

    def step_start(self, index, total, action) -> None:
        self.board.set(self.host, f"[{index}/{total}] {action.step}")

    def event(self, kind: str, text: str) -> None:
        if kind == "phase":
            self.board.set(self.host, f"ready: {text}"[:60])


PerHost = Callable[[HostEntry, PhaseReporter], HostOutcome]


def run_fleet(entries: Sequence[HostEntry], per_host: PerHost, parallel: int | None = None,
              board: Board | None = None, stop_on_failure: bool = False) -> list[HostRow]:
    """Run per_host on every entry, at most `parallel` at once (None: all, capped at
    DEFAULT_PARALLEL_CAP), hosts started in the order given. stop_on_failure: once a host's run
    ends with a non-zero code, no more hosts start (those in flight finish). Rows in entries' order."""
    board = board or Board([e.name for e in entries])
    width = max(1, min(parallel or DEFAULT_PARALLEL_CAP, len(entries) or 1))
    rows: dict[str, HostRow] = {e.name: HostRow(e.name, "not run", 0) for e in entries}
    pending = list(entries)
    lock = threading.Lock()
    stop = threading.Event()

    def next_entry() -> HostEntry | None:
        with lock:
            token = cancel.current()
            if stop.is_set() or not pending or (token is not None and token.count):
                return None
            return pending.pop(0)

    def one(entry: HostEntry) -> HostRow:
        t0 = time.monotonic()
        try:
            board.set(entry.name, "connecting", start=True)
            out = per_host(entry, PhaseReporter(board, entry.name))
        except OrchestratorError as err:          # e.g. unreachable, lock held: this host's row
            out = HostOutcome(err.exit_code, root_cause(err))
        except Exception as err:                  # a bug on one host must not end the others' runs
            out = HostOutcome(1, root_cause(err))
        except KeyboardInterrupt:                 # cancelled (host/cancel.py) outside a plan's own handling
            out = HostOutcome(130, "interrupted")
        return HostRow(entry.name, RESULT_NAMES.get(out.code, "failed"), out.code, time.monotonic() - t0,
                       out.cause, out.note, out.data, out.value)

    def worker() -> None:
        entry = None
        try:
            while (entry := next_entry()) is not None:
                row = one(entry)
                with lock:
                    rows[entry.name] = row
                    if row.code != 0 and stop_on_failure:
                        stop.set()
                board.set(entry.name, row.result, end=True)
        except KeyboardInterrupt:                 # cancelled between two hosts: no host is left half-recorded
            if entry is not None and not rows[entry.name].ran:
                rows[entry.name] = HostRow(entry.name, "interrupted", 130, cause="interrupted")

    with cancel.cancellation() as token:          # every host's run shares it: an interrupt reaches them all
        threads = [threading.Thread(target=worker, name=f"fleet-{i}", daemon=True) for i in range(width)]
        interrupted = _wait(threads, stop, token)
    for name, row in rows.items():
        if not row.ran:
            row.cause = "not started: interrupted" if interrupted else row.cause
            board.set(name, "not run")
    return [rows[e.name] for e in entries]


def _wait(threads: list[threading.Thread], stop: threading.Event, token: cancel.CancelToken) -> bool:
    """Start and join the workers. Ctrl-C / SIGTERM cancel the fleet's token (host/cancel.py: the
    CLI's handler does it; a KeyboardInterrupt this thread gets anyway does it here), which every
    host's run checks between its steps and in its waits, so each stops as it would alone: its
    recovery branch (a swap's rollback) runs and its row says `interrupted`; no more hosts start. A
    second interrupt reaches them too (each abandons its recovery, as on one host). Nothing is
    raised into another thread. True when interrupted."""
    try:
        for t in threads:
            t.start()
    except KeyboardInterrupt:
        token.cancel()
    while any(t.is_alive() for t in threads):
        try:                                      # not Thread.join: a join interrupted by Ctrl-C left a
            time.sleep(0.1)                       # running worker reported dead here (CPython 3.11)
        except KeyboardInterrupt:
            token.cancel()
        if token.count:
            stop.set()                            # the hosts started finish (their recovery), no more start
    return token.count > 0


# -- a rolling swap ------------------------------------------------------------------------------------

def rolling_swap(entries: Sequence[HostEntry], run_one: Callable[[HostEntry, PhaseReporter], Any],
                 max_unavailable: int, continue_on_failure: bool, board: Board | None = None) -> list[HostRow]:
    """swap across hosts: at most max_unavailable hosts swapping at a time, in the order given; each
    host's own swap stages, gates and rolls back as on one host (run_one: its OpResult). The first
    failed host stops the rollout (hosts not started stay as they are) unless continue_on_failure,
    so every host serves the old or the new model. A failed host's cause names its rollback."""
    def one(entry: HostEntry, reporter: PhaseReporter) -> HostOutcome:
        result = run_one(entry, reporter)
        out = outcome_of(result)
        rb = result.extra.get("rollback")
        if rb is not None and out.cause:
            out.cause = f"{out.cause}; rollback: {rb['result']}"
        return out

    rows = run_fleet(entries, one, max_unavailable, board, stop_on_failure=not continue_on_failure)
    for r in rows:
        if not r.ran and r.cause is None:
            r.cause = "not started: the rollout stopped at the failed host"
    return rows


# -- the fleet's dry run: identical per-host plans once ----------------------------------------------

_TIMES = re.compile(r"\s*\(\d+(\.\d+)?\s?m?s\)")
_PIDS = re.compile(r"\bPIDs? \d+(, \d+)*")
_HOST_PATHS = ("models_root", "units_dir", "env_dir", "state_dir", "log_dir", "vllm", "python", "nvidia_smi",
               "meminfo")


def normalised_plan(text: str, entry: HostEntry) -> str:
    """A host's plan text with what always differs between hosts taken out (its name and
    description, its own folders, PIDs, check timings), so equal plans compare equal; what is
    left to differ (a port, a download, a refusal) is a real difference."""
    text = text.replace(entry.describe(), "<host>")
    paths = sorted(((getattr(entry, f), f) for f in _HOST_PATHS if getattr(entry, f, "").startswith("/")),
                   key=lambda p: -len(p[0]))
    for value, name in paths:
        text = re.sub(rf"{re.escape(value)}(?=/|\b|$)", f"<{name}>", text)
    text = re.sub(rf"(?<![\w/-]){re.escape(entry.name)}(?![\w/-])", "<host>", text)
    text = _PIDS.sub("PID <pid>", text)
    return _TIMES.sub("", text)


def group_plans(plans: Sequence[tuple[str, str]]) -> list[tuple[list[str], str]]:
    """[(host, normalised plan)] -> [(hosts, plan)], most hosts first (then first seen): the fleet
    plan is the per-host plans, each distinct one once."""
    groups: dict[str, list[str]] = {}
    for host, text in plans:
        groups.setdefault(text, []).append(host)
    order = {text: i for i, text in enumerate(groups)}
    return sorted(((hosts, text) for text, hosts in groups.items()),
                  key=lambda g: (-len(g[0]), order[g[1]]))
