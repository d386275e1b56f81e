"""stop and gc: session -> facts -> plan (orchestrator.plan.stop) -> show or run it with the one
executor (ops/execute.py) -> a history record. The click commands live in cli/ops.py. Also the log
window of the last deploy, and the merge of several nodes' logs.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from orchestrator.config.inventory import HostEntry
from orchestrator.errors import DeployFailed
from orchestrator.host import engine, state
from orchestrator.host.base import Host
from orchestrator.host.facts import HostFacts, gather
from orchestrator.host.records import HistoryEntry
from orchestrator.ops.execute import Reporter, run_plan
from orchestrator.plan import gateway
from orchestrator.plan.inputs import LockFacts
from orchestrator.plan.model import Plan
from orchestrator.plan.run import GPU_RELEASE_TIMEOUT_S, Options, RunEnv
from orchestrator.plan.stop import StopInput, plan_gc, plan_stop, rows

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
    plan: Plan | None = field(default=None, repr=False)  # what ran (or, dry, would run)

    @property
    def exit_code(self) -> int:
        """0 stopped (or already stopped), 1 its GPUs were not released."""
        return 0 if self.ok else 1

    def as_dict(self) -> dict:
        from dataclasses import asdict

        out = asdict(self)
        out.pop("plan", None)
        return out


def stop_model(host: Host, entry: HostEntry, model: str, manifest_gpus: list[int] | None = None,
               release_timeout: float = GPU_RELEASE_TIMEOUT_S, poll: float = 0.5,
               reporter: Reporter | None = None, dry_run: bool = False, lock: LockFacts | None = None,
               guard=None) -> StopResult:
    """Stop MODEL on a host whose lock the caller holds (`lock`, `guard`: the session's). Idempotent.
    dry_run: the plan of what a stop would do; nothing changes (no lock needed). A service that is
    not installed is refused (RefusedError, exit 3)."""
    t0 = time.monotonic()
    facts = gather(host, entry, [model])
    lock = lock or LockFacts(held=not dry_run, path=state.lock_path(entry))
    plan = gateway.with_gateway(plan_stop(StopInput(entry, facts, lock, model, manifest_gpus)),
                                gateway.read(host, entry), entry)
    if plan.refusal is not None:
        raise plan.refusal
    info = plan.info
    res = StopResult(entry.name, model, was=info["was"], gpus=info["gpus"], orphans=info["orphans"],
                     leftovers=info["leftovers"], foreign=info["foreign"], plan=plan)
    if dry_run:
        res.dry_run = True
        res.cleared_active, res.disabled = info["recorded"], info["enabled"]
        res.nothing_to_do = res.was == "stopped" and not res.leftovers and not res.cleared_active and not res.disabled
        return res
    env = RunEnv(host, entry, Options(gpu_release_timeout_s=release_timeout, poll_s=poll), reporter, guard=guard)
    outcome = run_plan(plan, env, reporter or Reporter(None, quiet=True))
    done = {r.step: r for r in outcome.results if r.status == "done"}
    res.stopped_service = "stop" in done and res.was != "stopped"
    res.disabled = "boot" in done
    res.killed = rows(env.record.killed)
    res.gpus_free = done["gpus"].result if "gpus" in done else None
    res.cleared_active = "record" in done or bool(outcome.recovery and outcome.recovery.ok)
    res.ok = outcome.ok
    res.error = outcome.error.message if outcome.error is not None else None
    res.nothing_to_do = res.was == "stopped" and not res.leftovers and not res.killed and not res.cleared_active \
        and not res.disabled
    res.seconds = round(time.monotonic() - t0, 3)
    state.append_history(host, entry, HistoryEntry(**{
        "operation": "stop", "service": model, "model": facts.model_of(model), "ok": res.ok,
        "disabled": res.disabled, "seconds": res.seconds, "was": res.was, "orphans": res.orphans,
        "killed": res.killed, "gpus_free": res.gpus_free, "cleared_active": res.cleared_active,
        "foreign": res.foreign, "noop": res.nothing_to_do, **({"error": res.error} if res.error else {})}))
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

def gc_facts(host: Host, entry: HostEntry) -> HostFacts:
    """Facts whose service states cover every folder (a folder without an installed record may
    still have a PID file or a unit by its name): a second trip only when there are such folders."""
    facts = gather(host, entry)
    missing = [name for name in facts.models if name not in facts.services]
    return gather(host, entry, missing) if missing else facts


def gc_plan(host: Host, entry: HostEntry, lock: LockFacts, names: Sequence[str] = ()) -> Plan:
    """gc's plan from the host's facts and its engine listing; `names`: only those (plan_gc)."""
    facts = gc_facts(host, entry)
    try:
        listing = engine.listing(host, entry)
    except DeployFailed as err:
        return plan_gc(entry, facts, lock, engines_error=err.message, names=names)
    return plan_gc(entry, facts, lock, listing.get("engines", []), names=names)


def run_gc(host: Host, entry: HostEntry, plan: Plan, reporter: Reporter | None = None, guard=None) -> dict:
    """Run gc's plan (the caller holds the lock and has the user's go-ahead for its deletions);
    `guard` (the session's) proves the lock before each step. The history record, returned."""
    t0 = time.monotonic()
    env = RunEnv(host, entry, Options(), reporter, guard=guard)
    outcome = run_plan(plan, env, reporter or Reporter(None, quiet=True))
    deleted = [{"name": n, "bytes": b} for n, b in env.record.deleted]
    kept = [{"name": n, "why": why} for n, why in env.record.kept]
    record = {"operation": "gc", "ok": outcome.ok and not kept, "deleted": deleted,
              "freed_bytes": sum(b for _n, b in env.record.deleted), "kept": kept,
              "seconds": round(time.monotonic() - t0, 3),
              **({"error": outcome.error.message} if outcome.error is not None else {})}
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
