"""Plan steps that change what serves: free the GPUs, install the unit, start, stop, wait until
ready, record. Each step is bound to ONE service's manifest and rendered files when the plan is
built, so a plan over several services (regen, a swap's rollback) runs each step with its own.
"""

from __future__ import annotations

import difflib
import re
import shlex
import time
from collections.abc import Collection, Sequence

from orchestrator.config.effective import MANIFEST
from orchestrator.config.engine import lock_of
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.config.placement import NodeRole, node_binds
from orchestrator.errors import RefusedError
from orchestrator.host import state
from orchestrator.host.base import Command, Script
from orchestrator.host.facts import HostFacts, gather
from orchestrator.host.ownership import Holders, gpu_list, holders, kill_commands, wait_released
from orchestrator.host.records import InstalledRecord, NodeFields, ServiceRecord
from orchestrator.host.services import Service
from orchestrator.plan.engine import service_vllm_version
from orchestrator.plan.inputs import PlanInput, ServiceInput
from orchestrator.plan.model import Action
from orchestrator.plan.perf import BelowFloor, expected_text, likely_causes, shortfalls
from orchestrator.plan.run import RunEnv
from orchestrator.plan.sleep import canary_of, graph_pool_mib
from orchestrator.probe import keyed
from orchestrator.probe.perf import measure
from orchestrator.probe.readiness import GATES, UNIT_GATE, wait_ready
from orchestrator.render.artifacts import ORCH_ENV, meet_port
from orchestrator.secret import Secret


def service_of(env: RunEnv, model: str) -> Service:
    return Service.for_host(env.host, env.entry, model)


def placement_holders(facts: HostFacts, m: Manifest, stopping: Collection[str] = ()) -> Holders:
    """The processes on the manifest's GPUs and port, by the one ownership rule; the host's other
    services (recorded or running) are never ours to kill."""
    return holders(facts.procs, facts.ports.get(m.serving.port, []), m.name, m.serving.visible_devices,
                   stopping, protected=facts.services_known(), asleep=facts.sleeping())


# -- GPUs free -------------------------------------------------------------------------------------

def release_action(model_gpus: list[int], why: str) -> Action:
    """Wait until nvidia-smi shows the GPUs without processes and their memory released."""
    return Action("gpus", f"check that {gpu_list(model_gpus)} are released {why}",
                  run=lambda env: wait_released(env.host, env.entry, model_gpus, env.opts.gpu_release_timeout_s,
                                                env.opts.poll_s))


def holders_refusal(held: Holders, m: Manifest, entry: HostEntry, kill_foreign: bool) -> RefusedError | None:
    """Why the placement's GPUs cannot be taken: another running managed service on them, foreign
    processes (without --kill-foreign), or holders vllm-orch cannot identify (never killed)."""
    want = gpu_list(m.serving.visible_devices)
    if held.others:
        models = ", ".join(sorted({p.model or "?" for p in held.others}))
        return RefusedError(f"{models} is serving on {want}: deploy does not stop another model",
                            host=entry.name, step="gpus", details=[p.describe() for p in held.others],
                            hint=f"use `vllm-orch swap {m.name} --host {entry.name}` (stages, switches, rolls back)")
    if held.foreign and not kill_foreign or held.unknown:
        def named(p) -> str:
            if not p.pid:
                return "a socket whose owner is not visible to vllm-orch"
            return f"PID {p.pid} {p.name}" + (f" (user {p.user})" if p.user else "") + \
                ("" if p.killable else " (not visible to vllm-orch now)")
        shown = held.foreign if not kill_foreign else held.unknown
        return RefusedError(
            f"{want} or port {m.serving.port} are used by processes vllm-orch does not manage: "
            + "; ".join(named(p) for p in shown), host=entry.name, step="gpus", details=[p.describe() for p in shown],
            hint="stop them yourself or choose another serving.port" + (
                "; vllm-orch never signals a process it cannot identify" if held.unknown else
                ", or pass --kill-foreign to let vllm-orch kill them"))
    return None


