"""Operating a host: stop a model (and prove its GPUs are free), delete inactive model folders,
find the log window of the last deploy. The click commands live in commands/ops.py.

stop:  lock -> facts -> stop the service -> disable it at boot (a stopped model must not come back
       at the next reboot) -> kill what it left on ITS GPUs (SIGTERM, SIGKILL) ->
       wait until nvidia-smi shows the memory released -> clear active.json -> history.
       Leftovers are the model's own processes (its cgroup / process group) and vLLM processes no
       running service owns, on the model's GPUs only; a process on another GPU, or one owned by
       another running model, is never touched.
gc:    lock -> facts -> folders under models_root that vllm-orch made (its record) and that are neither
       active nor running -> each path resolved ON THE HOST, checked to be a direct child of the
       resolved models_root (itself not a system folder) and still ours -> rm (host/modeldirs.py) ->
       disable the deleted model's unit if it was enabled (it would fail at every boot).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from orchestrator.config.inventory import HostEntry
from orchestrator.errors import DeployFailed, RefusedError
from orchestrator.fmt import fmt_bytes
from orchestrator.host import modeldirs, state
from orchestrator.host.base import Host
from orchestrator.host.facts import HostFacts, gather
from orchestrator.host.ownership import Holders, Proc, gpu_list, holders, kill_commands, read_gpus, wait_released
from orchestrator.host.records import HistoryEntry
from orchestrator.host.services import Service
from orchestrator.plan.run import GPU_RELEASE_TIMEOUT_S

# -- stop ------------------------------------------------------------------------------------------

@dataclass
class StopResult:
    host: str
    model: str
    ok: bool = True
    was: str = "stopped"                 # running / failed / stopped (before we acted)
    gpus: list[int] = field(default_factory=list)
    stopped_service: bool = False
    disabled: bool = False               # its unit no longer starts at boot (it was enabled)
    orphans: list[dict] = field(default_factory=list)   # its processes found without a live main process
    killed: list[dict] = field(default_factory=list)    # killed one by one after the service stop
    gpus_free: str | None = None
    cleared_active: bool = False
    nothing_to_do: bool = False
    seconds: float = 0.0
    error: str | None = None
    dry_run: bool = False                # nothing done: `leftovers` and `cleared_active` say what would be
    leftovers: list[dict] = field(default_factory=list)  # on its GPUs now, killed if they outlive the stop
    foreign: list[str] = field(default_factory=list)     # on its GPUs, not ours: left alone, reported

    def as_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def model_gpus(facts: HostFacts, model: str, manifest_gpus: list[int] | None) -> list[int]:
    """The GPUs a service uses: its record, else its installed record (HostFacts.placement), else
    its manifest, else the GPUs its own processes sit on."""
    placed = facts.placement(model, facts.hostname)
    if placed is not None and placed.gpus:
        return sorted(placed.gpus)
    if manifest_gpus:
        return sorted(manifest_gpus)
    return sorted({p.gpu_index for p in facts.procs
                   if p.gpu_index is not None and model in (p.owner, p.left_by)})


def leftovers(facts: HostFacts, model: str, gpus: list[int]) -> Holders:
    """The processes on the model's GPUs, sorted by the one ownership rule (orchestrator.host.ownership)
    as if the model's service were being stopped: its own and what was abandoned may be killed."""
    return holders(facts.procs, [], model, gpus, stopping={model})


def _rows(procs: list[Proc]) -> list[dict]:
    return [{"pid": p.pid, "name": p.name, "gpu": p.gpu_index, "used_mib": p.used_mib} for p in procs]


