"""One function per step: read facts, return an Action (the exact commands, or a no-op reason).

Steps never check for dry-run: the plan they return is printed by --dry-run and run by apply.
Actions whose work is more than a list of commands (downloads with progress, waiting for GPUs to
be released, readiness gates) carry a `run` callable and show the commands they issue.
"""

from __future__ import annotations

import difflib
import shlex
import time
from dataclasses import dataclass, field
from typing import Any

from orchestrator.host import nvidia_smi as gpu
from orchestrator.errors import DeployFailed, RefusedError
from orchestrator.host.facts import GpuProc, HostFacts
from orchestrator.host.base import Command, Host, Script
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.plan.model import Action
from orchestrator.probe.readiness import GATES, Ready, wait_ready
from orchestrator.render.artifacts import Rendered
from orchestrator.host.services import Service
from orchestrator.host import state

GIB = 1024 ** 3
IDLE_GPU_MIB = 2048            # a GPU with no process and less than this in use counts as free
GPU_RELEASE_TIMEOUT_S = 90     # one public script waits up to 90 s for memory after killing workers


@dataclass
class Options:
    kill_foreign: bool = False
    enable: bool = False
    yes: bool = False
    skip_checks: frozenset[str] = frozenset()
    budget_s: float | None = None           # override the manifest's start-up budget (tests)
    no_progress_s: float | None = None
    poll_s: float = 0.5
    gpu_release_timeout_s: float = GPU_RELEASE_TIMEOUT_S


@dataclass
class Ctx:
    host: Host
    entry: HostEntry
    manifest: Manifest
    rendered: Rendered
    facts: HostFacts
    opts: Options
    reporter: Any = None
    # filled while planning / running
    download: dict | None = None
    log_cursor: str | None = None
    ready: Ready | None = None
    started: bool = False
    results: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def service(self) -> Service:
        return Service.for_host(self.host, self.entry, self.name)

    def event(self, kind: str, text: str) -> None:
        if self.reporter is not None:
            self.reporter.event(kind, text)


def fmt_bytes(n: float) -> str:
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def gpu_list(indices: list[int]) -> str:
    if indices and indices == list(range(indices[0], indices[-1] + 1)) and len(indices) > 2:
        return f"GPUs {indices[0]}-{indices[-1]}"
    return "GPU" + ("s " if len(indices) != 1 else " ") + ",".join(map(str, indices))


# -- 1. lock ---------------------------------------------------------------------------------------

def lock_action(entry: HostEntry, holder: dict | None, held_by_us: bool) -> Action:
    path = f"{entry.state_dir}/deploy.lock"
    if held_by_us:
        return Action("lock", f"holding the deploy lock {path} for this run", run=lambda c: "held")
    if holder:
        return Action("lock", f"the deploy lock {path} is held by {holder.get('operation', '?')} "
                              f"({holder.get('holder', '?')}, since {holder.get('since', '?')}): a real run "
                              f"would be refused", warn=True)
    return Action("lock", f"take the deploy lock {path} (free now; released when vllm-orch exits)")


# -- 2. preflight ----------------------------------------------------------------------------------

def gpu_facts(f: HostFacts) -> tuple[list[dict], list[dict], str | None, str | None]:
    """The deploy's GPU facts in the shape orchestrator.plan.preflight's checks take."""
    gpus = [{"index": g.index, "uuid": g.uuid, "name": g.name or "?", "memory_total_mib": g.memory_total_mib or 0,
             "memory_used_mib": g.memory_used_mib or 0} for g in f.gpus]
    procs = [{"pid": p.pid, "process_name": p.name, "gpu_index": p.gpu_index, "used_mib": p.used_mib}
             for p in f.procs if p.gpu_index is not None]
    return gpus, procs, f.driver_version, f.cuda_version


