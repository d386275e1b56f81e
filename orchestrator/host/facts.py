"""Facts about a host, read in one round trip (remote/facts_script.py) and parsed here.

Everything a plan decides on comes from HostFacts: disk, GPUs and who holds them, the vLLM
version, the managed model folders, what vllm-orch installed and what runs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from orchestrator.host import nvidia_smi as gpu
from orchestrator.errors import CommandFailed
from orchestrator.host.base import Host, Script
from orchestrator.config.inventory import HostEntry
from orchestrator.paths import package_file
from orchestrator.host.services import ServiceState

_VLLM_LIKE = re.compile(r"(VLLM::|vllm|EngineCore|Worker_TP)", re.I)


@dataclass
class GpuProc:
    pid: int
    name: str
    used_mib: int
    gpu_index: int | None
    owner: str | None            # managed model whose *running* service owns the process
    left_by: str | None          # managed model whose service is gone but left this process
    vllm_like: bool
    cmdline: str = ""

    def describe(self) -> str:
        who = f"owned by running {self.owner}" if self.owner else (
            f"left behind by {self.left_by}" if self.left_by else "not a managed service")
        if self.gpu_index is None and not self.used_mib:
            return f"PID {self.pid or '?'} {self.name} bound to the service port ({who})"
        gpu_txt = f"GPU {self.gpu_index}" if self.gpu_index is not None else "GPU ?"
        return f"PID {self.pid} {self.name} on {gpu_txt}, {self.used_mib} MiB ({who})"


@dataclass
class ModelDir:
    name: str
    bytes: int
    verified: dict | None
    last_used: float


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
    procs: list[GpuProc]
    vllm_version: str | None
    vllm_error: str | None
    models: dict[str, ModelDir]
    active: dict | None
    installed: dict[str, dict]
    services: dict[str, ServiceState]
    usage: dict[str, float]
    ports: dict[int, list[GpuProc]] = field(default_factory=dict)   # port -> processes bound to it
    raw: dict = field(repr=False, default_factory=dict)

    def running(self) -> list[str]:
        return [name for name, st in self.services.items() if st.active]

    def gpu_memory_used(self, indices: list[int]) -> int:
        return sum(g.memory_used_mib or 0 for g in self.gpus if g.index in indices)


def script_command(entry: HostEntry, name: str, *args: str) -> Script:
    """`python -c <host-side script> ARGS`, shown in plans as `python <name> ARGS`."""
    import shlex

    code = package_file("host", "remote", name).read_text()
    text = " ".join([shlex.quote(entry.python), "-c", shlex.quote(code), *map(shlex.quote, args)])
    return Script(text, display=" ".join([entry.python, f"<vllm-orch {name}>", *map(shlex.quote, args)]))


def gather(host: Host, entry: HostEntry, models: list[str] | None = None,
           ports: list[int] | None = None) -> HostFacts:
    args = {"ports": ports or [],"models_root": entry.models_root, "state_dir": entry.state_dir, "nvidia_smi": entry.nvidia_smi,
            "vllm": entry.vllm, "manager": entry.service_manager, "models": models or [],
            "gpu_query": gpu.query_gpus_argv(entry.nvidia_smi),
            "apps_query": gpu.query_compute_apps_argv(entry.nvidia_smi)}
    r = host.run(script_command(entry, "facts_script.py", json.dumps(args)), timeout=180)
    if r.exit_code != 0:
        hint = None
        if r.exit_code == 127 or "not found" in r.stderr:
            hint = f"the host's Python {entry.python!r} is missing: set `python:` for this host in the inventory"
        raise CommandFailed(f"reading host facts failed (exit {r.exit_code}): "
                            f"{(r.stderr or r.stdout).strip().splitlines()[-1:] or ''}",
                            host=entry.name, step="facts", hint=hint)
    return parse(json.loads(r.stdout))


def parse(raw: dict) -> HostFacts:
    gpus_raw, apps_raw = raw["gpus_raw"], raw["apps_raw"]
    gpu_error = None
    gpus = []
    if gpus_raw["rc"] == 0:
        gpus = gpu.parse_gpus(gpus_raw["out"], gpu.GPU_QUERY_FIELDS)
    else:
        gpu_error = (gpus_raw["err"] or gpus_raw["out"]).strip() or f"nvidia-smi exited {gpus_raw['rc']}"
    info = gpu.parse_driver_info(raw["banner_raw"]["out"]) if raw["banner_raw"]["rc"] == 0 else None
    driver, cuda = (info.driver_version, info.cuda_version) if info else (None, None)
    services = {name: ServiceState.from_facts(st) for name, st in raw["services"].items()}
    ports = {int(port): [_owned(pid, raw.get("procs", {}), raw["services"], services) for pid in pids]
             for port, pids in (raw.get("ports") or {}).items()}
    procs = _gpu_procs(gpu.parse_compute_apps(apps_raw["out"], gpu.COMPUTE_APPS_FIELDS) if apps_raw["rc"] == 0 else [],
                       gpus, raw.get("procs", {}), raw["services"], services)
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
        installed=raw.get("installed") or {}, services=services, usage=usage, ports=ports, raw=raw)


def _owner(info: dict, raw_services: dict, services: dict[str, ServiceState]) -> tuple[str | None, str | None]:
    """(model whose running service owns the process, model whose dead service left it behind):
    by systemd cgroup, or by the process group a `process` service was started in."""
    cgroup, pgid = info.get("cgroup", ""), info.get("pgid")
    for model, raw in raw_services.items():
        mine = (f"/vllm-{model}.service" in cgroup) or (
            raw.get("PGID") is not None and pgid is not None and str(pgid) == str(raw.get("PGID")))
        if mine:
            return (model, None) if services[model].active else (None, model)
    return None, None


def _owned(pid: int | None, procs: dict, raw_services: dict, services: dict[str, ServiceState]) -> GpuProc:
    info = procs.get(str(pid), {}) if pid else {}
    owner, left_by = _owner(info, raw_services, services)
    cmdline = " ".join(info.get("cmdline") or [])
    name = info.get("comm") or "?"
    return GpuProc(pid=pid or 0, name=name, used_mib=0, gpu_index=None, owner=owner, left_by=left_by,
                   vllm_like=bool(_VLLM_LIKE.search(name + " " + cmdline)), cmdline=cmdline)


def _gpu_procs(apps, gpus, procs: dict, raw_services: dict, services: dict[str, ServiceState]) -> list[GpuProc]:
    by_uuid = {g.uuid: g.index for g in gpus}
    out = []
    for app in apps:
        info = procs.get(str(app.pid), {})
        owner, left_by = _owner(info, raw_services, services)
        cmdline = " ".join(info.get("cmdline") or [])
        name = app.process_name or info.get("comm") or "?"
        out.append(GpuProc(pid=app.pid, name=name, used_mib=app.used_memory_mib or 0,
                           gpu_index=by_uuid.get(app.gpu_uuid), owner=owner, left_by=left_by,
                           vllm_like=bool(_VLLM_LIKE.search(name + " " + cmdline + " " + info.get("comm", ""))),
                           cmdline=cmdline))
    return out
