"""stop's and gc's planners, pure: plans the one executor runs like any other (`--dry-run` prints
exactly what runs, recovery included).

stop:  lock -> stop the service -> disable it at boot (a stopped service must not come back at the
       next reboot) -> kill what it left on ITS GPUs (its own processes, or vLLM processes no running
       service owns; SIGTERM, SIGKILL; re-read right before) -> wait until nvidia-smi shows them
       released -> clear its record
       if killing the leftovers or the wait fails: the service is stopped all the same, so its record
       is cleared (the recovery); the run still fails (exit 1), naming what holds the GPUs.
       A process on another GPU, or one owned by another running service, is never touched.
gc:    lock -> each folder under models_root that vllm-orch made (its record) and that no service
       uses (recorded or running): deleted through the one guarded delete (host/modeldirs.py: the path
       resolved ON THE HOST, a direct child of the resolved models_root, still ours), and its unit
       disabled at boot when it was enabled (it would fail at every boot). Each deletion needs
       confirmation (--yes, or a question on a terminal); one the host refuses is kept and named.
       `gc NAME...` deletes only the folders (and engine venvs) named, and refuses (exit 3, nothing
       deleted) when one of them stays by the rule above.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.config.inventory import HostEntry
from orchestrator.errors import ConfigError, RefusedError
from orchestrator.fmt import fmt_bytes
from orchestrator.host import engine, modeldirs, state
from orchestrator.host.facts import HostFacts, gather
from orchestrator.host.ownership import Holders, Proc, gpu_list, holders, kill_commands, read_gpus, wait_released
from orchestrator.host.services import Service
from orchestrator.plan import prepare
from orchestrator.plan.inputs import LockFacts
from orchestrator.plan.model import Action, Plan
from orchestrator.plan.run import RunEnv


@dataclass(frozen=True)
class StopInput:
    entry: HostEntry
    facts: HostFacts
    lock: LockFacts
    name: str                                   # the service
    manifest_gpus: list[int] | None = None      # its manifest's GPUs here: when nothing records them


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
    return holders(facts.procs, [], model, gpus, stopping={model}, protected=facts.services_known(),
                   asleep=facts.sleeping())


def rows(procs: list[Proc]) -> list[dict]:
    return [{"pid": p.pid, "name": p.name, "gpu": p.gpu_index, "used_mib": p.used_mib} for p in procs]


def plan_stop(inp: StopInput) -> Plan:
    f, entry, name = inp.facts, inp.entry, inp.name
    plan = Plan("stop", entry.describe(), name)
    plan.add(prepare.lock_action(inp.lock))
    st = f.services.get(name)
    installed = name in f.installed or name in f.models or f.record(name) is not None
    if not installed and not (st and (st.active or st.failed)):
        return plan.refuse(Action("stop", f"{name} is not installed on {entry.name}"), RefusedError(
            f"{name} is not installed on {entry.name}", host=entry.name, step="stop",
            hint=f"installed: {', '.join(sorted(f.installed)) or 'none'}"))
    was = "running" if st and st.active else ("failed" if st and st.failed else "stopped")
    gpus = model_gpus(f, name, inp.manifest_gpus)
    held = leftovers(f, name, gpus)
    before = held.ours + held.kill
    plan.info.update(was=was, gpus=gpus, leftovers=rows(before), orphans=rows(before) if was != "running" else [],
                     foreign=[p.describe() for p in held.foreign], enabled=bool(st and st.enabled),
                     recorded=f.record(name) is not None)
    shown = Service.for_host(None, entry, name)
    if was != "stopped" or before:
        pid = f", PID {st.main_pid}" if st and st.main_pid else ""

        def stop(env: RunEnv) -> str:
            svc = Service.for_host(env.host, env.entry, name)
            svc.run_all(svc.stop_commands(), f"stop {name}", timeout=600)
            return f"stopped {svc.describe()}"

        plan.add(Action("stop", f"stop the service ({was}{pid})", commands=shown.stop_commands(), run=stop,
                        subject=name))
    else:
        plan.add(Action("stop", f"nothing to do, because {name} is stopped", noop=True))
    if st and st.enabled:
        plan.add(Action("boot", f"disable {shown.describe()} at boot (a stopped service must not come back at the "
                                f"next reboot)", commands=shown.disable_commands()))
    else:
        plan.add(Action("boot", f"nothing to do, because {name} does not start at boot", noop=True))
    kill = plan.add(leftovers_action(name, gpus, held))
    wait = plan.add(release_step(name, gpus, held))
    record = Action("record", f"clear {name}'s record ({entry.state_dir}/services/{name}.json)", run=_clear(name)) \
        if f.record(name) is not None else Action("record", f"nothing to do, because {name} has no record", noop=True)
    plan.add(record)
    if not record.noop and not (kill.noop and wait.noop):
        plan.recover(kill if not kill.noop else wait, f"{name} is stopped all the same: clear its record",
                     [Action("record", record.summary, run=_clear(name))], last=wait)
    return plan


def _clear(name: str):
    def run(env: RunEnv) -> str:
        state.write_record(env.host, env.entry, name, None)
        return f"removed services/{name}.json"
    return run


def leftovers_action(name: str, gpus: list[int], held: Holders) -> Action:
    """Kill what the stop left on the service's GPUs (orphaned workers outlive a SIGKILLed parent):
    what nvidia-smi shows there right after the stop, each only while it is the process classified
    before (a process new on those GPUs is classified from fresh facts first)."""
    if not gpus:
        return Action("leftovers", f"nothing to do, because no GPUs are known for {name}", noop=True)
    before = held.ours + held.kill
    there = (f"there now: {len(before)} process{'es' if len(before) != 1 else ''} of it, e.g. "
             f"PID {before[0].pid} {before[0].name}" if before else "none there now")

    def run(env: RunEnv) -> str:
        _gpus, apps = read_gpus(env.host, env.entry)
        still = [a.pid for i in gpus for a in apps.get(i, [])]
        candidates = {p.pid: p for p in before}
        victims = [candidates[pid] for pid in still if pid in candidates]
        unknown = [pid for pid in still if pid not in candidates]
        if unknown:
            again = leftovers(gather(env.host, env.entry, [name]), name, gpus)
            victims += [p for p in again.ours + again.kill if p.pid in unknown]
        for cmd in kill_commands(victims):
            env.host.run(cmd, timeout=60).check(env.entry.name, "kill leftover GPU processes")
        env.record.killed += victims
        pids = sorted({p.pid for p in victims})
        return f"killed {len(pids)}: " + ", ".join(f"{p.pid} {p.name}" for p in victims) if victims \
            else f"nothing of {name} left on {gpu_list(gpus)}"

    return Action("leftovers", f"kill what of {name} is still on {gpu_list(gpus)} after the stop (SIGTERM, then "
                               f"SIGKILL); {there}", details=[p.describe() for p in before], run=run)


def release_step(name: str, gpus: list[int], held: Holders) -> Action:
    """Wait until nvidia-smi shows the service's GPUs released; processes not ours are left alone
    (and their GPU's memory not waited for); a GPU another running service shares is not waited for."""
    if not gpus:
        return Action("gpus", "nothing to do, because no GPUs are known for it", noop=True)
    if held.others:
        return Action("gpus", f"nothing to do, because {', '.join(sorted({p.model or '?' for p in held.others}))} "
                              f"also runs on {gpu_list(gpus)}: not waited for", noop=True)
    foreign, asleep = list(held.foreign), list(held.asleep)
    return Action("gpus", f"wait until {gpu_list(gpus)} are released", run=lambda env: wait_released(
        env.host, env.entry, gpus, env.opts.gpu_release_timeout_s, env.opts.poll_s, ignore=foreign,
        asleep=asleep),
        details=[f"left alone (not ours): {p.describe()}" for p in foreign]
        + [f"stays (asleep): {p.describe()}" for p in asleep])


# -- gc --------------------------------------------------------------------------------------------

@dataclass
class GcCandidate:
    name: str
    bytes: int
    last_used: float
    verified: bool
    enabled: tuple[str, ...] = ()       # the services whose units start at boot from it: disabled with it


def gc_choice(facts: HostFacts) -> tuple[list[GcCandidate], list[tuple[str, str]]]:
    """(what goes, least recently used first; what stays and why): inactive, not running folders
    that vllm-orch made go; the folders of recorded services (on a host with several services, every
    one of them; a checkpoint's folder is shared, so any of its services keeps it), of running
    services, and folders without vllm-orch's record stay. A folder that goes takes the boot start
    of every installed service that serves from it (it would fail at every boot)."""
    users: dict[str, list[str]] = {}
    for n in facts.records:
        users.setdefault(facts.folder_of(n), []).append(n)
    running = facts.models_in_use() - set(users)
    delete, keep = [], []
    for d in sorted(facts.models.values(), key=lambda d: (d.last_used, d.name)):
        if not d.ours:
            keep.append((d.name, "not made by vllm-orch (no .vllm-orch/verified.json), never deleted"))
        elif d.name in users:
            named = sorted(users[d.name])
            keep.append((d.name, "the active model" if named == [d.name] else f"the weights of {', '.join(named)}"))
        elif d.name in running:
            keep.append((d.name, "its service is running"))
        else:
            boot = tuple(sorted(n for n, st in facts.services.items() if st.enabled and facts.folder_of(n) == d.name))
            delete.append(GcCandidate(d.name, d.bytes, d.last_used, d.complete, boot))
    return delete, keep


def engines_in_use(facts: HostFacts) -> set[str]:
    """The engine venvs a service uses: named by its record (what runs, and what a rollback goes back
    to) or by its installed files (what its next start runs)."""
    return {r.engine for r in facts.records.values() if r.engine} | \
        {i.engine for i in facts.installed.values() if i.engine}


def engine_choice(facts: HostFacts, engines: list[dict]) -> tuple[list[dict], list[tuple[str, str]]]:
    """(engine venvs that go, those that stay and why) from the host's listing (host/engine.py)."""
    used = engines_in_use(facts)
    go = [e for e in engines if e["name"] not in used]
    return go, [(e["name"], "a service uses it") for e in engines if e["name"] in used]


def only_named(names: Sequence[str], entry: HostEntry, delete: list[GcCandidate], keep: list[tuple[str, str]],
               engines: list[dict], kept_engines: list[tuple[str, str]]) -> tuple[list[GcCandidate], list[dict]]:
    """`gc NAME...`: of what gc would delete, only the folders and engine venvs named. A name that is
    no folder of models_root nor engine venv: ConfigError (exit 2); one that stays (in use, not
    vllm-orch's): RefusedError (exit 3) with the reason, and nothing is deleted."""
    known = {c.name for c in delete} | {e["name"] for e in engines} | {n for n, _ in keep + kept_engines}
    unknown = [n for n in names if n not in known]
    unlisted = dict(kept_engines).get("engine venvs")
    if unknown and unlisted:                    # it may be an engine venv: not known, so not bad input
        raise RefusedError(f"gc: {unknown[0]} is no folder under {entry.models_root}, and the engine venvs under "
                           f"{entry.engines_root} are {unlisted}", host=entry.name, step="gc",
                           hint="run gc again once the host can list engines_root")
    if unknown:
        folders = sorted({c.name for c in delete} | {n for n, _ in keep if n != "engine venvs"})
        raise ConfigError(f"gc: {unknown[0]} is no folder under {entry.models_root} and no engine venv under "
                          f"{entry.engines_root} on {entry.name}",
                          hint=f"the folders: {', '.join(folders) or 'none'} (`vllm-orch gc --host {entry.name} "
                               f"--dry-run` lists them with what would go)")
    why = dict(keep + kept_engines)
    staying = [n for n in names if n in why]
    if staying:
        first = staying[0]
        hint = (f"vllm-orch deletes only folders it made: remove {entry.models_root}/{first} by hand if you mean to"
                if why[first].startswith("not made") else
                f"`vllm-orch stop {first} --host {entry.name}` first if no service should use it")
        raise RefusedError(f"{first} stays: {why[first]}; nothing deleted", host=entry.name, step="gc", hint=hint,
                           details=[f"{n} stays: {why[n]}" for n in staying[1:]])
    return [c for c in delete if c.name in names], [e for e in engines if e["name"] in names]


def plan_gc(entry: HostEntry, facts: HostFacts, lock: LockFacts, engines: list[dict] | None = None,
            engines_error: str | None = None, names: Sequence[str] = ()) -> Plan:
    """gc's plan: model folders (gc_choice) and, from the host's listing of engines_root (`engines`;
    None with `engines_error`: it could not be read, so none is deleted), the engine venvs no
    service's record or installed files name; with `names`, only those (only_named)."""
    delete, keep = gc_choice(facts)
    gone_engines, kept_engines = engine_choice(facts, engines or [])
    if engines_error:
        kept_engines.append(("engine venvs", f"not listed ({engines_error}): none deleted"))
    if names:
        delete, gone_engines = only_named(names, entry, delete, keep, gone_engines, kept_engines)
        keep, kept_engines = [], []
    keep = keep + kept_engines
    plan = Plan("gc", entry.describe(), ", ".join(names) if names else "inactive model folders",
                info={"delete": [vars(c) for c in delete], "keep": [list(k) for k in keep],
                      "bytes": sum(c.bytes for c in delete)})
    plan.add(prepare.lock_action(lock))
    if not names:                               # NAMEs: only_named refused any that stays
        plan.add(Action("keep", f"{len(keep)} folder{'s' if len(keep) != 1 else ''} stay", noop=True,
                        details=[f"{n}: {why}" for n, why in keep]))
    if not delete and not gone_engines:
        plan.add(Action("delete", "nothing to do, because no folder of vllm-orch's is unused", noop=True))
    for c in delete:
        plan.add(delete_action(entry, c))
    for e in gone_engines:
        plan.add(engine_delete_action(entry, e))
    plan.info["bytes"] += sum(int(e.get("bytes") or 0) for e in gone_engines)
    plan.info["delete_engines"] = [e["name"] for e in gone_engines]
    return plan


def engine_delete_action(entry: HostEntry, e: dict) -> Action:
    """Remove one engine venv no service uses, through the engine script's guarded removal."""
    name, size = e["name"], int(e.get("bytes") or 0)
    path = f"{entry.engines_root}/{name}"

    def run(env: RunEnv) -> str:
        why = engine.remove(env.host, env.entry, name)
        if why is not None:
            env.record.kept.append((name, why))
            return f"kept: {why}"
        env.record.deleted.append((name, size))
        return f"deleted ({fmt_bytes(size)})"

    what = f"vLLM {e.get('vllm_version')}" if e.get("complete") else "a build that did not finish"
    return Action("delete", f"delete the engine venv {path} ({fmt_bytes(size)}, {what}; no service uses it)",
                  commands=[engine.remove_command(entry, name)],
                  confirm=f"delete {path} on {entry.name} ({fmt_bytes(size)})", run=run)


def delete_action(entry: HostEntry, c: GcCandidate) -> Action:
    path = f"{entry.models_root}/{c.name}"
    used = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.last_used)) if c.last_used else "never"
    shown = [Service.for_host(None, entry, n) for n in c.enabled]

    def run(env: RunEnv) -> str:
        r = env.host.run(modeldirs.delete_script(env.entry.models_root, c.name), timeout=3600)
        if not r.ok:                    # refused on the host (no longer ours, moved): kept, and said so
            why = (r.stderr.strip().splitlines() or [f"exit {r.exit_code}"])[-1]
            env.record.kept.append((c.name, why))
            return f"kept: {why}"
        env.record.deleted.append((c.name, c.bytes))
        disabled = []
        for n in c.enabled:
            svc = Service.for_host(env.host, env.entry, n)
            svc.run_all(svc.disable_commands(), f"disable {n}")
            disabled.append(svc.describe())
        if disabled:
            return f"deleted ({fmt_bytes(c.bytes)}); disabled {', '.join(disabled)} at boot (its weights are gone)"
        return f"deleted ({fmt_bytes(c.bytes)})"

    units = "its unit" if len(c.enabled) == 1 else "the units of " + ", ".join(c.enabled)
    return Action("delete", f"delete {path} ({fmt_bytes(c.bytes)}, last used {used}, "
                            f"{'verified' if c.verified else 'not completely downloaded'})"
                            + (f"; disable {units} at boot" if c.enabled else ""),
                  commands=[modeldirs.delete_script(entry.models_root, c.name),
                            *(cmd for svc in shown for cmd in svc.disable_commands())],
                  confirm=f"delete {path} on {entry.name} ({fmt_bytes(c.bytes)})", run=run)