def preflight_action(ctx: Ctx) -> tuple[Action, RefusedError | None]:
    """orchestrator.plan.preflight's checks with the host's own vLLM (flags, versions, packages) and the
    GPU facts already read: nothing on the host changes, nothing is downloaded before it passes."""
    from orchestrator.plan.preflight import FAIL, SKIPPED, WARN
    from orchestrator.ops.preflight_run import manifest_kwargs, run_preflight

    m, f = ctx.manifest, ctx.facts
    managed = [p.pid for p in f.procs if p.owner]
    checks = run_preflight(ctx.host, ctx.entry.python, ctx.rendered.argv, ctx.rendered.provenance,
                           manifest_label=f"models/{m.name}.yaml", nvidia_smi=ctx.entry.nvidia_smi,
                           managed_pids=managed, kill_foreign=ctx.opts.kill_foreign,
                           skip=ctx.opts.skip_checks | set(ctx.entry.skip_checks), gpu_facts=gpu_facts(f),
                           **manifest_kwargs(m))
    for c in checks:    # skipped by the inventory, not by the command line: say so
        if c.status == SKIPPED and c.name in ctx.entry.skip_checks and c.name not in ctx.opts.skip_checks:
            c.summary = "skipped (host setting)"
    ctx.results["preflight"] = [c.as_dict() for c in checks]
    details = []
    for c in checks:
        mark = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "skipped": "skipped"}[c.status]
        timing = f" ({c.seconds:.1f}s)" if c.seconds else ""
        details.append(f"{mark:<7} {c.name}: {c.summary}{timing}")
        if c.status in (FAIL, WARN):
            details += [f"          {d}" for d in c.details[:4]]
            if c.fix:
                details.append(f"          fix: {c.fix}")
    if f.gpu_error:
        details.append(f"          nvidia-smi: {f.gpu_error}")
    failed = [c for c in checks if c.status == FAIL]
    skipped = [c.name for c in checks if c.status == SKIPPED]
    if failed:
        first = failed[0]
        err = RefusedError(f"{first.name}: {first.summary}", host=ctx.entry.name, step="preflight",
                           hint=(first.fix + "; " if first.fix else "") + f"--skip-check {first.name} if you know better",
                           details=[f"{c.name}: {c.summary}" for c in failed[1:]])
        return Action("preflight", f"{len(failed)} of {len(checks)} checks failed", details=details), err
    warned = [c.name for c in checks if c.status == WARN]
    summary = f"{len(checks) - len(skipped)} checks passed" + \
        (f" ({len(warned)} with warnings: {', '.join(warned)})" if warned else "") + \
        (f", {len(skipped)} skipped: {', '.join(skipped)}" if skipped else "")
    return Action("preflight", summary, noop=True, details=details), None


# -- 3. disk + 4. download -------------------------------------------------------------------------

def model_path(entry: HostEntry, name: str) -> str:
    return f"{entry.models_root}/{name}"


def _verified_matches(ctx: Ctx) -> dict | None:
    """Our verified record for this model when it covers the pinned revision (no Hub call needed)."""
    d = ctx.facts.models.get(ctx.name)
    rec = d.verified if d else None
    src = ctx.manifest.source
    if rec and rec.get("repo") == src.repo and src.pinned and rec.get("revision") == src.revision:
        return rec
    return None


def plan_download(ctx: Ctx) -> dict:
    """{total_bytes, have_bytes, to_fetch_bytes, files, to_fetch, commit} - from our record when the
    revision is pinned and verified, else from the Hub's metadata (run on the host)."""
    rec = _verified_matches(ctx)
    if rec:
        total = int(rec.get("total_bytes") or sum(f.get("size", 0) for f in rec.get("files", {}).values()))
        return {"total_bytes": total, "have_bytes": total, "to_fetch_bytes": 0,
                "files": len(rec.get("files", {})), "to_fetch": [], "commit": rec.get("revision"),
                "from_record": True}
    from orchestrator.host.download import plan_download as hub_plan

    src = ctx.manifest.source
    return hub_plan(ctx.host, ctx.entry.python, src.repo, src.revision, model_path(ctx.entry, ctx.name),
                    src.allow_patterns, src.ignore_patterns, state_dir=ctx.entry.state_dir,
                    token=hf_token())