def gpus_action(inp: PlanInput, stopping: Collection[str] = ()) -> tuple[Action, RefusedError | None]:
    """Free the placement's GPUs. Planned from the gathered facts; at run time the holders are read
    again (a long download lies in between) and only what the ownership rule then says is killed,
    each PID only while it is still the process classified."""
    m, entry = inp.target.manifest, inp.entry
    want = m.serving.visible_devices
    stops = sorted(stopping)
    held = placement_holders(inp.facts, m, stops)
    refusal = holders_refusal(held, m, entry, inp.opts.kill_foreign)
    if refusal is not None:
        summary = (f"{', '.join(sorted({p.model or '?' for p in held.others}))} serves on {gpu_list(want)}"
                   if held.others else f"{len(held.foreign)} processes vllm-orch does not manage hold "
                                       f"{gpu_list(want)} or port {m.serving.port}")
        return Action("gpus", summary, details=refusal.details), refusal
    victims = held.victims(inp.opts.kill_foreign)

    def run(env: RunEnv) -> str:
        fresh = gather(env.host, env.entry, [m.name, *stops], ports=[m.serving.port])
        now = placement_holders(fresh, m, stops)
        err = holders_refusal(now, m, env.entry, env.opts.kill_foreign)
        if err is not None:
            raise err
        kill = now.victims(env.opts.kill_foreign)
        for cmd in kill_commands(kill):
            env.host.run(cmd, timeout=60).check(env.entry.name, "kill leftover GPU processes")
        killed = f"killed {len(kill)} process{'es' if len(kill) != 1 else ''} (re-read right before killing); " \
            if kill else ""
        if now.ours:            # the service itself still runs: the start step restarts it
            return killed + f"{gpu_list(want)} held only by {', '.join(sorted({p.model or '?' for p in now.ours}))}"
        if not kill and not stops and not victims:
            return f"re-read right before the start: {gpu_list(want)} still free"
        return killed + wait_released(env.host, env.entry, want, env.opts.gpu_release_timeout_s, env.opts.poll_s,
                                      asleep=now.asleep)

    if not victims:
        if held.asleep:
            sleepers = ", ".join(sorted({p.model or "?" for p in held.asleep}))
            return Action("gpus", f"check that {gpu_list(want)} are free but for {sleepers}, asleep", run=run,
                          details=[f"stays (asleep, a CUDA context per GPU): {p.describe()}" for p in held.asleep]), None
        if stops:
            return Action("gpus", f"check that {gpu_list(want)} are released after the stop", run=run,
                          details=[f"the processes on {gpu_list(want)} belong to {', '.join(stops)}, "
                                   f"stopped first"]), None
        reason = f"only {m.name} itself holds {gpu_list(want)}" if held.ours else f"no process holds {gpu_list(want)}"
        return Action("gpus", f"nothing to do, because {reason}", noop=True, run=run), None
    return Action("gpus", f"kill {len(victims)} leftover process{'es' if len(victims) != 1 else ''} on "
                          f"{gpu_list(want)} (SIGTERM, 10 s, SIGKILL), then wait until their memory is released",
                  details=[p.describe() for p in victims], commands=kill_commands(victims), run=run), None


# -- install ---------------------------------------------------------------------------------------

def _diff(old: str | None, new: str, path: str) -> list[str]:
    if old is None:
        return [f"new file {path}"]
    return [line.rstrip("\n") for line in difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                               f"{path} (installed)", f"{path} (rendered)", n=1)]


_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=")


def _mask_env(text: str, shown_keys: set[str]) -> str:
    """An installed env file as a diff may show it: comments, blank lines and the values of keys
    known to be harmless (what vllm-orch writes itself, the manifest's env) as they are; every other
    value masked. The file on disk may hold secrets no manifest lists any more."""
    out = []
    for line in text.splitlines(True):
        if not line.strip() or line.lstrip().startswith("#"):
            out.append(line)
            continue
        m = _ASSIGNMENT.match(line)
        if m and m.group(1) in shown_keys:
            out.append(line)
        else:
            out.append(f"{m.group(1)}=***\n" if m else "*** (a line that is not KEY=value, hidden)\n")
    return "".join(out)