def stop_model(host: Host, entry: HostEntry, model: str, manifest_gpus: list[int] | None = None,
               release_timeout: float = GPU_RELEASE_TIMEOUT_S, poll: float = 0.5,
               say=lambda text: None, dry_run: bool = False) -> StopResult:
    """Stop MODEL on a host whose lock the caller holds. Idempotent. dry_run: read the facts and say
    what a stop would do; change nothing (no lock needed)."""
    t0 = time.monotonic()
    res = StopResult(entry.name, model)
    facts = gather(host, entry, [model])
    svc_state = facts.services.get(model)
    installed = model in facts.installed or model in facts.models or facts.record(model) is not None
    if not installed and not (svc_state and (svc_state.active or svc_state.failed)):
        raise RefusedError(f"{model} is not installed on {entry.name}", host=entry.name, step="stop",
                           hint=f"installed: {', '.join(sorted(facts.installed)) or 'none'}")
    res.was = "running" if svc_state and svc_state.active else ("failed" if svc_state and svc_state.failed
                                                                  else "stopped")
    res.gpus = model_gpus(facts, model, manifest_gpus)
    held = leftovers(facts, model, res.gpus)
    before = held.ours + held.kill
    if res.was != "running":
        res.orphans = _rows(before)
    if dry_run:
        res.dry_run = True
        res.leftovers = _rows(before)
        res.cleared_active = facts.record(model) is not None
        res.disabled = bool(svc_state and svc_state.enabled)
        res.nothing_to_do = res.was == "stopped" and not before and not res.cleared_active and not res.disabled
        return res
    svc = Service.for_host(host, entry, model)
    if res.was != "stopped" or before:
        say(f"stopping {model} ({res.was}" + (f", PID {svc_state.main_pid}" if svc_state and svc_state.main_pid
                                            else "") + ")")
        svc.run_all(svc.stop_commands(), f"stop {model}", timeout=600)
        res.stopped_service = res.was != "stopped"
    if svc_state and svc_state.enabled:
        say(f"disabling {svc.describe()} at boot")
        svc.run_all(svc.disable_commands(), f"disable {model}")
        res.disabled = True
    # What the stop left on the model's GPUs (orphaned workers outlive a SIGKILLed parent).
    if res.gpus:
        _gpus, apps = read_gpus(host, entry)
        still = [a.pid for i in res.gpus for a in apps.get(i, [])]
        candidates = {p.pid: p for p in before}
        # A process of ours that escaped the group/cgroup is still attributed by the pre-stop facts;
        # one that is new on our GPUs and vLLM-like is re-read from fresh facts.
        victims = [candidates[pid] for pid in still if pid in candidates]
        unknown = [pid for pid in still if pid not in candidates]
        if unknown:
            fresh = gather(host, entry, [model])
            again = leftovers(fresh, model, res.gpus)
            victims += [p for p in again.ours + again.kill if p.pid in unknown]
        if victims:
            pids = sorted({p.pid for p in victims})
            say(f"killing {len(pids)} leftover process{'es' if len(pids) != 1 else ''} on "
                f"{gpu_list(res.gpus)}: " + ", ".join(f"{p.pid} {p.name}" for p in victims))
            for cmd in kill_commands(victims):
                host.run(cmd, timeout=60).check(entry.name, "kill leftover GPU processes")
            res.killed = _rows(victims)
        if held.others:
            res.gpus_free = (f"not waited for: {', '.join(sorted({p.model or '?' for p in held.others}))} also "
                             f"runs on {gpu_list(res.gpus)}")
        else:
            res.foreign = [p.describe() for p in held.foreign]
            for line in res.foreign:
                say(f"left alone (not ours): {line}")
            try:
                res.gpus_free = wait_released(host, entry, res.gpus, release_timeout, poll, ignore=held.foreign)
            except DeployFailed as exc:
                res.ok, res.error = False, str(exc.message)
    if facts.record(model) is not None:
        state.write_record(host, entry, model, None)
        res.cleared_active = True
    res.nothing_to_do = res.was == "stopped" and not before and not res.killed and not res.cleared_active \
        and not res.disabled
    res.seconds = round(time.monotonic() - t0, 3)
    state.append_history(host, entry, HistoryEntry(**{"operation": "stop", "service": model,
                                       "model": facts.model_of(model),
                                       "ok": res.ok, "disabled": res.disabled,
                                       "seconds": res.seconds, "was": res.was, "orphans": res.orphans, "killed": res.killed,
                                       "gpus_free": res.gpus_free, "cleared_active": res.cleared_active,
                                       "foreign": res.foreign,
                                       "noop": res.nothing_to_do, **({"error": res.error} if res.error else {})}))
    return res


def recorded_nodes(host: Host, entry: HostEntry, name: str) -> list[str]:
    """The nodes of the multi-node service NAME as this host's records say (services/NAME.json,
    else installed/NAME.json: a deploy that failed before its record step), head first; [] for a
    one-host service."""
    for rec in (state.read_record(host, entry, name), state.read_installed(host, entry, name)):
        if rec is not None and rec.nodes:
            return list(rec.nodes)
    return []


# -- gc --------------------------------------------------------------------------------------------

@dataclass
class GcCandidate:
    name: str
    bytes: int
    last_used: float
    verified: bool
    enabled: bool = False               # its unit starts at boot: disabled with the folder


@dataclass
class GcPlan:
    delete: list[GcCandidate]
    keep: list[tuple[str, str]]            # (folder, why it stays)

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.delete)


def plan_gc(facts: HostFacts) -> GcPlan:
    """Inactive, not running folders that vllm-orch made go; the models of recorded services (on a
    host with several services, every one of them), running services and folders without vllm-orch's
    record stay."""
    active = {facts.model_of(n) for n in facts.records}
    running = facts.models_in_use() - active
    delete, keep = [], []
    for d in sorted(facts.models.values(), key=lambda d: (d.last_used, d.name)):
        if not d.ours:
            keep.append((d.name, "not made by vllm-orch (no .vllm-orch/verified.json), never deleted"))
        elif d.name in active:
            keep.append((d.name, "the active model"))
        elif d.name in running:
            keep.append((d.name, "its service is running"))
        else:
            st = facts.services.get(d.name)
            delete.append(GcCandidate(d.name, d.bytes, d.last_used, d.complete, bool(st and st.enabled)))
    return GcPlan(delete, keep)