def hf_token():
    """The Hub token for downloads: $HF_TOKEN, else the file named by $HF_TOKEN_FILE (a Secret)."""
    import os
    from pathlib import Path

    from orchestrator.secret import Secret

    if os.environ.get("HF_TOKEN"):
        return Secret(os.environ["HF_TOKEN"])
    path = os.environ.get("HF_TOKEN_FILE")
    if path and Path(path).expanduser().is_file():
        return Secret(Path(path).expanduser().read_text().strip())
    return None


def disk_available(ctx: Ctx) -> tuple[int, str]:
    """Bytes the download may use now: min(disk free - reserve, budget - managed bytes), and why."""
    f, entry, m = ctx.facts, ctx.entry, ctx.manifest
    host_reserve = entry.disk_reserve_gib is not None
    reserve = int((entry.disk_reserve_gib if host_reserve else m.requires.disk_reserve_gib) * GIB)
    available = f.disk_free - reserve
    limit_txt = f"{fmt_bytes(f.disk_free)} free on {f.disk_path} - {fmt_bytes(reserve)} reserve" + \
        (" (host setting)" if host_reserve else "")
    if entry.models_disk_budget_gib is not None:
        used = sum(d.bytes for d in f.models.values())
        budget_left = int(entry.models_disk_budget_gib * GIB) - used
        if budget_left < available:
            available = budget_left
            limit_txt = (f"models budget {entry.models_disk_budget_gib:g} GiB - {fmt_bytes(used)} used by "
                         f"managed models")
    return available, limit_txt


def disk_action(ctx: Ctx, keep: set[str]) -> tuple[Action, RefusedError | None]:
    """Make room for the download: free = min(disk free - reserve, budget - managed bytes)."""
    dl = ctx.download
    need = dl["to_fetch_bytes"]
    f, entry = ctx.facts, ctx.entry
    available, limit_txt = disk_available(ctx)
    if need <= 0:
        return Action("disk", "nothing to do, because nothing needs downloading", noop=True), None
    if need <= available:
        return Action("disk", f"nothing to do, because {fmt_bytes(need)} fits: {fmt_bytes(available)} "
                              f"available ({limit_txt})", noop=True), None
    protected = set(keep) | {ctx.name} | set(f.running())
    if f.active:
        protected.add(f.active.get("model"))
    candidates = sorted((d for n, d in f.models.items() if n not in protected), key=lambda d: d.last_used)
    chosen, freed = [], 0
    for d in candidates:
        if available + freed >= need:
            break
        chosen.append(d)
        freed += d.bytes
    if available + freed < need:
        err = RefusedError(
            f"not enough disk: the download needs {fmt_bytes(need)}, {fmt_bytes(max(available, 0))} is "
            f"available ({limit_txt}) and deleting every inactive managed model would free only "
            f"{fmt_bytes(freed)}", host=entry.name, step="disk",
            hint="free space on the models disk, lower requires.disk_reserve_gib, or raise the budget"
                 + (" (protected: " + ", ".join(sorted(p for p in protected if p)) + ")" if protected else ""))
        return Action("disk", f"short by {fmt_bytes(need - available - freed)}"), err
    details = [f"delete {d.name}: {fmt_bytes(d.bytes)}, last used "
               f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(d.last_used)) if d.last_used else 'never'}"
               for d in chosen]
    commands: list[Command] = [["rm", "-rf", "--one-file-system", model_path(entry, d.name)] for d in chosen]
    return Action("disk", f"free {fmt_bytes(freed)} by deleting {len(chosen)} least recently used inactive "
                          f"model folder{'s' if len(chosen) != 1 else ''} (needs {fmt_bytes(need)}, "
                          f"{fmt_bytes(max(available, 0))} available)",
                  commands=commands, details=details), None


