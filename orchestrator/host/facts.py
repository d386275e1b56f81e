"""Facts about a host, read in one round trip (remote/facts_script.py) and parsed here.

Everything a plan decides on comes from HostFacts: disk, GPUs and who holds them, the vLLM
version, the managed model folders, what vllm-orch installed and what runs.

The script's answer is untrusted (the host could be anyone's): each of its sections has a typed
parser below (FactsAnswer and its section models; tests/fixtures/facts has a fixture of each), and
an answer whose section is not of its shape is refused in one line naming the section and field
(RefusedError, exit 3). The records in it are the host/records.py models, read leniently: a record
file that does not parse is left out and named in HostFacts.bad_records. The status extras (history
tail, uptime, lock holder, health checks) are read field by field: what is not of its shape is left
out, so `status` still shows the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator

from orchestrator.config.inventory import HostEntry
from orchestrator.config.placement import Placement, Recorded
from orchestrator.errors import CommandFailed, RefusedError
from orchestrator.host import nvidia_smi as gpu
from orchestrator.host import scripts
from orchestrator.host.base import Host
from orchestrator.host.modeldirs import is_ours
from orchestrator.host.ownership import Proc, classify
from orchestrator.host.records import Asleep, InstalledRecord, Record, ServiceRecord, SwapMarker
from orchestrator.host.services import ServiceState

R = TypeVar("R", bound=Record)


@dataclass
class ModelDir:
    name: str
    bytes: int
    verified: dict | None         # its .vllm-orch/verified.json (written by our download script)
    last_used: float

    @property
    def ours(self) -> bool:
        """Made by vllm-orch: only such folders are ever deleted (orchestrator/host/modeldirs.py)."""
        return is_ours(self.verified)

    @property
    def complete(self) -> bool:
        """Every selected file downloaded and verified."""
        return self.ours and bool((self.verified or {}).get("complete"))


@dataclass(frozen=True)
class Memory:
    """The host's RAM (bytes): MemTotal and MemAvailable (None when the kernel has no such line)."""

    total: int
    available: int | None
    source: str = "/proc/meminfo"