def installed_record(svc: ServiceInput) -> InstalledRecord:
    """What installed/NAME.json keeps: the files, their hashes, the placement (GPUs, port) and where
    each part came from: a part a run placed (deploy --gpus/--port, swap --replace) is kept by
    later runs (config/placement.resolve, Origin.RECORD), so a redeploy or regen keeps the service
    where it is. A node of a multi-node service: its nodes and rank too (stop finds every node from
    any one, even after a deploy that failed before its record step)."""
    r = svc.rendered
    node = svc.spec.node(r.host.name) if svc.spec is not None else None
    origins = {"gpus_from": node.gpus_from, "port_from": node.port_from} if node is not None else {}
    return InstalledRecord(model=r.model, service=r.manifest.name, folder=r.folder, unit=r.unit.path, env_file=r.env_file.path,
                           manifest_hash=r.manifest_hash, unit_hash=r.unit_hash,
                           gpus=r.manifest.serving.visible_devices, port=r.manifest.serving.port,
                           served_name=r.manifest.served_name, address=r.manifest.serving.host,
                           engine=lock_of(r.manifest.engine).name if r.manifest.engine else None,
                           installed_at=state.now_iso(), cluster_ports=cluster_ports(r.manifest),
                           node_ports=node_ports(r.manifest, r.role), **origins,
                           **NodeFields.of(r.role))


def cluster_ports(m: Manifest) -> dict[str, int] | None:
    """What a multi-node service's records keep of its ports (every node's, the same): the port its
    nodes meet at as rendered, so a later run keeps it (config/placement.resolve)."""
    name = m.cluster_port_name
    return {name: meet_port(m, name)} if name is not None else None


def node_ports(m: Manifest, role: NodeRole | None) -> dict[str, int] | None:
    """What a node's records keep of its own Ray ports (backend ray), for the other services' checks."""
    own = {name: port for name, port in node_binds(m, role) if name != m.cluster_port_name}
    return own or None


def placement_lines(svc: ServiceInput) -> list[str]:
    """Where the service's GPUs and ports come from, when not from its manifest (the inventory's
    override, the command line, a record; a multi-node port derived from the head's GPUs): the plan
    shows it like `render --host` does."""
    origins = svc.effective.origins if svc.effective is not None else {}
    m = svc.manifest
    s = m.serving
    parts = [f"{label} {value} <- {origins[path]}" for label, value, path in
             (("GPUs", ",".join(map(str, s.visible_devices)), "serving.gpu_ids"), ("port", s.port, "serving.port"))
             if path in origins]
    name = m.cluster_port_name          # the port a multi-node service's nodes meet at, unless the manifest's
    if name is not None and origins.get(f"multinode.{name}", MANIFEST) != MANIFEST:
        parts.append(f"{name} {meet_port(m, name)} <- {origins[f'multinode.{name}']}")
    return [f"placement: {'; '.join(parts)}"] if parts else []


def install_action(entry: HostEntry, svc: ServiceInput, step: str = "install") -> Action:
    """Write the rendered unit and env file where they differ from what is installed, daemon-reload."""
    r, name = svc.rendered, svc.name
    changed, details = [], placement_lines(svc)
    for f in r.files:
        current = svc.installed_files.get(f.path)
        if current == f.data():
            continue
        old = None if current is None else current.decode(errors="replace")
        if f is r.env_file and old is not None:
            old = _mask_env(old, set(ORCH_ENV) | set(r.manifest.env))
        changed.append(f)
        details += _diff(old, f.text, f.path)

    def record(env: RunEnv) -> None:
        state.write_installed(env.host, env.entry, name, installed_record(svc))

    if not changed:
        def bookkeeping(env: RunEnv) -> None:
            record(env)
        return Action(step, f"nothing to do, because {r.unit.path} and {r.env_file.path} are up to date",
                      noop=True, run=bookkeeping, details=details)

    def run(env: RunEnv) -> str:
        for f in changed:
            env.host.run(["mkdir", "-p", f.path.rsplit("/", 1)[0]]).check(env.entry.name, "create folder")
            env.host.put(f.path, f.data(), f.mode)
        svc_ = service_of(env, name)
        svc_.run_all(svc_.reload_commands(), "daemon-reload")
        record(env)
        return f"wrote {len(changed)} file{'s' if len(changed) != 1 else ''}"

    cmds: list[Command] = [Script(f"install -m {f.mode:04o} <rendered> {shlex.quote(f.path)}") for f in changed]
    return Action(step, f"write {', '.join(f.path for f in changed)}", details=details,
                  commands=cmds + Service.for_host(None, entry, name).reload_commands(), run=run)