def download_action(ctx: Ctx) -> Action:
    dl, src = ctx.download, ctx.manifest.source
    commit = dl.get("commit") or src.revision
    where = f"{src.repo}@{commit[:12]}"
    if dl["to_fetch_bytes"] <= 0 and not dl.get("to_fetch"):
        how = "our verified record" if dl.get("from_record") else "the Hub's metadata"
        return Action("download", f"nothing to do, because {where} is downloaded and verified "
                                  f"({dl['files']} files, {fmt_bytes(dl['total_bytes'])}; checked against {how})",
                      noop=True)
    import hashlib

    from orchestrator.host.download import DownloadProgress, download_argv, run_download, script_bytes

    script = f"{ctx.entry.state_dir}/scripts/download-{hashlib.sha256(script_bytes()).hexdigest()[:12]}.py"
    token = hf_token()
    cmd = download_argv(ctx.entry.python, script, src.repo, src.revision, model_path(ctx.entry, ctx.name),
                        allow=src.allow_patterns, ignore=src.ignore_patterns,
                        token_file=f"{ctx.entry.state_dir}/secrets/hf-token-<run>" if token else None)

    def run(c: Ctx) -> str:
        quiet = c.reporter is None or c.reporter.quiet
        progress = None if quiet else DownloadProgress(c.reporter.console, label=c.name)
        if progress is not None:
            progress.__enter__()
        try:
            result = run_download(c.host, c.entry.python, src.repo, src.revision, model_path(c.entry, c.name),
                                  src.allow_patterns, src.ignore_patterns, state_dir=c.entry.state_dir,
                                  token=token, on_event=progress.handle if progress else None)
        finally:
            if progress is not None:
                progress.__exit__(None, None, None)
        c.results["download"] = result
        done = result["done"]
        return (f"{fmt_bytes(done.get('bytes', 0))} in {result['seconds']:.1f}s, every file verified "
                f"(sha256 of each LFS shard while downloading)")

    have = f", {fmt_bytes(dl['have_bytes'])} already present and verified" if dl.get("have_bytes") else ""
    return Action("download", f"fetch {fmt_bytes(dl['to_fetch_bytes'])} ({len(dl.get('to_fetch') or [])} of "
                              f"{dl['files']} files) of {where} into {model_path(ctx.entry, ctx.name)}{have}",
                  commands=[cmd], run=run)


# -- 5. GPUs free ----------------------------------------------------------------------------------

def gpu_holders(ctx: Ctx, stopping: set[str]) -> tuple[list[GpuProc], list[GpuProc], list[GpuProc]]:
    """(vLLM leftovers to kill, foreign processes, processes of other running managed models).

    GPU processes count on the model's GPUs only. A process bound to the service port counts as a
    leftover only when a dead managed service left it (same process group / cgroup); any other
    holder of the port may belong to someone else's server on other GPUs, so it is foreign."""
    want = set(ctx.manifest.serving.visible_devices)
    leftovers, foreign, others = [], [], []
    gpu_pids = {p.pid for p in ctx.facts.procs}
    port_holders = [h for h in ctx.facts.ports.get(ctx.manifest.serving.port, []) if h.pid not in gpu_pids]
    for p in ctx.facts.procs + port_holders:
        on_port = p in port_holders
        if not on_port and p.gpu_index is not None and p.gpu_index not in want:
            continue                                   # never touch processes on other GPUs
        if p.owner == ctx.name or (p.owner in stopping and p.owner is not None):
            continue
        if p.owner:
            others.append(p)
        elif p.pid and (p.left_by or (p.vllm_like and not on_port)):
            leftovers.append(p)
        else:
            foreign.append(p)
    return leftovers, foreign, others