@dataclass
class HostFacts:
    hostname: str
    disk_path: str
    disk_total: int
    disk_free: int
    gpus: list                    # list[gpu.Gpu]
    gpu_error: str | None
    driver_version: str | None
    cuda_version: str | None
    procs: list[Proc]
    vllm_version: str | None
    vllm_error: str | None
    models: dict[str, ModelDir]
    active: ServiceRecord | None   # a legacy active.json (a host from before services/NAME.json)
    installed: dict[str, InstalledRecord]
    services: dict[str, ServiceState]
    usage: dict[str, float]
    ports: dict[int, list[Proc]] = field(default_factory=dict)   # port -> processes bound to it
    half_swap: SwapMarker | None = None   # swap.json: a swap that stopped its old model and has not ended
    users: dict[str, dict | None] = field(default_factory=dict)  # the service user: uid, gid, home (None: missing)
    service_reach: dict | None = None     # can the service user run vllm (facts_script.service_reach)
    root_trust: dict | None = None        # who could change what root runs and writes (facts_script.root_trust)
    memory: Memory | None = None          # None when the memory file could not be read
    raw: dict = field(repr=False, default_factory=dict)
    records: dict[str, ServiceRecord] = field(default_factory=dict)   # services/NAME.json by service name
    bad_records: list[str] = field(default_factory=list)   # record files that did not parse: which, and why
    time: float | None = None                               # the host's clock when the facts were read

    def __post_init__(self) -> None:
        """A legacy active.json reads as its model's record (the first locked operation moves it,
        host/state.upgrade_records); a record under services/ wins over it."""
        if self.active is not None and self.active.model not in self.records:
            self.records = {**self.records, self.active.model: self.active}

    def record(self, name: str) -> ServiceRecord | None:
        """The record of the service NAME (None: vllm-orch never recorded it serving)."""
        return self.records.get(name)

    def model_of(self, name: str) -> str:
        """The model the service NAME runs, as its records say (a service is named after its model
        unless deployed with --name): its record, else its installed record, else NAME."""
        rec = self.record(name) or self.installed.get(name)
        return (rec.model if rec is not None else None) or name

    def recorded_placement(self, name: str) -> Recorded | None:
        """Where the service NAME was installed (its GPUs and port, and which of them a run placed
        there); None: not installed."""
        rec = self.installed.get(name)
        return rec.placement() if rec is not None else None

    def placements(self, name: str, host: str) -> list[Placement]:
        """Every place the service NAME takes on this host: where it runs (its record) and, when its
        installed files name another place (regen installed them without --restart), where its next
        start puts it (a restart, the health timer, a reboot, a swap's rollback)."""
        out: list[Placement] = []
        for rec in (self.record(name), self.installed.get(name)):
            if rec is None or not (rec.gpus or rec.port):
                continue
            p = Placement(name, rec.model or name, host, tuple(rec.gpus), rec.port, rec.binds(),
                          asleep=self.asleep(name) is not None)
            if all((p.gpus, p.port, p.binds) != (q.gpus, q.port, q.binds) for q in out):
                out.append(p)
        return out

    def placement(self, name: str, host: str) -> Placement | None:
        """Where the service NAME runs on this host, as far as vllm-orch knows: its record (the GPUs
        and port it was started with), else its installed record; None: neither. The one answer to
        "which GPUs does this service use" (overlap checks, stop, status)."""
        rec: ServiceRecord | InstalledRecord | None = self.record(name) or self.installed.get(name)
        if rec is None:
            return None
        return Placement(name, rec.model or name, host, tuple(rec.gpus), rec.port, rec.binds())

    def folder_records(self) -> dict[str, object]:
        """Each folder under models_root with its parsed .vllm-orch/verified.json (None: not ours), as
        config/checkpoints.py reads them."""
        return {n: d.verified for n, d in self.models.items()}

    def installed_folder(self, name: str) -> str | None:
        """The weights folder the installed unit of NAME serves from (a record from before folders were
        recorded: its model's, the folder it was deployed with); None: not installed."""
        rec = self.installed.get(name)
        return (rec.folder or rec.model or name) if rec is not None else None

    def folder_of(self, name: str) -> str:
        """The weights folder (under models_root) the service NAME uses, as its records say: its
        record's, else its installed record's, else (a record from before folders were recorded)
        its model's name, the folder such a service was deployed with."""
        rec = self.record(name)
        return (rec.folder if rec is not None else None) or self.installed_folder(name) or self.model_of(name)

    def models_in_use(self) -> set[str]:
        """The model folders the host's services use: every recorded and every running service's
        (sleepers are recorded; a folder is shared by every service of its checkpoint, and any one
        of them keeps it), and the running services' own names. Disk freeing and gc never delete
        these."""
        running = self.running()
        return set(running) | {self.folder_of(n) for n in (*self.records, *running)}

    def asleep(self, name: str) -> Asleep | None:
        """How the service NAME sleeps (its record says it was put to sleep and its unit still
        runs), None when it is awake or not running."""
        rec, st = self.record(name), self.services.get(name)
        return rec.asleep if rec is not None and rec.asleep is not None and st is not None and st.active else None

    def sleeping(self) -> set[str]:
        """The host's services asleep now."""
        return {n for n in self.records if self.asleep(n) is not None}

    def running(self) -> list[str]:
        return [name for name, st in self.services.items() if st.active]

    def services_known(self) -> set[str]:
        """The host's services vllm-orch knows of: recorded or running. What one of them left between
        two of its starts is theirs (host/ownership.holders' `protected`)."""
        return set(self.records) | set(self.running())

    def gpu_memory_used(self, indices: list[int]) -> int:
        return sum(g.memory_used_mib or 0 for g in self.gpus if g.index in indices)


def gather(host: Host, entry: HostEntry, models: list[str] | None = None,
           ports: list[int] | None = None) -> HostFacts:
    return parse(_run(host, entry, {"ports": ports or [], "models": models or []}), entry.name)


def gather_for_status(host: Host, entry: HostEntry, history_tail: int) -> tuple[HostFacts, StatusExtras]:
    """The facts `status` shows, and its extras (facts_script.status_extras: uptime, lock holder,
    health checks, the last `history_tail` lines of history.jsonl), in ONE round trip. The script
    adds the active record's model itself and leaves out what status does not show (nvidia-smi's
    banner, the service user, port holders): a fleet's status costs every host this script's CPU."""
    raw = _run(host, entry, {"ports": [], "models": [], "status": {"history_tail": history_tail}})
    ans = read_answer(raw, entry.name)
    return from_answer(ans, raw), ans.status if ans.status is not None else StatusExtras()


def _run(host: Host, entry: HostEntry, request: dict) -> dict:
    args = {**request, "meminfo": entry.meminfo, "models_root": entry.models_root,
            "state_dir": entry.state_dir, "nvidia_smi": entry.nvidia_smi,
            "vllm": entry.vllm, "manager": entry.service_manager, "users": [entry.service_user],
            "trust": {"programs": entry.root_programs, "folders": entry.root_folders},
            "gpu_query": gpu.query_gpus_argv(entry.nvidia_smi),
            "apps_query": gpu.query_compute_apps_argv(entry.nvidia_smi)}
    r = scripts.run(host, entry.python, "facts_script.py", [json.dumps(args)], timeout=180)
    if r.exit_code != 0:
        hint = None
        if r.exit_code == 127 or "not found" in r.stderr:
            hint = f"the host's Python {entry.python!r} is missing: set `python:` for this host in the inventory"
        raise CommandFailed(f"reading host facts failed (exit {r.exit_code}): "
                            f"{(r.stderr or r.stdout).strip().splitlines()[-1:] or ''}",
                            host=entry.name, step="facts", hint=hint)
    return json.loads(r.stdout)


