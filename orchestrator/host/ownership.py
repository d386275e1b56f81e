"""Which processes on which GPUs belong to which service: the ONE rule deploy, swap, stop and
preflight use to decide what may be killed, and the one wait for GPU memory to be released.

Every process that holds one of the GPUs (or the service port) is exactly one of:
  service      in the control group of a RUNNING managed unit (the unit's own ControlGroup, matched
               exactly or as a sub-group: another user's `systemctl --user` unit with the same name
               lives elsewhere), or, on `process` hosts, in the process group vllm-orch started
               (its record proven current: the same boot, the same leader start time)
  left behind  the same, for a managed service that no longer runs
  abandoned    a vLLM engine or worker (`VLLM::EngineCore*`, `VLLM::Worker*`, by process title) whose
               API server is gone: its process group's leader is dead and its vLLM process tree was
               re-parented to init. The field's zombie case, also after a manual `vllm serve`.
  foreign      anything else: someone's live vLLM server, a script whose path merely contains
               "vllm", any other program. Reported with its user and command; killed only with
               --kill-foreign.

Killed without --kill-foreign: what a dead managed service left, abandoned engines and workers on
the service's own GPUs, and the service's own processes once its stop did not take them. Never
killed: a running managed service's processes (deploy refuses; swap stops that service first), the
processes of another service of the host (several services share a host on disjoint GPUs; one that
is recorded but between two starts still owns what it left), and
a process bound to the service port that is not provably left by a managed service, and a process
vllm-orch cannot identify: a port held by a socket whose owner it cannot see (another user's, a
hidden /proc: reported as PID 0), or a process read without its start time (it was exiting, or it
lives in another PID namespace). Those are named, never signalled, whatever the options: `kill 0`
would signal vllm-orch's own process group. Right before killing, the list is read again (a
28-minute download lies between planning and the GPU step) and each PID is signalled only while it
still has the start time it had when it was classified.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrator.errors import CommandFailed, DeployFailed
from orchestrator.host import cancel, nvidia_smi
from orchestrator.host.base import Command, Host, Script

if TYPE_CHECKING:
    from orchestrator.config.inventory import HostEntry

SERVICE, LEFT, ABANDONED, FOREIGN = "service", "left behind", "abandoned vLLM", "foreign"
IDLE_GPU_MIB = 2048            # a GPU with no process and less than this in use counts as free
_ENGINE_TITLE = re.compile(r"^VLLM::(EngineCore|Worker)")


@dataclass(frozen=True)
class Proc:
    """A process holding a GPU (gpu_index set) or bound to a service port (gpu_index None)."""

    pid: int
    name: str
    used_mib: int
    gpu_index: int | None
    kind: str                    # SERVICE | LEFT | ABANDONED | FOREIGN
    model: str | None = None     # the managed service it belongs (or belonged) to
    cmdline: str = ""
    user: str | None = None
    start_time: int | None = None    # clock ticks after boot: with the PID, the process's identity

    @property
    def killable(self) -> bool:
        """Identified well enough to be signalled: a real PID (not 0, an owner vllm-orch cannot see,
        nor init) with the start time kill_commands checks it by."""
        return self.pid > 1 and self.start_time is not None

    @property
    def owner(self) -> str | None:
        """The running managed service that owns the process."""
        return self.model if self.kind == SERVICE else None

    @property
    def left_by(self) -> str | None:
        """The managed service, no longer running, that left the process behind."""
        return self.model if self.kind == LEFT else None

    def describe(self) -> str:
        who = {SERVICE: f"owned by running {self.model}", LEFT: f"left behind by {self.model}",
               ABANDONED: "a vLLM engine/worker whose API server is gone"}.get(self.kind, "foreign")
        by = f"user {self.user}, " if self.user else ""
        command = f": {self.cmdline[:100]}" if self.cmdline and self.kind == FOREIGN else ""
        if not self.pid:
            return "a process bound to the service port whose owner is not visible to vllm-orch (another " \
                   "user's socket: find it with `ss -ltnp` as root)"
        if not self.killable:
            who += ", not visible to vllm-orch: it may have exited, or live in another PID namespace"
        if self.gpu_index is None and not self.used_mib:
            return f"PID {self.pid} {self.name} bound to the service port ({by}{who}){command}"
        gpu_txt = f"GPU {self.gpu_index}" if self.gpu_index is not None else "GPU ?"
        return f"PID {self.pid} {self.name} on {gpu_txt}, {self.used_mib} MiB ({by}{who}){command}"

    def as_dict(self) -> dict:
        return {"pid": self.pid, "name": self.name, "gpu": self.gpu_index, "used_mib": self.used_mib,
                "kind": self.kind, "model": self.model, "user": self.user, "command": self.cmdline}


def cgroup_paths(text: str) -> list[str]:
    """The systemd-relevant paths of /proc/PID/cgroup: the unified hierarchy (`0::/...`) and the
    v1 `name=systemd` one (hybrid hosts)."""
    out = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and (parts[0] == "0" or parts[1] == "name=systemd"):
            out.append(parts[2])
    return out


def unit_cgroup(model: str, raw: Mapping) -> str:
    """The control group of a managed unit: what systemd reports, else where a system unit lives."""
    return raw.get("ControlGroup") or f"/system.slice/vllm-{model}.service"


def abandoned_engine(info: Mapping) -> bool:
    """A vLLM engine core or worker whose API server is gone (see the module docstring)."""
    title = (info.get("cmdline") or [""])[0]
    return bool(_ENGINE_TITLE.match(title)) and info.get("leader_alive") is False \
        and info.get("engine_root_ppid") == 1


def classify(info: Mapping, services: Mapping[str, Mapping], running: Iterable[str]) -> tuple[str, str | None]:
    """(kind, model) of a process from what the facts script read about it (`cgroup`, `pgid`,
    `cmdline`, `leader_alive`, `engine_root_ppid`) and the managed services' raw states
    (systemd's properties with ControlGroup, or a `process` service's proven PGID)."""
    live = set(running)
    paths = cgroup_paths(info.get("cgroup", ""))
    pgid = info.get("pgid")
    for model, raw in services.items():
        if "ControlGroup" in raw or "LoadState" in raw:            # a systemd unit
            cg = unit_cgroup(model, raw)
            mine = any(p == cg or p.startswith(cg + "/") for p in paths)
        else:                                                      # a process service's group
            mine = raw.get("PGID") is not None and pgid is not None and str(pgid) == str(raw["PGID"])
        if mine:
            return (SERVICE, model) if model in live else (LEFT, model)
    if abandoned_engine(info):
        return ABANDONED, None
    return FOREIGN, None


@dataclass
class Holders:
    """The processes on a placement's GPUs (and port), sorted by what may be done to them."""

    ours: list[Proc] = field(default_factory=list)      # the service itself, or services stopped first
    kill: list[Proc] = field(default_factory=list)      # left behind or abandoned: killed before the start
    others: list[Proc] = field(default_factory=list)    # another running managed service: never killed
    foreign: list[Proc] = field(default_factory=list)   # killed only with --kill-foreign
    asleep: list[Proc] = field(default_factory=list)    # a sleeping service's (its CUDA contexts): kept

    def victims(self, kill_foreign: bool) -> list[Proc]:
        return self.kill + ([p for p in self.foreign if p.killable] if kill_foreign else [])

    @property
    def unknown(self) -> list[Proc]:
        """Foreign holders vllm-orch cannot identify: never killed, even with --kill-foreign."""
        return [p for p in self.foreign if not p.killable]