def kill_commands(pids: list[int]) -> list[Command]:
    ps = " ".join(str(p) for p in pids)
    return [Script(f"kill -TERM {ps} 2>/dev/null; i=0; while [ $i -lt 100 ]; do "
                   f"alive=0; for p in {ps}; do kill -0 $p 2>/dev/null && alive=1; done; "
                   f"[ $alive = 0 ] && break; sleep 0.1; i=$((i+1)); done; kill -KILL {ps} 2>/dev/null; true")]


def wait_gpus_free(host: Host, entry: HostEntry, indices: list[int], timeout: float, poll: float = 0.5) -> str:
    """Poll nvidia-smi until the GPUs hold no process and their memory is released."""
    deadline = time.monotonic() + timeout
    start = time.monotonic()
    last = ""
    while True:
        r = host.run(gpu.query_gpus_argv(entry.nvidia_smi))
        a = host.run(gpu.query_compute_apps_argv(entry.nvidia_smi))
        gpus = {g.index: g for g in gpu.parse_gpus(r.stdout, gpu.GPU_QUERY_FIELDS)} if r.ok else {}
        uuids = {gpus[i].uuid for i in indices if i in gpus}
        apps = [x for x in gpu.parse_compute_apps(a.stdout, gpu.COMPUTE_APPS_FIELDS) if x.gpu_uuid in uuids] if a.ok else []
        used = {i: gpus[i].memory_used_mib or 0 for i in indices if i in gpus}
        busy = {i: u for i, u in used.items() if u >= IDLE_GPU_MIB}
        if not apps and not busy:
            return f"{gpu_list(indices)} free after {time.monotonic() - start:.1f}s"
        last = (f"{len(apps)} processes, " if apps else "") + ", ".join(f"GPU {i}: {u} MiB" for i, u in busy.items())
        if time.monotonic() > deadline:
            raise DeployFailed(f"GPU memory not released after {timeout:.0f}s ({last})", host=entry.name,
                               step="gpus", hint="find the holders with `fuser -v /dev/nvidia*`")
        time.sleep(poll)


def gpus_action(ctx: Ctx, stopping: set[str] = frozenset()) -> tuple[Action, RefusedError | None]:
    want = ctx.manifest.serving.visible_devices
    leftovers, foreign, others = gpu_holders(ctx, set(stopping))
    if others:
        models = sorted({p.owner for p in others})
        return Action("gpus", f"{', '.join(models)} serves on {gpu_list(want)}",
                      details=[p.describe() for p in others]), RefusedError(
            f"{', '.join(models)} is serving on {gpu_list(want)}: deploy does not stop another model",
            host=ctx.entry.name, step="gpus",
            hint=f"use `vllm-orch swap {ctx.name} --host {ctx.entry.name}` (stages, switches, rolls back)")
    if foreign and not ctx.opts.kill_foreign:
        return Action("gpus", f"{len(foreign)} processes vllm-orch does not manage hold {gpu_list(want)} or "
                              f"port {ctx.manifest.serving.port}", details=[p.describe() for p in foreign]), RefusedError(
            f"{gpu_list(want)} or port {ctx.manifest.serving.port} are used by processes vllm-orch does not "
            f"manage: " + "; ".join(f"PID {p.pid or '?'} {p.name}" for p in foreign), host=ctx.entry.name,
            step="gpus", hint="stop them yourself, choose another serving.port, or pass --kill-foreign to let "
                              "vllm-orch kill them")
    victims = leftovers + (foreign if ctx.opts.kill_foreign else [])
    if not victims:
        reason = "no process holds " + gpu_list(want) if not ctx.facts.procs or all(
            p.gpu_index not in want for p in ctx.facts.procs) else f"only {ctx.name} itself holds {gpu_list(want)}"
        if stopping:
            reason = f"the processes on {gpu_list(want)} belong to {', '.join(sorted(stopping))}, stopped first"
            return Action("gpus", f"check that {gpu_list(want)} are released after the stop",
                          run=lambda c: wait_gpus_free(c.host, c.entry, want, c.opts.gpu_release_timeout_s,
                                                       c.opts.poll_s),
                          details=[reason]), None
        return Action("gpus", f"nothing to do, because {reason}", noop=True), None
    pids = [p.pid for p in victims]

    def run(c: Ctx) -> str:
        for cmd in kill_commands(pids):
            c.host.run(cmd, timeout=60).check(c.entry.name, "kill leftover GPU processes")
        return f"killed {len(pids)} processes; " + wait_gpus_free(c.host, c.entry, want,
                                                                   c.opts.gpu_release_timeout_s, c.opts.poll_s)

    return Action("gpus", f"kill {len(pids)} leftover process{'es' if len(pids) != 1 else ''} on "
                          f"{gpu_list(want)} (SIGTERM, 10 s, SIGKILL), then wait until their memory is released",
                  details=[p.describe() for p in victims], commands=kill_commands(pids), run=run), None