# -- the script's answer, section by section -----------------------------------------------------

class Section(BaseModel):
    """A section of the facts script's answer; fields a newer script adds are kept, not refused."""

    model_config = ConfigDict(extra="allow")


class CommandOutput(Section):
    """A command the script ran (nvidia-smi's queries and banner): exit code, stdout, stderr."""

    rc: int
    out: str = ""
    err: str = ""


class DiskSection(Section):
    path: str
    total: int
    free: int


class VllmSection(Section):
    exists: bool | None = None
    path: str | None = None
    version: str | None = None
    error: str | None = None


class ModelFolder(Section):
    """A folder under models_root: its size, mtime and our verified record (None: not ours)."""

    name: str
    bytes: int = 0
    mtime: float | None = None
    verified: dict[str, Any] | None = None


class UserSection(Section):
    uid: int
    gid: int
    home: str


class ReachSection(Section):
    """Whether the service user can run vllm (facts_script.service_reach)."""

    exists: bool | None = None
    path: str | None = None
    user: str | None = None
    problems: list[str] = Field(default_factory=list)
    unchecked: list[str] = Field(default_factory=list)


class TrustEntry(Section):
    path: str
    problem: str | None = None              # None: only root can change it


class TrustSection(Section):
    """Who could change what root runs and writes (facts_script.root_trust)."""

    programs: list[TrustEntry] = Field(default_factory=list)
    folders: list[TrustEntry] = Field(default_factory=list)
    nft: str | None = None                  # where nft is (None: not installed)


class MemorySection(Section):
    total: int | None = None
    available: int | None = None
    path: str | None = None


class ProcSection(Section):
    """A process the facts name (a GPU process, a port holder, a service's main process)."""

    pid: int
    alive: bool = False
    ppid: int | None = None
    pgid: int | None = None
    comm: str | None = None
    cmdline: list[str] = Field(default_factory=list)
    start_time: int | None = None           # clock ticks after boot (/proc/PID/stat): with the PID, its identity
    uid: int | None = None
    user: str | None = None
    leader_alive: bool | None = None
    engine_root_ppid: int | None = None
    cgroup: str | None = None


