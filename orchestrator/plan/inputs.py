"""What a planner is given: typed facts gathered before planning (orchestrator.ops.gather), so that
planners are pure functions of (manifest, host entry, facts, options) -> Plan and can be tested with
fake facts and no host at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from orchestrator.config.effective import Effective
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.config.placement import ServiceSpec
from orchestrator.host.engine import EngineState
from orchestrator.host.facts import HostFacts
from orchestrator.plan.preflight import Check
from orchestrator.plan.run import Options
from orchestrator.render.artifacts import Rendered
from orchestrator.secret import Secret


@dataclass(frozen=True)
class LockFacts:
    held: bool                                  # this run holds the host's deploy lock
    holder: dict | None = None                  # who holds it (dry runs, which never take it)
    path: str = ""


@dataclass(frozen=True)
class DownloadPlan:
    """What the download step must fetch: from our verified record when the revision is pinned,
    else from the Hub's metadata (read on the host by the download script in plan-only mode)."""

    total_bytes: int
    have_bytes: int
    to_fetch_bytes: int
    files: int
    to_fetch: tuple[str, ...] = ()
    commit: str | None = None
    from_record: bool = False

    @classmethod
    def from_event(cls, event: Mapping) -> DownloadPlan:
        return cls(total_bytes=int(event.get("total_bytes") or 0), have_bytes=int(event.get("have_bytes") or 0),
                   to_fetch_bytes=int(event.get("to_fetch_bytes") or 0), files=int(event.get("files") or 0),
                   to_fetch=tuple(event.get("to_fetch") or ()), commit=event.get("commit"))


@dataclass(frozen=True)
class WarmFacts:
    """The new model's weight files as the warm script sees them (orchestrator/host/warm.py,
    plan-only): in vLLM's load order, with how much of each is in the page cache now."""

    model_dir: str
    files: tuple[tuple[str, int, int], ...] = ()        # (name, bytes, cached bytes)
    weights_bytes: int | None = None                    # the index's metadata.total_size: what loads
    error: str | None = None                            # the survey failed: why

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self.files)

    @property
    def cached_bytes(self) -> int:
        return sum(cached for _, _, cached in self.files)

    @classmethod
    def from_event(cls, model_dir: str, event: Mapping) -> WarmFacts:
        weights = event.get("weights_bytes")
        return cls(model_dir, tuple((str(n), int(s), int(c)) for n, s, c in event.get("files") or ()),
                   weights_bytes=int(weights) if weights else None)


@dataclass(frozen=True)
class ServiceInput:
    """One model's service on the host: its manifest (as it runs there: hardware class and host
    settings applied, config/effective.py), rendered files, what is installed now."""

    manifest: Manifest
    rendered: Rendered
    secrets: Mapping[str, Secret] = field(default_factory=dict)
    installed_files: Mapping[str, bytes | None] = field(default_factory=dict)   # path -> content now
    serving: bool = False                       # /health 200 and the served name listed (probed live)
    effective: Effective | None = None          # which class applied, where each value comes from
    spec: ServiceSpec | None = None             # the service value it was rendered from (None: tests' shortcut)

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def model(self) -> str:
        """The model it serves (its manifest): the service's name unless --name."""
        return self.rendered.model or self.manifest.name

    @property
    def folder(self) -> str:
        """Its weights folder's name under models_root (shared by every manifest of its checkpoint)."""
        return self.rendered.folder

    @property
    def api_key(self) -> Secret | None:
        return self.secrets.get("VLLM_API_KEY")


@dataclass(frozen=True)
class Measured:
    """This host's last start of the model (history's `startup`, plan/warm.startup_ledger): the seconds
    of everything but reading the weights (compile, graphs, engine init, API, first answer), and the
    weights' read rate when that start read them almost all from the page cache or almost all from
    the disk (its warm-up says which)."""

    at: str
    other_s: float
    cached_bytes_s: float | None = None
    disk_bytes_s: float | None = None


@dataclass(frozen=True)
class PlanInput:
    """Everything deploy's and swap's planners look at."""

    entry: HostEntry
    facts: HostFacts
    opts: Options
    lock: LockFacts
    target: ServiceInput
    download: DownloadPlan | None = None        # None when planning stopped before it was needed
    preflight: list[Check] = field(default_factory=list)
    hf_token: Secret | None = None
    old: ServiceInput | None = None             # swap: the model being replaced
    warm: WarmFacts | None = None               # the new model's page-cache state (when warming)
    engine: EngineState | None = None           # the service's engine venv (a manifest with `engine:`)
    measured: Measured | None = None            # this host's last start of it (history's ledger)

    @property
    def name(self) -> str:
        return self.target.name


@dataclass(frozen=True)
class RegenInput:
    entry: HostEntry
    facts: HostFacts
    opts: Options
    lock: LockFacts
    services: list[ServiceInput]                # every installed model that still has a manifest
    orphaned: list[str] = field(default_factory=list)   # installed, but no manifest now
    restart: bool = False
    engines: Mapping[str, EngineState] = field(default_factory=dict)   # service -> its engine venv (`engine:`)