# -- 6. install ------------------------------------------------------------------------------------

def _diff(old: str | None, new: str, path: str) -> list[str]:
    if old is None:
        return [f"new file {path}"]
    return [l.rstrip("\n") for l in difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                         f"{path} (installed)", f"{path} (rendered)", n=1)]


def _mask_env(text: str, secret_keys: list[str]) -> str:
    out = []
    for line in text.splitlines(True):
        key = line.split("=", 1)[0]
        out.append(f"{key}=***\n" if key in secret_keys and "=" in line else line)
    return "".join(out)


def install_action(ctx: Ctx, rendered: Rendered | None = None) -> Action:
    r = rendered or ctx.rendered
    changed, details = [], []
    for f in r.files:
        current = ctx.host.get(f.path)
        if current == f.data():
            continue
        old = None if current is None else current.decode(errors="replace")
        if f is r.env_file and old is not None:
            old = _mask_env(old, r.manifest.serving.secret_env)
        changed.append(f)
        details += _diff(old, f.text, f.path)
    svc = Service.for_host(ctx.host, ctx.entry, r.manifest.name)
    record = {"model": r.manifest.name, "unit": r.unit.path, "env_file": r.env_file.path,
              "manifest_hash": r.manifest_hash, "unit_hash": r.unit_hash, "installed_at": state.now_iso()}
    if not changed:
        return Action("install", f"nothing to do, because {r.unit.path} and {r.env_file.path} are up to date",
                      noop=True, run=lambda c: state.write_installed(c.host, c.entry, r.manifest.name, record))

    def run(c: Ctx) -> str:
        for f in changed:
            c.host.run(["mkdir", "-p", f.path.rsplit("/", 1)[0]]).check(c.entry.name, "create folder")
            c.host.put(f.path, f.data(), f.mode)
        svc.run_all(svc.reload_commands(), "daemon-reload")
        state.write_installed(c.host, c.entry, r.manifest.name, record)
        return f"wrote {len(changed)} file{'s' if len(changed) != 1 else ''}"

    cmds: list[Command] = [Script(f"install -m {f.mode:04o} <rendered> {shlex.quote(f.path)}") for f in changed]
    return Action("install", f"write {', '.join(f.path for f in changed)}", details=details,
                  commands=cmds + svc.reload_commands(), run=run)


# -- 7. start / stop -------------------------------------------------------------------------------

def healthy_now(ctx: Ctx) -> bool:
    from orchestrator.probe import api as probes

    port = ctx.manifest.serving.port
    if probes.health(ctx.host, port, ctx.manifest.probes.health_path, timeout=3) != 200:
        return False
    try:
        return ctx.manifest.served_name in [c.get("id") for c in probes.served_models(ctx.host, port, timeout=3)]
    except Exception:
        return False