def _lenient(default: Any):
    """A field read when it is of its shape, else `default` (the status extras)."""
    def validate(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            return default() if callable(default) else default
    return WrapValidator(validate)


class StatusExtras(Section):
    """What `status` reads besides the facts (facts_script.status_extras), each field lenient."""

    uptime: Annotated[float | None, _lenient(None)] = None
    lock: Annotated[dict[str, Any] | None, _lenient(None)] = None
    health: Annotated[dict[str, Any], _lenient(dict)] = Field(default_factory=dict)
    gateway: Annotated[dict[str, Any] | None, _lenient(None)] = None     # its record (host/gateway.py), unparsed
    history: Annotated[list[Any], _lenient(list)] = Field(default_factory=list)


class FactsAnswer(Section):
    """The facts script's whole answer (one JSON object), section by section."""

    hostname: str
    boot_id: str | None = None
    time: float | None = None
    python: str | None = None
    psutil: str | None = None
    disk: DiskSection
    gpus_raw: CommandOutput
    apps_raw: CommandOutput
    banner_raw: CommandOutput | None = None         # absent in status's facts
    vllm: VllmSection
    models: list[ModelFolder] = Field(default_factory=list)
    users: dict[str, UserSection | None] = Field(default_factory=dict)
    service_reach: ReachSection | None = None
    root_trust: TrustSection | None = None
    services: dict[str, dict[str, str]] = Field(default_factory=dict)   # systemctl show's properties, or a process service's
    usage: dict[str, float] = Field(default_factory=dict)
    ports: dict[int, list[int | None]] = Field(default_factory=dict)
    procs: dict[int, ProcSection] = Field(default_factory=dict)
    memory: MemorySection | None = None
    status: StatusExtras | None = None
    # the records: host/records.py's models, parsed one by one (a bad one is left out, not refused)
    active: Any = None
    records: dict[str, Any] = Field(default_factory=dict)
    installed: dict[str, Any] = Field(default_factory=dict)
    swap: Any = None


def read_answer(raw: Any, host: str | None = None) -> FactsAnswer:
    """The script's answer as typed sections; one not of its shape is refused in one line."""
    try:
        return FactsAnswer.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(answer)"
        raise RefusedError(f"the host's facts are not what vllm-orch's facts script reports: {where}: {err['msg']}",
                           host=host, step="facts",
                           hint="something on the host answers in its place (its Python, or a wrapper): "
                                "check the host's `python:` in the inventory") from None


def parse(raw: Any, host: str | None = None) -> HostFacts:
    """HostFacts from the script's answer (refused when a section is not of its shape)."""
    return from_answer(read_answer(raw, host), raw)


def from_answer(ans: FactsAnswer, raw: Any) -> HostFacts:
    gpus_raw, apps_raw = ans.gpus_raw, ans.apps_raw
    gpu_error = None
    gpus = []
    if gpus_raw.rc == 0:
        gpus = gpu.parse_gpus(gpus_raw.out, gpu.GPU_QUERY_FIELDS)
    else:
        gpu_error = (gpus_raw.err or gpus_raw.out).strip() or f"nvidia-smi exited {gpus_raw.rc}"
    banner = ans.banner_raw
    info = gpu.parse_driver_info(banner.out) if banner is not None and banner.rc == 0 else None
    driver, cuda = (info.driver_version, info.cuda_version) if info else (None, None)
    services = {name: ServiceState.from_facts(st) for name, st in ans.services.items()}
    running = [name for name, st in services.items() if st.active]
    procs_raw = {pid: p.model_dump(exclude_none=True) for pid, p in ans.procs.items()}
    ports = {port: [_proc(pid or 0, procs_raw.get(pid, {}) if pid else {}, ans.services, running) for pid in pids]
             for port, pids in ans.ports.items()}
    apps = gpu.parse_compute_apps(apps_raw.out, gpu.COMPUTE_APPS_FIELDS) if apps_raw.rc == 0 else []
    procs = _gpu_procs(apps, gpus, procs_raw, ans.services, running)
    models = {}
    for d in ans.models:
        verified = d.verified
        last = ans.usage.get(d.name) or (verified or {}).get("verified_at_ts") or d.mtime or 0
        models[d.name] = ModelDir(d.name, d.bytes, verified, float(last))
    bad: list[str] = []
    records = _records(ServiceRecord, ans.records, "services", bad)
    installed = _records(InstalledRecord, ans.installed, "installed", bad)
    active = _one(ServiceRecord, ans.active, "active.json", bad)
    half_swap = _one(SwapMarker, ans.swap, "swap.json", bad)
    mem = ans.memory
    return HostFacts(
        hostname=ans.hostname, disk_path=ans.disk.path, disk_total=ans.disk.total,
        disk_free=ans.disk.free, gpus=gpus, gpu_error=gpu_error, driver_version=driver,
        cuda_version=cuda, procs=procs, vllm_version=ans.vllm.version,
        vllm_error=ans.vllm.error, models=models, active=active,
        installed=installed, services=services, usage=ans.usage, ports=ports, half_swap=half_swap,
        users={n: (u.model_dump() if u is not None else None) for n, u in ans.users.items()},
        service_reach=ans.service_reach.model_dump() if ans.service_reach is not None else None,
        root_trust=ans.root_trust.model_dump() if ans.root_trust is not None else None,
        memory=Memory(mem.total, mem.available, mem.path or "/proc/meminfo") if mem and mem.total is not None else None,
        raw=raw, records=records, bad_records=bad, time=ans.time)


def _one(cls: type[R], value, where: str, bad: list[str]) -> R | None:
    """One record file's content as its model (None: absent; not one: noted in `bad`)."""
    if value is None:
        return None
    rec, why = cls.parse(value)
    if rec is None:
        bad.append(f"{where}: {why}")
    return rec


def _records(cls: type[R], value, folder: str, bad: list[str]) -> dict[str, R]:
    out: dict[str, R] = {}
    for name, content in (value.items() if isinstance(value, dict) else ()):
        rec = _one(cls, content, f"{folder}/{name}.json", bad)
        if rec is not None:
            out[str(name)] = rec
    return out


def _proc(pid: int, info: dict, services: dict[str, dict[str, str]], running: list[str], *, name: str | None = None,
          used_mib: int = 0, gpu_index: int | None = None) -> Proc:
    kind, model = classify(info, services, running)
    return Proc(pid=pid, name=name or info.get("comm") or "?", used_mib=used_mib, gpu_index=gpu_index,
                kind=kind, model=model, cmdline=" ".join(info.get("cmdline") or []).strip(),
                user=info.get("user"), start_time=info.get("start_time"))


def _gpu_procs(apps: list[gpu.GpuProcess], gpus: list[gpu.Gpu], procs: dict[int, dict],
               services: dict[str, dict[str, str]], running: list[str]) -> list[Proc]:
    by_uuid = {g.uuid: g.index for g in gpus}
    return [_proc(app.pid, procs.get(app.pid, {}), services, running,
                  name=app.process_name or procs.get(app.pid, {}).get("comm"),
                  used_mib=app.used_memory_mib or 0, gpu_index=by_uuid.get(app.gpu_uuid))
            for app in apps]