def holders(gpu_procs: Iterable[Proc], port_procs: Iterable[Proc], model: str, gpus: Iterable[int],
            stopping: Iterable[str] = (), *, protected: Iterable[str], asleep: Iterable[str] = ()) -> Holders:
    """Sort the processes on `gpus` (and those bound to the service port) for the service `model`;
    `stopping`: managed services this operation stops first (a swap's old model); `protected`: the
    other services of the host (recorded or running, HostFacts.services_known): what one of them
    left between two of its starts (systemd restarting it) is theirs, never ours to kill. Every
    caller (deploy's GPU step, swap, stop, preflight) names them. `asleep`: the host's services in
    sleep mode: their processes stay on the GPUs (a CUDA context each) beside an awake service, and
    are theirs (`Holders.asleep`), neither in the way nor leftovers."""
    want, mine, sleeping = set(gpus), {model, *stopping}, set(asleep)
    theirs = set(protected) - mine
    gpu_list = list(gpu_procs)
    on_gpu = {p.pid for p in gpu_list}
    out = Holders()
    for p in gpu_list + [q for q in port_procs if q.pid not in on_gpu]:
        on_port = p.gpu_index is None
        if not on_port and p.gpu_index not in want:
            continue                                   # never touch processes on other GPUs
        if p.kind == SERVICE and p.model in sleeping and p.model not in mine and not on_port:
            out.asleep.append(p)
        elif p.kind == SERVICE:
            (out.ours if p.model in mine else out.others).append(p)
        elif p.kind == LEFT and p.model in theirs:
            out.others.append(p)
        elif p.killable and (p.kind == LEFT or (p.kind == ABANDONED and not on_port)):
            out.kill.append(p)
        else:
            out.foreign.append(p)
    return out


