"""Facts about a host, read in one round trip (remote/facts_script.py) and parsed here.

Everything a plan decides on comes from HostFacts: disk, GPUs and who holds them, the vLLM
version, the managed model folders, what vllm-orch installed and what runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from orchestrator.config.inventory import HostEntry
from orchestrator.config.placement import Recorded
from orchestrator.errors import CommandFailed
from orchestrator.host import nvidia_smi as gpu
from orchestrator.host import scripts
from orchestrator.host.base import Host
from orchestrator.host.modeldirs import is_ours
from orchestrator.host.ownership import Proc, classify
from orchestrator.host.services import ServiceState


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
    active: dict | None           # a legacy active.json (a host from before services/NAME.json)
    installed: dict[str, dict]
    services: dict[str, ServiceState]
    usage: dict[str, float]
    ports: dict[int, list[Proc]] = field(default_factory=dict)   # port -> processes bound to it
    half_swap: dict | None = None   # swap.json: a swap that stopped its old model and has not ended
    users: dict[str, dict | None] = field(default_factory=dict)  # the service user: uid, gid, home (None: missing)
    service_reach: dict | None = None     # can the service user run vllm (facts_script.service_reach)
    memory: Memory | None = None          # None when the memory file could not be read
    raw: dict = field(repr=False, default_factory=dict)
    records: dict[str, dict] = field(default_factory=dict)   # services/NAME.json by service name

    def __post_init__(self) -> None:
        """A legacy active.json reads as its model's record (the first locked operation moves it,
        host/state.upgrade_records); a record under services/ wins over it."""
        legacy = self.active if isinstance(self.active, dict) else None
        if legacy and isinstance(legacy.get("model"), str) and legacy["model"] not in self.records:
            self.records = {**self.records, legacy["model"]: legacy}

    def record(self, name: str) -> dict | None:
        """The record of the service NAME (None: vllm-orch never recorded it serving)."""
        return self.records.get(name)

    def model_of(self, name: str) -> str:
        """The model the service NAME runs, as its records say (a service is named after its model
        unless deployed with --name): its record, else its installed record, else NAME."""
        rec = self.record(name) or self.installed.get(name) or {}
        return str(rec.get("model") or name)

    def recorded_placement(self, name: str) -> Recorded | None:
        """Where the service NAME was installed (installed/NAME.json: its GPUs and port, and which of
        them a run placed there); None: not installed, or a record without them."""
        rec = self.installed.get(name)
        if not isinstance(rec, dict):
            return None
        try:
            gpus = tuple(int(i) for i in rec.get("gpus") or ())
            port = int(rec.get("port") or 0)
        except (TypeError, ValueError):
            return None                 # a hand-edited record: the inventory and manifest decide
        placed = rec.get("placed")
        placed = placed if isinstance(placed, dict) else {}
        return Recorded(gpus, port, gpus_placed=bool(gpus) and placed.get("gpu_ids") is not None,
                        port_placed=bool(port) and placed.get("port") is not None)

    def models_in_use(self) -> set[str]:
        """The model folders the host's services use: every recorded and every running service's
        model (and the running services' own names). Disk freeing and gc never delete these."""
        running = self.running()
        return set(running) | {self.model_of(n) for n in (*self.records, *running)}

    def running(self) -> list[str]:
        return [name for name, st in self.services.items() if st.active]

    def gpu_memory_used(self, indices: list[int]) -> int:
        return sum(g.memory_used_mib or 0 for g in self.gpus if g.index in indices)


def gather(host: Host, entry: HostEntry, models: list[str] | None = None,
           ports: list[int] | None = None) -> HostFacts:
    return parse(_run(host, entry, {"ports": ports or [], "models": models or []}))


def gather_for_status(host: Host, entry: HostEntry, history_tail: int) -> tuple[HostFacts, dict]:
    """The facts `status` shows, and its extras (facts_script.status_extras: uptime, lock holder,
    health checks, the last `history_tail` lines of history.jsonl), in ONE round trip. The script
    adds the active record's model itself and leaves out what status does not show (nvidia-smi's
    banner, the service user, port holders): a fleet's status costs every host this script's CPU."""
    raw = _run(host, entry, {"ports": [], "models": [], "status": {"history_tail": history_tail}})
    return parse(raw), raw.get("status") or {}


def _run(host: Host, entry: HostEntry, request: dict) -> dict:
    args = {**request, "meminfo": entry.meminfo, "models_root": entry.models_root,
            "state_dir": entry.state_dir, "nvidia_smi": entry.nvidia_smi,
            "vllm": entry.vllm, "manager": entry.service_manager, "users": [entry.service_user],
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


def parse(raw: dict) -> HostFacts:
    gpus_raw, apps_raw = raw["gpus_raw"], raw["apps_raw"]
    gpu_error = None
    gpus = []
    if gpus_raw["rc"] == 0:
        gpus = gpu.parse_gpus(gpus_raw["out"], gpu.GPU_QUERY_FIELDS)
    else:
        gpu_error = (gpus_raw["err"] or gpus_raw["out"]).strip() or f"nvidia-smi exited {gpus_raw['rc']}"
    banner = raw.get("banner_raw")          # absent in status's facts
    info = gpu.parse_driver_info(banner["out"]) if banner and banner["rc"] == 0 else None
    driver, cuda = (info.driver_version, info.cuda_version) if info else (None, None)
    services = {name: ServiceState.from_facts(st) for name, st in raw["services"].items()}
    running = [name for name, st in services.items() if st.active]
    ports = {int(port): [_proc(pid or 0, raw.get("procs", {}).get(str(pid), {}) if pid else {}, raw, running)
                         for pid in pids]
             for port, pids in (raw.get("ports") or {}).items()}
    apps = gpu.parse_compute_apps(apps_raw["out"], gpu.COMPUTE_APPS_FIELDS) if apps_raw["rc"] == 0 else []
    procs = _gpu_procs(apps, gpus, raw, running)
    usage = raw.get("usage") or {}
    models = {}
    for d in raw["models"]:
        verified = d.get("verified")
        last = usage.get(d["name"]) or (verified or {}).get("verified_at_ts") or d.get("mtime") or 0
        models[d["name"]] = ModelDir(d["name"], d["bytes"], verified, float(last))
    return HostFacts(
        hostname=raw["hostname"], disk_path=raw["disk"]["path"], disk_total=raw["disk"]["total"],
        disk_free=raw["disk"]["free"], gpus=gpus, gpu_error=gpu_error, driver_version=driver,
        cuda_version=cuda, procs=procs, vllm_version=raw["vllm"].get("version"),
        vllm_error=raw["vllm"].get("error"), models=models, active=raw.get("active"),
        installed=raw.get("installed") or {}, services=services, usage=usage, ports=ports,
        half_swap=raw.get("swap") if isinstance(raw.get("swap"), dict) else None,
        users=raw.get("users") or {}, service_reach=raw.get("service_reach"),
        memory=_memory(raw.get("memory")), raw=raw,
        records={n: r for n, r in (raw.get("records") or {}).items() if isinstance(r, dict)})


def _memory(raw: dict | None) -> Memory | None:
    if not raw or raw.get("total") is None:
        return None
    return Memory(int(raw["total"]), None if raw.get("available") is None else int(raw["available"]),
                  raw.get("path") or "/proc/meminfo")


def _proc(pid: int, info: dict, raw: dict, running: list[str], *, name: str | None = None,
          used_mib: int = 0, gpu_index: int | None = None) -> Proc:
    kind, model = classify(info, raw["services"], running)
    return Proc(pid=pid, name=name or info.get("comm") or "?", used_mib=used_mib, gpu_index=gpu_index,
                kind=kind, model=model, cmdline=" ".join(info.get("cmdline") or []).strip(),
                user=info.get("user"), start_time=info.get("start_time"))


def _gpu_procs(apps: list[gpu.GpuProcess], gpus: list[gpu.Gpu], raw: dict, running: list[str]) -> list[Proc]:
    by_uuid = {g.uuid: g.index for g in gpus}
    procs = raw.get("procs", {})
    return [_proc(app.pid, procs.get(str(app.pid), {}), raw, running,
                  name=app.process_name or procs.get(str(app.pid), {}).get("comm"),
                  used_mib=app.used_memory_mib or 0, gpu_index=by_uuid.get(app.gpu_uuid))
            for app in apps]