def start_action(ctx: Ctx, unit_changed: bool) -> Action:
    svc = ctx.service
    st = ctx.facts.services.get(ctx.name)
    running = bool(st and st.active)
    if running and not unit_changed:
        ctx.started = False
        return Action("start", f"nothing to do, because {ctx.name} is already running (PID {st.main_pid})",
                      noop=True, run=lambda c: _mark_cursor(c))
    cmds = (svc.stop_commands() if running else []) + svc.start_commands() + \
        (svc.enable_commands() if ctx.opts.enable else [])

    def run(c: Ctx) -> str:
        _mark_cursor(c)
        svc.run_all(cmds, "start the service")
        c.started = True
        return f"{'restarted' if running else 'started'} {svc.describe()}"

    verb = "restart (the unit changed)" if running else "start"
    return Action("start", f"{verb} {ctx.name}" + (" and enable it at boot" if ctx.opts.enable else ""),
                  commands=cmds, run=run)


def _mark_cursor(ctx: Ctx) -> str | None:
    ctx.log_cursor = ctx.service.log_cursor()
    return None


def stop_action(ctx: Ctx, model: str, why: str) -> Action:
    svc = Service.for_host(ctx.host, ctx.entry, model)

    def run(c: Ctx) -> str:
        c.results["stopped_at"] = time.monotonic()          # a swap's downtime starts here
        svc.run_all(svc.stop_commands(), f"stop {model}", timeout=600)
        return f"stopped {model}"

    return Action("stop", f"stop {model} ({why})", commands=svc.stop_commands(), run=run)


# -- 8. readiness ----------------------------------------------------------------------------------

def ready_action(ctx: Ctx, already_serving: bool) -> Action:
    m = ctx.manifest
    if already_serving:
        return Action("ready", f"nothing to do, because {m.served_name} answers /health and is listed on "
                               f"port {m.serving.port}", noop=True)
    budget = ctx.opts.budget_s or m.startup.budget_seconds

    def run(c: Ctx) -> str:
        from orchestrator.secret import reveal

        key = (c.results.get("secrets") or {}).get("VLLM_API_KEY")
        c.ready = wait_ready(c.host, c.service, m, c.log_cursor or c.service.log_cursor(),
                             on_event=c.event, budget_s=budget, no_progress_s=c.opts.no_progress_s,
                             poll_s=c.opts.poll_s, api_key=reveal(key) if key else None)
        c.results["ready_at"] = time.monotonic()
        gates = ", ".join(f"{g} {t:.1f}s" for g, t in c.ready.gates)
        return f"{gates}; smoke: {c.ready.smoke.summary()}"

    return Action("ready", f"wait up to {budget:.0f}s: {' -> '.join(GATES)}; fail on a fatal log line, on exit, "
                           f"or after {m.startup.no_progress_seconds}s without a log line", run=run)


# -- 9. record -------------------------------------------------------------------------------------

def active_record(ctx: Ctx) -> dict:
    m, r = ctx.manifest, ctx.rendered
    dl = ctx.download or {}
    return {"model": m.name, "served_name": m.served_name, "port": m.serving.port, "repo": m.source.repo,
            "revision": dl.get("commit") or m.source.revision, "manifest_hash": r.manifest_hash,
            "unit_hash": r.unit_hash, "vllm_version": ctx.facts.vllm_version, "argv": r.argv,
            "gpus": m.serving.visible_devices, "deployed_at": state.now_iso(),
            "host_label": ctx.entry.label}


def record_action(ctx: Ctx, operation: str) -> Action:
    def run(c: Ctx) -> str:
        state.write_active(c.host, c.entry, active_record(c))
        state.touch_usage(c.host, c.entry, c.name, c.facts.usage)
        return f"recorded {c.name} as active in {c.entry.state_dir}/active.json"

    return Action("record", f"record {ctx.name} as the active model, the hashes, timings and smoke result "
                            f"in {ctx.entry.state_dir}", run=run)