def gc_facts(host: Host, entry: HostEntry) -> HostFacts:
    """Facts whose service states cover every folder (a folder without an installed record may
    still have a PID file or a unit by its name): a second trip only when there are such folders."""
    facts = gather(host, entry)
    missing = [name for name in facts.models if name not in facts.services]
    return gather(host, entry, missing) if missing else facts


def run_gc(host: Host, entry: HostEntry, plan: GcPlan, say=lambda text: None, guard=None) -> dict:
    """Delete the planned folders (the caller holds the lock and has the user's go-ahead); `guard`
    (the session's) is called before each delete and raises when the lock is not ours any more."""
    t0 = time.monotonic()
    deleted: list[dict] = []
    kept: list[dict] = []
    for c in plan.delete:
        if guard is not None:
            guard()
        r = host.run(modeldirs.delete_script(entry.models_root, c.name), timeout=3600)
        if r.ok:
            deleted.append({"name": c.name, "bytes": c.bytes})
            say(f"deleted {entry.models_root}/{c.name} ({fmt_bytes(c.bytes)})")
            if c.enabled:
                svc = Service.for_host(host, entry, c.name)
                svc.run_all(svc.disable_commands(), f"disable {c.name}")
                deleted[-1]["disabled"] = True
                say(f"disabled {svc.describe()} at boot (its weights are gone)")
        else:
            why = (r.stderr.strip().splitlines() or [f"exit {r.exit_code}"])[-1]
            kept.append({"name": c.name, "why": why})
            say(f"kept {entry.models_root}/{c.name}: {why}")
    record = {"operation": "gc", "ok": not kept, "deleted": deleted,
              "freed_bytes": sum(d["bytes"] for d in deleted), "kept": kept,
              "seconds": round(time.monotonic() - t0, 3)}
    state.append_history(host, entry, HistoryEntry(**record))
    return record


# -- logs ------------------------------------------------------------------------------------------

def deploy_started_at(history: list[dict], model: str) -> float | None:
    """Epoch seconds when the last deploy/swap/rollback that started MODEL began (record time
    minus its duration), for `logs --since-deploy` on journald hosts."""
    from datetime import datetime

    for rec in reversed(history):
        if rec.get("operation") in ("deploy", "swap", "rollback") and model in (
                rec.get("service") or rec.get("model"), rec.get("to"), rec.get("rolled_back_to")):
            try:
                at = datetime.fromisoformat(rec["at"]).timestamp()
            except (KeyError, ValueError):
                continue
            return at - float(rec.get("seconds") or 0) - 1
    return None


# A line's time: journald's short-iso(-precise) prefix, vllm-orch's start marker of a process
# host's log, or vLLM's own logger prefix (`INFO 12-01 02:08:38 [file.py:12]`, no year: this year).
_JOURNAL_TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)([+-]\d{2}:?\d{2}|Z)?\s")
_MARKER_TS = re.compile(r"^--- vllm-orch start (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)Z")
_VLLM_TS = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d+))?\b")


def line_time(line: str, year: int | None = None) -> float | None:
    """Epoch seconds a log line was written at, from the first timestamp it starts with (None: it has
    none, e.g. a traceback's lines)."""
    from datetime import datetime

    if m := _JOURNAL_TS.match(line):
        tz = (m.group(2) or "").replace("Z", "+00:00")
        if tz and ":" not in tz:
            tz = tz[:3] + ":" + tz[3:]
        try:
            return datetime.fromisoformat(m.group(1) + tz).timestamp()
        except ValueError:
            return None
    if m := _MARKER_TS.match(line):
        return datetime.fromisoformat(m.group(1) + "+00:00").timestamp()
    if m := _VLLM_TS.search(line):
        month, day, hh, mm, ss, frac = m.groups()
        try:
            at = datetime(year or datetime.now().year, int(month), int(day), int(hh), int(mm), int(ss))
        except ValueError:
            return None
        return at.timestamp() + (float(f"0.{frac}") if frac else 0.0)
    return None


def merge_logs(per_node: list[tuple[str, list[str]]]) -> list[str]:
    """The nodes' log lines in one list by time, each prefixed with its node (`[gpu2] ...`). A line
    without a time of its own (a traceback) stays right after the line before it on its node; on
    equal times the order of the nodes (head first) decides."""
    keyed = []
    for order, (node, lines) in enumerate(per_node):
        last = float("-inf")
        for i, line in enumerate(lines):
            at = line_time(line)
            last = at if at is not None else last
            keyed.append(((last, order, i), f"[{node}] {line}"))
    return [text for _, text in sorted(keyed, key=lambda kv: kv[0])]