def restore_action(svc: ServiceInput, previous: InstalledRecord | None = None) -> Action:
    """Put back the files that were installed before this run (regen's recovery), and with them
    `previous`, their installed record (an upgrade's rollback: the record names the engine they run)."""
    files = [(f.path, svc.installed_files.get(f.path), f.mode) for f in svc.rendered.files]

    def run(env: RunEnv) -> str:
        for path, data, mode in files:
            if data is not None:
                env.host.put(path, data, mode)
        if previous is not None:
            state.write_installed(env.host, env.entry, svc.name, previous)
        s = service_of(env, svc.name)
        s.run_all(s.reload_commands(), "daemon-reload")
        return "previous files restored"

    return Action("restore", f"put back the previously installed {', '.join(p for p, d, _ in files if d is not None)}",
                  run=run)


# -- start / stop ----------------------------------------------------------------------------------

def _mark_cursor(env: RunEnv, model: str) -> None:
    env.record.log_cursors[model] = service_of(env, model).log_cursor()


def start_action(inp: PlanInput, unit_changed: bool) -> Action:
    name, entry = inp.name, inp.entry
    st = inp.facts.services.get(name)
    running = bool(st and st.active)
    if st is not None and running and not unit_changed:
        return Action("start", f"nothing to do, because {name} is already running (PID {st.main_pid})",
                      noop=True, run=lambda env: _mark_cursor(env, name))
    return start_service_action(entry, name, restart=running, enable=inp.opts.enable, downtime_starts=running,
                                summary=f"{'restart (the unit changed)' if running else 'start'} {name}"
                                        + (" and enable it at boot" if inp.opts.enable else ""))


def start_service_action(entry: HostEntry, model: str, *, restart: bool = False, enable: bool = False,
                         summary: str | None = None, step: str = "start", downtime_starts: bool = False) -> Action:
    """Start (or restart) a service with its installed unit; its log position is marked first.
    `downtime_starts`: the restart stops a serving service (an upgrade: the same service, new files),
    so the downtime is counted from here."""
    shown = Service.for_host(None, entry, model)
    cmds = (shown.stop_commands() if restart else []) + shown.start_commands() + \
        (shown.enable_commands() if enable else [])

    def run(env: RunEnv) -> str:
        _mark_cursor(env, model)
        svc = service_of(env, model)
        if downtime_starts and env.record.stopped_at is None:
            env.record.stopped_at = time.monotonic()
        svc.run_all(cmds, f"start {model}", timeout=600)
        env.record.started.add(model)
        st = svc.wait_started()
        return f"{'restarted' if restart else 'started'} {svc.describe()}" + (
            f" ({st.describe()}, PID {st.main_pid})" if st.main_pid else f" ({st.describe()})")

    return Action(step, summary or f"start {model}", commands=cmds, run=run, subject=model, restart=restart)


def stop_action(entry: HostEntry, model: str, why: str, *, downtime_starts: bool = False,
                only_if_started: bool = False, swap_to: str | None = None, enabled: bool = False,
                drain: bool = True, to_wakes: bool = False) -> Action:
    """Stop a service. `swap_to`: the stop begins a swap, so the host first records the swap as half
    done (state_dir/swap.json, with whether `model` starts at boot) for whoever comes next if this
    run is killed or loses its connection before the swap ends. `drain=False`: the service never
    served (its start failed or was interrupted), so it is killed after a short wait instead of
    being given vLLM's drain window (Service.ABORT_WAIT_S). `to_wakes`: the swap wakes `swap_to`
    (sleep mode) rather than starting it (the marker says so)."""
    shown = Service.for_host(None, entry, model)

    def run(env: RunEnv) -> str:
        if only_if_started and model not in env.record.started:
            return f"{model} was not started by this run: nothing to stop"
        if swap_to is not None:
            state.write_swap(env.host, env.entry, model, swap_to, enabled, to_wakes=to_wakes)
        if downtime_starts:
            env.record.stopped_at = time.monotonic()
        service_of(env, model).run_all(shown.stop_commands(drain), f"stop {model}", timeout=600)
        env.record.started.discard(model)
        return f"stopped {model}"

    details = [f"first records the swap to {swap_to} as under way in {entry.state_dir}/swap.json"] if swap_to else []
    return Action("stop", f"stop {model} ({why})", commands=shown.stop_commands(drain), run=run, details=details,
                  subject=model)