def listener_problem(port_procs: Iterable[Proc], service: str, port: int) -> str | None:
    """Why the processes bound to `port` are not provably the service's own (its unit's cgroup, its
    recorded process group), or None: what vllm-orch checks before it sends the service's API key
    there. During a restart, or while vLLM loads (its socket is bound but not listening yet),
    another local user can bind the loopback address on the same port and would be sent the key."""
    procs = list(port_procs)
    if not procs:
        return f"nothing is bound to port {port} any more"
    strangers = [p for p in procs if not (p.kind == SERVICE and p.model == service)]
    if strangers:
        return f"port {port} is held by what is not {service}: " + "; ".join(p.describe() for p in strangers)
    return None


def kill_commands(procs: Iterable[Proc]) -> list[Command]:
    """SIGTERM, up to 10 s for the processes to go, then SIGKILL - each PID only while it still has
    the start time it had when it was classified (a PID reused meanwhile is left alone). A process
    that is not `killable` (PID 0 or 1, no start time) gets no command at all."""
    procs = [p for p in procs if p.killable]
    if not procs:
        return []
    specs = " ".join(f"{int(p.pid)}:{int(p.start_time or 0)}" for p in procs)
    same = "same() { [ \"$(sed 's/^.*) //' /proc/$1/stat 2>/dev/null | cut -d' ' -f20)\" = \"$2\" ]; }; "
    each = f"for s in {specs}; do p=${{s%%:*}}; t=${{s#*:}}; "
    return [Script(same + each + "same $p $t && kill -TERM $p 2>/dev/null; done; i=0; "
                   "while [ $i -lt 100 ]; do alive=0; " + each + "same $p $t && kill -0 $p 2>/dev/null && alive=1; "
                   "done; [ $alive = 0 ] && break; sleep 0.1; i=$((i+1)); done; " + each +
                   "same $p $t && kill -KILL $p 2>/dev/null; done; true",
                   display=f"kill -TERM {' '.join(str(p.pid) for p in procs)} (each only while it is the "
                           f"process classified), wait up to 10 s, kill -KILL what is left")]


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


def wait_released(host: Host, entry: HostEntry, indices: list[int], timeout: float, poll: float = 0.5,
                  ignore: Iterable[Proc] = (), asleep: Iterable[Proc] = ()) -> str:
    """Poll nvidia-smi until the GPUs hold no process and their memory is released. `ignore`:
    processes that are not ours to wait for (foreign ones stop leaves alone); a GPU one of them
    holds is checked for our processes only, since its memory is theirs. `asleep`: a sleeping
    service's processes, which stay: what they hold (read now) is allowed on their GPUs."""
    start = time.monotonic()
    deadline = start + timeout
    skip = {p.pid for p in ignore} | {p.pid for p in asleep}
    shared = {p.gpu_index for p in ignore}
    while True:
        gpus, apps = read_gpus(host, entry)
        procs = [a for i in indices for a in apps.get(i, []) if a.pid not in skip]
        kept = {i: sum(a.used_memory_mib or 0 for a in apps.get(i, []) if a.pid in skip) for i in indices}
        busy = {g.index: g.memory_used_mib or 0 for g in gpus
                if g.index in indices and g.index not in shared
                and (g.memory_used_mib or 0) - kept.get(g.index, 0) >= IDLE_GPU_MIB}
        if not procs and not busy:
            held = f" (GPU {', '.join(str(i) for i in sorted(x for x in shared if x in indices))} stays in use "
            held = held + "by a process that is not ours)" if shared & set(indices) else ""
            return f"{gpu_list(indices)} free after {time.monotonic() - start:.1f}s{held}"
        if time.monotonic() > deadline:
            last = (f"{len(procs)} processes, " if procs else "") + \
                ", ".join(f"GPU {i}: {u} MiB" for i, u in busy.items())
            raise DeployFailed(f"GPU memory not released after {timeout:.0f}s ({last})", host=entry.name,
                               step="gpus", hint="find the holders with `fuser -v /dev/nvidia*`")
        cancel.sleep(poll)               # Ctrl-C ends the wait here (host/cancel.py)
