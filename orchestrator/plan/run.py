"""What a plan's steps share when they run: the RunEnv they act through, and the typed RunRecord
they fill in (instead of a dict passed between steps).

Planners bind everything a step needs about its service when they build it (the manifest, the
rendered files, the API key); the RunEnv carries only what belongs to the run (the host connection,
the inventory entry, the options, the live reporter), and the RunRecord what a step produced that a
later step, the recovery branch or the operation's history record needs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from orchestrator.config.inventory import HostEntry
from orchestrator.host.base import Host
from orchestrator.host.ownership import Proc
from orchestrator.host.records import Canary

if TYPE_CHECKING:
    from orchestrator.host.download import Peer
    from orchestrator.probe.readiness import Ready

GPU_RELEASE_TIMEOUT_S = 90     # one public script waits up to 90 s for memory after killing workers


class Seeds(Protocol):
    """Download once per fleet (ops/seed.py FleetSeeds): which host of the fleet a checkpoint
    (repo, commit) is copied from. One per fleet command; None for a command on one host."""

    def source(self, host: str, key: tuple[str, str]) -> str | None: ...

    def plan(self, host: str, key: tuple[str, str]) -> None: ...

    def hold(self, host: str, key: tuple[str, str], folder: str) -> None: ...

    def claim(self, host: str, key: tuple[str, str]) -> Peer | None: ...

    def failed(self, host: str, key: tuple[str, str]) -> None: ...


@dataclass(frozen=True)
class Options:
    """The user's choices for one operation (CLI flags), plus test knobs for time budgets."""

    kill_foreign: bool = False
    enable: bool = False
    yes: bool = False
    skip_checks: frozenset[str] = frozenset()
    budget_s: float | None = None           # override the manifest's start-up budget (tests)
    no_progress_s: float | None = None
    poll_s: float = 0.5
    gpu_release_timeout_s: float = GPU_RELEASE_TIMEOUT_S
    warm: bool = False                      # warm the page cache before the start (swap: on by default)
    replace: str | None = None              # swap --replace: the service the new model replaces
    sleep_old: bool = False                 # swap --sleep-old: the old service sleeps instead of stopping
    verify_engine: bool = False             # --verify-engine: the engine venv's full check, not its recorded verdict
    seeds: Seeds | None = field(default=None, compare=False)   # a fleet command: download once per fleet


@dataclass
class DownloadResult:
    bytes: int
    seconds: float
    files: int
    commit: str | None
    peer: str | None = None         # the fleet host it was copied from (download once per fleet)
    peer_bytes: int = 0             # of `bytes`, copied from that host


@dataclass
class WarmResult:
    """What the page-cache warm-up did (orchestrator.plan.warm)."""

    warmed_bytes: int = 0           # read from disk into the page cache by this run
    cached_bytes: int = 0           # of the weight files, in the page cache when it ended
    total_bytes: int = 0
    seconds: float = 0.0
    reason: str = ""                # complete | budget | memory | nofiles (host/remote/warm.py)
    min_headroom: int | None = None     # least available memory, net of the warmed pages, it saw
    error: str | None = None        # the warm-up failed (the swap went on, loading from disk)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class RunRecord:
    """What the steps of one run produced, in the order they ran."""

    download: DownloadResult | None = None
    engine: dict | None = None                  # the engine step's build: venv name, version, seconds, bytes
    warm: WarmResult | None = None
    stopped_at: float | None = None             # monotonic time the old service was stopped (swap)
    ready_at: float | None = None               # monotonic time the new service passed its gates
    ready: dict[str, Ready] = field(default_factory=dict)         # model -> its readiness result
    started: set[str] = field(default_factory=set)                # services this run started
    log_cursors: dict[str, str] = field(default_factory=dict)     # model -> log position at start
    perf: dict[str, dict] = field(default_factory=dict)           # model -> its throughput measurement
    warnings: list[str] = field(default_factory=list)             # said during the run, kept for the end
    killed: list[Proc] = field(default_factory=list)              # stop: the leftovers it killed
    deleted: list[tuple[str, int]] = field(default_factory=list)  # gc: (folder, bytes) deleted
    kept: list[tuple[str, str]] = field(default_factory=list)     # gc: (folder, why) the host refused to delete
    sleeps: dict[str, dict] = field(default_factory=dict)         # service -> its sleep (level, seconds, MiB kept)
    wakes: dict[str, dict] = field(default_factory=dict)          # service -> its wake (seconds, canary, warm-up)
    canaries: dict[str, Canary] = field(default_factory=dict)     # service -> its Canary at its first ready
    gateway_up: set[str] = field(default_factory=set)             # services this run routes before they serve
    gateway_down: set[str] = field(default_factory=set)           # services this run drained at the gateway
    gateway_held: set[str] = field(default_factory=set)           # services it restarts: requests wait at the gateway

    def downtime_s(self) -> float | None:
        if self.stopped_at is None or self.ready_at is None:
            return None
        return round(self.ready_at - self.stopped_at, 3)


class Progress(Protocol):
    """A live progress display fed with a host-side script's events (ops/progress.py)."""

    def handle(self, event: dict) -> None: ...


class StepReporter(Protocol):
    """What a step may tell the person watching (ops/execute.Reporter is it): an event line, and a
    progress display for a download or a warm-up (None when nobody watches, e.g. --json)."""

    def event(self, kind: str, text: str) -> None: ...

    def progress(self, kind: str, label: str, total: int = 0) -> AbstractContextManager[Progress | None]: ...


@dataclass
class RunEnv:
    host: Host
    entry: HostEntry
    opts: Options
    reporter: StepReporter | None = None
    record: RunRecord = field(default_factory=RunRecord)
    # Called before every step: None while the host lock is ours, a note when it was re-taken after
    # a dropped connection; raises (LockLost) when it is not ours any more. None for no lock.
    guard: Callable[[], str | None] | None = None
    # A run over several nodes (orchestrator.ops.nodes): every node's env by inventory name, this one's
    # (the head's) included; an action naming a node runs with its env. Empty for one host.
    nodes: dict[str, RunEnv] = field(default_factory=dict)

    def event(self, kind: str, text: str) -> None:
        if self.reporter is not None:
            self.reporter.event(kind, text)

    def progress(self, kind: str, label: str, total: int = 0) -> AbstractContextManager[Progress | None]:
        """The reporter's progress display for a download or warm-up (None: nobody watches)."""
        return self.reporter.progress(kind, label, total) if self.reporter is not None else nullcontext(None)