def boot_action(entry: HostEntry, enable: str | None, disable: list[str], summary: str) -> Action:
    """Which units start at boot: enable one, disable others (systemd; nothing on `process` hosts)."""
    cmds: list[Command] = []
    if enable:
        cmds += Service.for_host(None, entry, enable).enable_commands()
    for name in disable:
        cmds += Service.for_host(None, entry, name).disable_commands()
    if not cmds:
        return Action("boot", f"nothing to do, because {summary}", noop=True)

    def run(env: RunEnv) -> str:
        for cmd in cmds:
            env.host.run(cmd, timeout=120).check(env.entry.name, "enable / disable at boot")
        return summary

    return Action("boot", summary, commands=cmds, run=run)


# -- readiness -------------------------------------------------------------------------------------

def ready_action(svc: ServiceInput, opts_budget: float | None, already_serving: bool, *,
                 marks_ready: bool = True, workers: Sequence[str] = ()) -> Action:
    """Wait for the gates at this host. `workers`: the other nodes of a multi-node service (their
    envs in RunEnv.nodes), whose logs and units are followed too: a fatal line or an exit on any of
    them fails the wait naming that node."""
    m = svc.manifest
    if already_serving:
        return Action("ready", f"nothing to do, because {m.served_name} answers /health and is listed on "
                               f"port {m.serving.port}", noop=True, subject=svc.name)
    budget = opts_budget or m.startup.budget_seconds
    key: Secret | None = svc.api_key
    gates = GATES + ((UNIT_GATE,) if svc.rendered.host.service_manager == "systemd" else ())

    def run(env: RunEnv) -> str:
        service = service_of(env, m.name)
        cursor = env.record.log_cursors.get(m.name) or service.log_cursor()
        nodes = [(n, service_of(env.nodes[n], m.name)) for n in workers]
        ready = wait_ready(env.host, service, m, cursor, on_event=env.event, budget_s=budget,
                           no_progress_s=env.opts.no_progress_s, poll_s=env.opts.poll_s,
                           api_key=key, nodes=nodes,
                           node_cursors={n: c for n in workers
                                         if (c := env.nodes[n].record.log_cursors.get(m.name))})
        env.record.ready[m.name] = ready
        if marks_ready:
            env.record.ready_at = time.monotonic()
        if m.sleep is not None:     # sleep mode: the known answer a wake is checked against
            env.record.canaries[m.name] = canary_of(env, svc)
        state.touch_usage(env.host, env.entry, svc.folder)       # by folder: disk eviction reads it
        gates = ", ".join(f"{g} {t:.1f}s" for g, t in ready.gates)
        return f"{gates}; smoke: {ready.smoke.summary()}"

    also = f"; follow the logs and units of {', '.join(workers)} too (a fatal line or an exit there fails it)" \
        if workers else ""
    return Action("ready", f"wait up to {budget:.0f}s for {m.name}: {' -> '.join(gates)}; fail on a fatal log "
                           f"line, on exit, or after {m.startup.no_progress_seconds}s without a log line{also}",
                  run=run, subject=svc.name)


# -- performance floor -----------------------------------------------------------------------------

def previous_measurement(inp: PlanInput) -> ServiceRecord | None:
    """The record of this same service (its last measurement, argv and vLLM version), if any."""
    return inp.facts.record(inp.name)


