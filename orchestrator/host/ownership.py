"""Which processes on which GPUs belong to which service: the ONE rule deploy, swap, stop and
preflight use to decide what may be killed, and the one wait for GPU memory to be released.

Every process that holds one of the GPUs (or the service port) is one of:
  service        in the cgroup (systemd) or process group (`process` hosts) of a RUNNING managed service
  left behind    in the cgroup / process group of a managed service that no longer runs
  unmanaged vLLM a vLLM process (by name or command line) that no managed service owns
  foreign        anything else: another user's job, a non-vLLM program

Killed without --kill-foreign: what a dead managed service left, unmanaged vLLM processes on the
service's own GPUs (the field's `VLLM::Worker_TP*` that outlive a killed server), and the service's
own processes once its stop did not take them. Never killed: a running managed service's processes
(deploy refuses; swap stops that service first), and a process merely bound to the service port
that is not provably left by a managed service (it may be someone else's server on other GPUs).
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrator.errors import CommandFailed, DeployFailed
from orchestrator.host import nvidia_smi
from orchestrator.host.base import Command, Host, Script

if TYPE_CHECKING:
    from orchestrator.config.inventory import HostEntry

SERVICE, LEFT, UNMANAGED_VLLM, FOREIGN = "service", "left behind", "unmanaged vLLM", "foreign"
IDLE_GPU_MIB = 2048            # a GPU with no process and less than this in use counts as free
_VLLM_LIKE = re.compile(r"(VLLM::|vllm|EngineCore|Worker_TP)", re.I)


def vllm_like(*texts: str) -> bool:
    return bool(_VLLM_LIKE.search(" ".join(texts)))


@dataclass(frozen=True)
class Proc:
    """A process holding a GPU (gpu_index set) or bound to a service port (gpu_index None)."""

    pid: int
    name: str
    used_mib: int
    gpu_index: int | None
    kind: str                    # SERVICE | LEFT | UNMANAGED_VLLM | FOREIGN
    model: str | None = None     # the managed service it belongs (or belonged) to
    cmdline: str = ""

    @property
    def owner(self) -> str | None:
        """The running managed service that owns the process."""
        return self.model if self.kind == SERVICE else None

    @property
    def left_by(self) -> str | None:
        """The managed service, no longer running, that left the process behind."""
        return self.model if self.kind == LEFT else None

    @property
    def vllm_like(self) -> bool:
        return vllm_like(self.name, self.cmdline)

    def describe(self) -> str:
        who = {SERVICE: f"owned by running {self.model}", LEFT: f"left behind by {self.model}",
               UNMANAGED_VLLM: "a vLLM process no managed service owns"}.get(self.kind, "not a managed service")
        if self.gpu_index is None and not self.used_mib:
            return f"PID {self.pid or '?'} {self.name} bound to the service port ({who})"
        gpu_txt = f"GPU {self.gpu_index}" if self.gpu_index is not None else "GPU ?"
        return f"PID {self.pid} {self.name} on {gpu_txt}, {self.used_mib} MiB ({who})"

    def as_dict(self) -> dict:
        return {"pid": self.pid, "name": self.name, "gpu": self.gpu_index, "used_mib": self.used_mib,
                "kind": self.kind, "model": self.model}


def classify(info: Mapping, services: Mapping[str, Mapping], running: Iterable[str],
             name: str = "") -> tuple[str, str | None]:
    """(kind, model) of a process from what the facts script read about it (`cgroup`, `pgid`,
    `comm`, `cmdline`; `name` as nvidia-smi shows it) and the managed services' raw states (systemd's properties, or the PGID of a
    `process` service): by the unit's cgroup or the service's process group, never by name."""
    cgroup, pgid = info.get("cgroup", ""), info.get("pgid")
    live = set(running)
    for model, raw in services.items():
        mine = (f"/vllm-{model}.service" in cgroup) or (
            raw.get("PGID") is not None and pgid is not None and str(pgid) == str(raw.get("PGID")))
        if mine:
            return (SERVICE, model) if model in live else (LEFT, model)
    if vllm_like(name, info.get("comm", ""), " ".join(info.get("cmdline") or [])):
        return UNMANAGED_VLLM, None
    return FOREIGN, None


@dataclass
class Holders:
    """The processes on a placement's GPUs (and port), sorted by what may be done to them."""

    ours: list[Proc] = field(default_factory=list)      # the service itself, or services stopped first
    kill: list[Proc] = field(default_factory=list)      # provably abandoned: killed before the start
    others: list[Proc] = field(default_factory=list)    # another running managed service: never killed
    foreign: list[Proc] = field(default_factory=list)   # killed only with --kill-foreign

    def victims(self, kill_foreign: bool) -> list[Proc]:
        return self.kill + (self.foreign if kill_foreign else [])