def perf_action(inp: PlanInput, already_serving: bool = False) -> Action:
    """Measure the throughput the manifest expects (seconds), record it, and warn or fail (the
    manifest's choice) when it comes up far below, naming the likely causes."""
    svc = inp.target
    m, perf = svc.manifest, svc.manifest.performance
    if not perf.expects:
        return Action("perf", f"nothing to do, because {m.name} states no expected throughput "
                              "(performance.single_stream_tok_s)", noop=True)
    if already_serving:
        return Action("perf", f"nothing to do, because {m.name} serves unchanged (measured when it was deployed)",
                      noop=True)
    key: Secret | None = svc.api_key
    origins = svc.effective.origins if svc.effective is not None else {}
    previous = previous_measurement(inp)
    argv, vllm_version = list(svc.rendered.argv), service_vllm_version(inp)

    def run(env: RunEnv) -> str:
        ep = keyed.endpoint_for("perf", env.host, env.entry, m.name, m.serving.port, key)
        got = measure(ep, m.served_name, max_tokens=perf.max_tokens,
                      single=perf.single_stream_tok_s is not None, concurrency=perf.concurrency,
                      timeout=perf.timeout_seconds)
        short = shortfalls(perf, got)
        env.record.perf[m.name] = {**got.as_dict(), "expected": expected_text(perf), "floor": perf.floor,
                                   "ok": not short, "on_below": perf.on_below}
        if not short:
            return f"{got.summary()} in {got.seconds:.1f}s (expected {expected_text(perf)})"
        text = "; ".join(s.describe() for s in short)
        causes = likely_causes(m, argv, origins, vllm_version, previous)
        env.record.perf[m.name]["likely_causes"] = causes
        if perf.on_below == "fail":
            raise BelowFloor(f"{m.name} serves far below its expected throughput: {text}",
                             details=["likely causes:"] + [f"  {c}" for c in causes] + got.problems,
                             hint="fix the cause and deploy again, or lower performance.single_stream_tok_s / "
                                  "set performance.on_below: warn in the manifest if this host is slower")
        warning = (f"{m.name} serves far below its expected throughput: {text}; likely causes: "
                   + "; ".join(f"({i}) {c}" for i, c in enumerate(causes, 1)))
        env.record.warnings.append(warning)
        env.event("warn", warning)
        return f"WARNING {text}"

    figures = expected_text(perf)
    return Action("perf", f"measure {figures} for a few seconds ({perf.max_tokens} tokens per stream); "
                          f"{perf.on_below} below {perf.floor:.0%} of that", run=run)


# -- record ----------------------------------------------------------------------------------------

def active_record(inp: PlanInput, env: RunEnv, enabled: bool) -> ServiceRecord:
    m, r = inp.target.manifest, inp.target.rendered
    dl = env.record.download
    commit = (dl.commit if dl else None) or (inp.download.commit if inp.download else None) or m.source.revision
    vllm_version = (env.record.engine or {}).get("vllm_version") or service_vllm_version(inp)
    ready = env.record.ready.get(m.name)
    graphs = graph_pool_mib(ready.ledger, r.argv) if ready is not None and m.sleep is not None else None
    return ServiceRecord(graph_pool_mib=graphs, engine=lock_of(m.engine).name if m.engine else None,
                         model=r.model, service=m.name, folder=r.folder, served_name=m.served_name,
                         port=m.serving.port,
                         repo=m.source.repo, revision=commit, manifest_hash=r.manifest_hash, unit_hash=r.unit_hash,
                         vllm_version=vllm_version, argv=r.argv, gpus=m.serving.visible_devices,
                         deployed_at=state.now_iso(), host_label=inp.entry.label, enabled=enabled,
                         hardware=inp.target.effective.hardware if inp.target.effective else None,
                         perf=env.record.perf.get(m.name), canary=env.record.canaries.get(m.name),
                         cluster_ports=cluster_ports(m), node_ports=node_ports(m, r.role), **NodeFields.of(r.role))


def record_action(inp: PlanInput, enabled: bool = False, ends_swap: bool = False,
                  replaces: str | None = None) -> Action:
    """services/NAME.json records the service (and whether it starts at boot); a swap's record
    also removes the record of the service it replaced and ends the swap (its swap.json goes)."""
    gone = replaces if replaces and replaces != inp.name else None

    def run(env: RunEnv) -> str:
        state.write_record(env.host, env.entry, inp.name, active_record(inp, env, enabled))
        if gone:
            state.write_record(env.host, env.entry, gone, None)
        if ends_swap:
            state.clear_swap(env.host, env.entry)
        return f"recorded {inp.name} as serving in {state.record_path(env.entry, inp.name)}" + \
            (f"; removed {gone}'s record" if gone else "")

    boot = ", enabled at boot" if enabled else ""
    return Action("record", f"record {inp.name} as the active model{boot}, the hashes, timings and smoke "
                            f"result in {inp.entry.state_dir}" + (f"; {gone}'s record goes" if gone else "")
                  + ("; the swap has ended" if ends_swap else ""), run=run)


def rerecord_action(svc: ServiceInput, step: str = "record") -> Action:
    """After a restart with the files rendered now (regen --restart, a rollback that started an old
    service from files newer than it last ran), the service's record says how it runs: the hashes,
    its command line, GPUs, port and served name (what the overlap check and status trust), and the
    canary the restart's ready gate took (sleep mode: the answer its next wake is checked against; a
    regen that turned sleep mode on had none to keep); its revision and deploy time stay (which
    weights it serves did not change)."""
    r, s = svc.rendered, svc.manifest.serving

    def run(env: RunEnv) -> str:
        canary = env.record.canaries.get(svc.name)
        ready = env.record.ready.get(svc.name)
        graphs = {"graph_pool_mib": graph_pool_mib(ready.ledger, r.argv)} if ready is not None else {}
        if state.update_record(env.host, env.entry, svc.name, unit_hash=r.unit_hash, manifest_hash=r.manifest_hash,
                               argv=list(r.argv), gpus=list(s.visible_devices), port=s.port,
                               served_name=svc.manifest.served_name, **({"canary": canary} if canary else {}),
                               **graphs):
            return f"services/{svc.name}.json: how it runs now (hashes, command line, GPUs, port)"
        return f"{svc.name} has no record (it was never recorded serving): nothing to update"

    return Action(step, f"update {svc.name}'s record to the files it runs (hashes, command line, GPUs, port; "
                        f"its revision and deploy time stay)", run=run)


def rerecord_installed_action(entry: HostEntry, name: str) -> Action:
    """A service restarted from installed files other than those it ran (regen installed them
    without --restart): its record takes their GPUs, port and hashes (installed/NAME.json), so it
    says where it runs."""
    def run(env: RunEnv) -> str:
        installed = state.read_installed(env.host, env.entry, name)
        if installed is None or not state.update_record(env.host, env.entry, name, gpus=installed.gpus,
                                                        port=installed.port, unit_hash=installed.unit_hash,
                                                        manifest_hash=installed.manifest_hash):
            return f"{name} has no record or installed record: nothing to update"
        return f"services/{name}.json: the GPUs, port and hashes of the files it runs now"

    return Action("record", f"update {name}'s record to its installed files, which it runs now (GPUs, port, "
                            f"hashes)", run=run)


def forget_swap_action(entry: HostEntry, why: str) -> Action:
    """The last step of a rollback: the host no longer has a swap under way."""
    def run(env: RunEnv) -> str:
        state.clear_swap(env.host, env.entry)
        return f"removed {env.entry.state_dir}/swap.json"

    return Action("record", f"remove {entry.state_dir}/swap.json ({why})", run=run)


def runs_older_files(facts: HostFacts, svc: ServiceInput) -> bool:
    """The service runs, and runs other files than those rendered now: its record names another
    unit hash (regen installed new files without --restart, so the process still runs the old
    ones). Such a service is restarted by a deploy, swap or regen --restart even when its installed
    files are already the new ones."""
    st, rec = facts.services.get(svc.name), facts.record(svc.name)
    return bool(st and st.active) and rec is not None and rec.unit_hash is not None \
        and rec.unit_hash != svc.rendered.unit_hash


def enabled_at_boot(facts: HostFacts, model: str) -> bool:
    """Whether a model's unit starts at boot: systemd's word, else what vllm-orch recorded."""
    st = facts.services.get(model)
    if st is not None and st.enabled is not None:
        return st.enabled
    rec = facts.record(model)
    return rec is not None and rec.enabled