def holders(gpu_procs: Iterable[Proc], port_procs: Iterable[Proc], model: str, gpus: Iterable[int],
            stopping: Iterable[str] = ()) -> Holders:
    """Sort the processes on `gpus` (and those bound to the service port) for the service `model`;
    `stopping`: managed services this operation stops first (a swap's old model)."""
    want, mine = set(gpus), {model, *stopping}
    gpu_list = list(gpu_procs)
    on_gpu = {p.pid for p in gpu_list}
    out = Holders()
    for p in gpu_list + [q for q in port_procs if q.pid not in on_gpu]:
        on_port = p.gpu_index is None
        if not on_port and p.gpu_index not in want:
            continue                                   # never touch processes on other GPUs
        if p.kind == SERVICE:
            (out.ours if p.model in mine else out.others).append(p)
        elif p.pid and (p.kind == LEFT or (p.kind == UNMANAGED_VLLM and not on_port)):
            out.kill.append(p)
        else:
            out.foreign.append(p)
    return out


def kill_commands(pids: Iterable[int]) -> list[Command]:
    """SIGTERM, up to 10 s for the processes to go, then SIGKILL."""
    ps = " ".join(str(int(p)) for p in pids)
    return [Script(f"kill -TERM {ps} 2>/dev/null; i=0; while [ $i -lt 100 ]; do "
                   f"alive=0; for p in {ps}; do kill -0 $p 2>/dev/null && alive=1; done; "
                   f"[ $alive = 0 ] && break; sleep 0.1; i=$((i+1)); done; kill -KILL {ps} 2>/dev/null; true")]


_SEP = "@@vllm-orch-gpus@@"


def gpu_query(nvidia_smi_path: str) -> Script:
    """The GPU list and the compute processes in one round trip."""
    gpus = " ".join(shlex.quote(a) for a in nvidia_smi.query_gpus_argv(nvidia_smi_path))
    apps = " ".join(shlex.quote(a) for a in nvidia_smi.query_compute_apps_argv(nvidia_smi_path))
    return Script(f"{gpus} && echo {_SEP} && {apps}")


def read_gpus(host: Host, entry: HostEntry) -> tuple[list[nvidia_smi.Gpu], dict[int, list[nvidia_smi.GpuProcess]]]:
    """(GPUs, compute processes by GPU index) as nvidia-smi shows them now."""
    r = host.run(gpu_query(entry.nvidia_smi), timeout=30)
    if not r.ok:
        raise CommandFailed(f"nvidia-smi failed: {(r.stderr or r.stdout).strip()[-200:]}",
                            host=entry.name, step="gpus")
    gpu_text, _, apps_text = r.stdout.partition(_SEP)
    gpus = nvidia_smi.parse_gpus(gpu_text.strip(), nvidia_smi.GPU_QUERY_FIELDS)
    by_uuid = {g.uuid: g.index for g in gpus}
    apps: dict[int, list[nvidia_smi.GpuProcess]] = {}
    for app in nvidia_smi.parse_compute_apps(apps_text.strip(), nvidia_smi.COMPUTE_APPS_FIELDS):
        index = by_uuid.get(app.gpu_uuid)
        if index is not None:
            apps.setdefault(index, []).append(app)
    return gpus, apps


def gpu_list(indices: Iterable[int]) -> str:
    ids = sorted(indices)
    if ids and ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 2:
        return f"GPUs {ids[0]}-{ids[-1]}"
    return "GPU" + ("s " if len(ids) != 1 else " ") + ",".join(map(str, ids))


def wait_released(host: Host, entry: HostEntry, indices: list[int], timeout: float, poll: float = 0.5) -> str:
    """Poll nvidia-smi until the GPUs hold no process and their memory is released."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        gpus, apps = read_gpus(host, entry)
        procs = [a for i in indices for a in apps.get(i, [])]
        busy = {g.index: g.memory_used_mib or 0 for g in gpus
                if g.index in indices and (g.memory_used_mib or 0) >= IDLE_GPU_MIB}
        if not procs and not busy:
            return f"{gpu_list(indices)} free after {time.monotonic() - start:.1f}s"
        if time.monotonic() > deadline:
            last = (f"{len(procs)} processes, " if procs else "") + \
                ", ".join(f"GPU {i}: {u} MiB" for i, u in busy.items())
            raise DeployFailed(f"GPU memory not released after {timeout:.0f}s ({last})", host=entry.name,
                               step="gpus", hint="find the holders with `fuser -v /dev/nvidia*`")
        time.sleep(poll)
