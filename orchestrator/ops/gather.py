"""Gathering, before any planning: everything a planner looks at, read off the host (and the Hub,
through the host) into typed inputs (orchestrator.plan.inputs). The planners then do no I/O.

What is read, in round trips on one connection:
  host facts       one script run (disk, GPUs and who holds them, services, records, folders)
  preflight        the host's own vLLM parser (argcheck.py) and package versions (inspect_env.py)
  installed files  the unit and env file as they are now (for the install step's diff)
  serving          /health and /v1/models when the model's service already runs
  download plan    our verified record, else the Hub's file list (the download script, plan-only)
  warm survey      when warming: the weight files in load order and what is cached (warm script, plan-only)
Reads that a plan cannot reach are skipped: no Hub call when preflight already refuses.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from orchestrator.config import checkpoints
from orchestrator.config.effective import effective
from orchestrator.config.engine import lock_of, python_path, vllm_path
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import COMMIT, Manifest
from orchestrator.config.placement import Placement, Request, ServiceSpec, resolve
from orchestrator.errors import ConfigError, DeployFailed
from orchestrator.host import engine, scripts
from orchestrator.host.base import Host
from orchestrator.host.download import plan_download
from orchestrator.host.engine import EngineState
from orchestrator.host.facts import HostFacts, gather
from orchestrator.host.state import history_tail, lock_holder, lock_path
from orchestrator.host.warm import plan_warm
from orchestrator.plan import prepare
from orchestrator.plan.deploy import placement_refusal
from orchestrator.plan.engine import ENGINE_CHECKS
from orchestrator.plan.inputs import DownloadPlan, LockFacts, PlanInput, RegenInput, ServiceInput, WarmFacts
from orchestrator.plan.preflight import FAIL, SKIPPED, Check, HostAnswer, PreflightFacts, evaluate, needs_for
from orchestrator.plan.run import Options
from orchestrator.plan.service import placement_holders
from orchestrator.plan.swap import already_done, old_model_name
from orchestrator.plan.warm import measured_from
from orchestrator.probe import api, keyed
from orchestrator.render.artifacts import (
    default_folder,
    env_path,
    is_ray_worker,
    read_env_values,
    render,
    secrets_from_environ,
)
from orchestrator.secret import Secret

VERSION_CHECKS = {"vllm-version", "version-traps", "package-pairs", "torch-cuda", "required-packages"}


def lock_facts(host: Host, entry: HostEntry, held: bool) -> LockFacts:
    return LockFacts(held=held, holder=None if held else lock_holder(host, entry), path=lock_path(entry))


def hf_token() -> Secret | None:
    """The Hub token for downloads: $HF_TOKEN, else the file named by $HF_TOKEN_FILE."""
    if os.environ.get("HF_TOKEN"):
        return Secret(os.environ["HF_TOKEN"])
    path = os.environ.get("HF_TOKEN_FILE")
    if path and Path(path).expanduser().is_file():
        return Secret(Path(path).expanduser().read_text().strip())
    return None


def serving_now(host: Host, entry: HostEntry, m: Manifest, api_key: Secret | None = None) -> bool:
    """/health answers 200 (asked without the key) and /v1/models lists the served name, right now;
    asked with the key only once the port's listener is proven the service's (probe/keyed.py): a
    unit `activating` (vLLM loading, its socket bound but not listening) leaves the loopback address
    to whoever listens there, and a port held by anyone else is not serving."""
    open_ep = api.Endpoint(host, m.serving.port)
    if api.health(open_ep, m.probes.health_path, timeout=3) != 200:
        return False
    try:
        return m.served_name in api.served_models(keyed.endpoint(host, entry, m.name, m.serving.port, api_key),
                                                  timeout=3)
    except api.HttpError:           # keyed.ForeignListener too: the key was not sent
        return False


def gpu_names(facts: HostFacts | None) -> dict[int, str] | None:
    """nvidia-smi's GPU names by index (what picks a manifest's hardware class); None when unread."""
    if facts is None or facts.gpu_error or not facts.gpus:
        return None
    return {g.index: g.name for g in facts.gpus if g.index is not None}


def service_ports(m: Manifest, entry: HostEntry, request: Request = Request(),
                  nodes: Sequence[HostEntry] = ()) -> list[int]:
    """The ports the service listens on on this host before its records are read (whose listeners
    the facts report): its API port (the command line's, else the inventory's override, else the
    manifest's: a hardware class cannot move it) and, as a node of a multi-node service (`nodes`,
    head first), the other ports it listens on there (the port its nodes meet at, on the head; Ray's
    ports on every node) as derived from the placement. The facts read the ports of
    installed services too, so a recorded placement's ports are covered."""
    ports = [request.port or effective(m, entry).manifest.serving.port]
    if m.multinode is not None and len(nodes) == m.multinode.nodes and entry.name in {n.name for n in nodes}:
        ports += sorted(resolve(m, list(nodes), request).placement(entry.name).ports)
    return sorted(set(ports))


def service_spec(m: Manifest, entries: list[HostEntry], request: Request, facts: Mapping[str, HostFacts],
                 replaced: Mapping[str, Placement] | None = None, name: str | None = None) -> ServiceSpec:
    """The service value (config/placement.resolve), from the command line, the inventory, the
    manifest and each node's installed record of the service (where an earlier run placed it;
    `facts` of the nodes read, by host)."""
    service = request.name or name or m.name
    spec = resolve(m, entries, request, {e.name: facts[e.name].recorded_placement(service)
                                         for e in entries if e.name in facts}, replaced, name=service)
    head = facts.get(entries[0].name) if entries else None
    return replace(spec, folder=weights_folder(m, spec.model, service, head))


def weights_folder(m: Manifest, model: str, service: str, facts: HostFacts | None) -> str:
    """The service's weights folder on its (head) host, decided once per operation: the one its
    installed record names when that folder holds this commit, else its checkpoint's shared folder,
    else one of vllm-orch's that already holds the commit (config/checkpoints.folder_for)."""
    if facts is None:
        return default_folder(m, model)
    src = m.source
    return checkpoints.folder_for(src.repo, src.revision, src.pinned, model, facts.installed_folder(service),
                                  facts.folder_records())


class Reads(Protocol):
    """What gathering reads off a host besides its facts: installed files, and whether a service
    answers right now. HostReads asks the host; the case matrix (tests/unit/test_plan_cases.py)
    answers from its case file."""

    def get(self, path: str) -> bytes | None: ...

    def serving(self, m: Manifest, api_key: Secret | None) -> bool: ...


@dataclass(frozen=True)
class HostReads:
    host: Host
    entry: HostEntry

    def get(self, path: str) -> bytes | None:
        return self.host.get(path)

    def serving(self, m: Manifest, api_key: Secret | None) -> bool:
        return serving_now(self.host, self.entry, m, api_key)


def service_input(reads: Reads, entry: HostEntry, m: Manifest, facts: HostFacts, spec: ServiceSpec,
                  keep_installed_secrets: bool = False) -> ServiceInput:
    """The model M as the service `spec` on this host (its GPUs' hardware class and the host's
    settings applied; as this node of a multi-node service), rendered, what is installed now, and
    whether it already serves (a worker node serves no HTTP: never asked). keep_installed_secrets
    (regen, a swap's rollback target): a secret vllm-orch is not given keeps the value of the
    installed env file instead of refusing (exit 2) or dropping it."""
    eff = effective(m, entry, gpu_names(facts), spec=spec)
    em = eff.manifest
    role = spec.role(entry.name)
    installed_env = reads.get(env_path(em, entry)) if keep_installed_secrets and em.serving.secret_env else None
    kept = read_env_values(installed_env.decode(errors="replace")) if installed_env else None
    secrets = secrets_from_environ(em, installed=kept)
    rendered = render(em, entry, secrets, role=role, model=spec.model, folder=spec.folder or None)
    installed = {f.path: reads.get(f.path) for f in rendered.files}
    st = facts.services.get(em.name)
    serving = bool(st and st.active) and (role is None or role.head) and \
        reads.serving(em, secrets.get("VLLM_API_KEY"))
    return ServiceInput(manifest=em, rendered=rendered, secrets=secrets, installed_files=installed, serving=serving,
                        effective=eff, spec=spec)


def download_plan(host: Host, entry: HostEntry, m: Manifest, folder_name: str, facts: HostFacts,
                  token: Secret | None, commit: str | None = None) -> DownloadPlan:
    """What the download of M into models_root/FOLDER_NAME fetches: from the folder's verified record
    when it covers this commit and these patterns (no Hub call), else from the Hub's listing.
    `commit`: the commit a branch resolved to already (planned exactly that)."""
    src = m.source
    revision, pinned = (commit, True) if commit else (src.revision, src.pinned)
    folder = facts.models.get(folder_name)
    record = folder.verified if folder else None
    known = prepare.download_from_record(_as_commit(record) if commit else record, src.repo, revision, pinned,
                                         src.allow_patterns, src.ignore_patterns)
    if known is not None:
        return known
    event = plan_download(host, entry.python, src.repo, revision, prepare.model_path(entry, folder_name),
                          src.allow_patterns, src.ignore_patterns, state_dir=entry.state_dir, token=token)
    return DownloadPlan.from_event(event)


def preflight_facts(host: Host, python: str, argv: list[str], env: dict[str, str], facts: HostFacts | None,
                    skip: set[str], timeout: float = 180.0, kept: dict | None = None,
                    user: str | None = None) -> PreflightFacts:
    """Ask the host's Python for its package versions and its vLLM parser's verdict on the argv
    (each only when a check needs it; `kept`: the parser's answer the engine venv kept for this very
    argv, env and venv, used instead of asking again), as the service `user` (each imports the venv's
    packages: their code, and their .pth files, never run as root); GPUs come from the host facts."""
    packages = None
    if VERSION_CHECKS - skip:
        packages = HostAnswer.of(*scripts.run_json(host, python, "inspect_env.py", timeout=60, user=user))
    argcheck = None
    if {"flags", "env"} - skip:
        argcheck = HostAnswer(kept, reused=True) if kept is not None else \
            HostAnswer.of(*scripts.run_json(host, python, "argcheck.py", [json.dumps({"argv": argv, "env": env})],
                                            timeout=timeout, user=user))
    if facts is None:
        return PreflightFacts(python=python, packages=packages, argcheck=argcheck, gpus=None,
                              gpu_error="no host facts")
    return PreflightFacts(python=python, packages=packages, argcheck=argcheck,
                          gpus=facts.gpus if not facts.gpu_error else None, gpu_error=facts.gpu_error,
                          driver_version=facts.driver_version, driver_cuda=facts.cuda_version,
                          service_reach=facts.service_reach, root_trust=facts.root_trust)


def argcheck_request(svc: ServiceInput) -> dict:
    """What vLLM's parser is asked about the service (its argv and plain env), as an engine venv
    keeps its answer (host/engine.argcheck_request)."""
    m, r = svc.manifest, svc.rendered
    needs = needs_for(m, r.argv, r.provenance, effective=svc.effective)
    return engine.argcheck_request(r.argv, needs.env)


def engine_state(host: Host, entry: HostEntry, svc: ServiceInput, opts: Options) -> EngineState | None:
    """The service's engine venv as the host has it (None: a manifest without `engine:`): its
    recorded verdict when the venv is unchanged since, else (or with --verify-engine) the full check;
    and the parser's answer the venv kept for the service's argv (never with --verify-engine)."""
    m = svc.manifest
    if m.engine is None:
        return None
    return engine.check(host, entry, lock_of(m.engine), force=opts.verify_engine, argcheck=argcheck_request(svc))


def preflight(host: Host, entry: HostEntry, svc: ServiceInput, facts: HostFacts, opts: Options,
              stopping: Collection[str] = (), engine_now: EngineState | None = None) -> list[Check]:
    """The preflight checks, asking the service's vLLM venv (its engine venv when the manifest names
    one); a missing engine venv defers the checks that need it to the engine step (plan/engine.py)."""
    m, r = svc.manifest, svc.rendered
    needs = needs_for(m, r.argv, r.provenance, manifest_label=f"models/{svc.model}.yaml", effective=svc.effective,
                      dev_guard_on=entry.dev_guard)
    skip = set(opts.skip_checks) | set(entry.skip_checks)
    # A Ray worker node's unit runs `ray start`, not `vllm serve`: vLLM's parser has nothing to check there
    # (the head's argv carries the service's flags, and is checked on the head).
    ray_worker = {"flags", "env"} if is_ray_worker(m, r.role) else set()
    later = set(ENGINE_CHECKS) if m.engine is not None and (engine_now is None or not engine_now.ok) else set()
    ok_engine = engine_now if m.engine is not None and engine_now is not None and engine_now.ok else None
    pf = preflight_facts(host, python_path(m, entry), list(r.argv), dict(needs.env), facts,
                         skip | ray_worker | later, kept=ok_engine.argcheck if ok_engine else None,
                         user=entry.service_user)
    if ok_engine is not None and pf.argcheck is not None and not pf.argcheck.reused and pf.argcheck.value:
        # the parser answered in a venv that verified: keep a passing answer for the next deploy, swap or check
        engine.remember_argcheck(host, entry, ok_engine.lock, engine.argcheck_request(r.argv, needs.env),
                                 pf.argcheck.value)
    checks = evaluate(pf, needs, placement_holders(facts, m, stopping), kill_foreign=opts.kill_foreign,
                      skip=skip | ray_worker | later)
    for c in checks:    # skipped by the inventory, not by the command line: say so
        if c.status == SKIPPED and c.name in entry.skip_checks and c.name not in opts.skip_checks:
            c.summary = "skipped (host setting)"
        elif c.status == SKIPPED and c.name in ray_worker and c.name not in skip:
            c.summary = "skipped (a Ray worker node runs `ray start`; the head's vLLM command line is checked on the head)"
        elif c.status == SKIPPED and c.name in later and c.name not in skip:
            c.summary = "later: the engine step asks the venv it builds, before anything stops"
    return checks


def _refused(checks: list[Check]) -> bool:
    return any(c.status == FAIL for c in checks)


def host_facts(host: Host, entry: HostEntry, m: Manifest, request: Request, names: Collection[str] = (),
               nodes: Sequence[HostEntry] = ()) -> HostFacts:
    """The host's facts for an operation on the service the request names (and `names`), as a node
    of `nodes` (a multi-node service's hosts, head first). Whether the service user can run vLLM, and
    who could change what root runs, are judged on the vllm the service runs: its engine venv's when
    the manifest has `engine:`."""
    runs = entry.model_copy(update={"vllm": vllm_path(m, entry)}) if m.engine is not None else entry
    return gather(host, runs, sorted({request.name or m.name, *names}), ports=service_ports(m, entry, request, nodes))


def for_check(host: Host, entry: HostEntry, m: Manifest, spec: ServiceSpec, opts: Options, lock: LockFacts,
              facts: HostFacts) -> PlanInput:
    """What preflight needs, and no more (`vllm-orch check`, and the start of a deploy), for this
    host as a node of the service `spec` (its own argv is what the parser checks)."""
    target = service_input(HostReads(host, entry), entry, m, facts, spec)
    state = engine_state(host, entry, target, opts)
    checks = preflight(host, entry, target, facts, opts, engine_now=state)
    return PlanInput(entry=entry, facts=facts, opts=opts, lock=lock, target=target, preflight=checks,
                     hf_token=hf_token(), engine=state)


def for_deploy(host: Host, entry: HostEntry, m: Manifest, spec: ServiceSpec, opts: Options, lock: LockFacts,
               facts: HostFacts) -> PlanInput:
    inp = for_check(host, entry, m, spec, opts, lock, facts)
    if _refused(inp.preflight) or placement_refusal(inp):
        return inp
    return _with_download(host, inp)


def warm_facts(host: Host, entry: HostEntry, model: str) -> WarmFacts:
    """The model's weight files in vLLM's load order and how much of each is cached (no reads)."""
    model_dir = prepare.model_path(entry, model)
    try:
        event = plan_warm(host, entry.python, model_dir, entry.meminfo)
    except DeployFailed as err:
        return WarmFacts(model_dir, error=err.message)
    return WarmFacts.from_event(model_dir, event)


def _as_commit(record: dict | None) -> dict | None:
    """A branch's folder record as the record of the commit it was downloaded at (its `commit`)."""
    if not isinstance(record, dict) or not record.get("commit"):
        return record
    return {**record, "revision": record["commit"]}


def _with_download(host: Host, inp: PlanInput) -> PlanInput:
    """The download plan, and when the run warms the page cache, the weight files' state. A branch
    resolves to its commit here: the service moves to a folder that holds that commit already, or
    off a folder another service uses that the download would change (config/checkpoints.move_for)."""
    t, f = inp.target, inp.facts
    dl = download_plan(host, inp.entry, t.manifest, t.folder, f, inp.hf_token)
    src = t.manifest.source
    if dl.commit and COMMIT.match(dl.commit) and (t.spec is None or len(t.spec.nodes) == 1):
        others = {f.folder_of(n) for n in f.records if n != t.name}
        moved = checkpoints.move_for(src.repo, dl.commit, src.pinned, t.folder, bool(dl.to_fetch_bytes or dl.to_fetch),
                                     others, f.folder_records())
        if moved is not None:
            t = refolder(t, moved)
            dl = download_plan(host, inp.entry, t.manifest, moved, f, inp.hf_token, commit=dl.commit)
            inp = replace(inp, target=t)
    inp = replace(inp, download=dl)
    if inp.opts.warm:
        inp = replace(inp, warm=warm_facts(host, inp.entry, t.folder))
    load = (inp.warm.weights_bytes or inp.warm.total_bytes) if inp.warm is not None and inp.warm.files else \
        (inp.download.total_bytes if inp.download else 0)
    return replace(inp, measured=measured_from(history_tail(host, inp.entry), t.name, load))


def refolder(t: ServiceInput, folder: str) -> ServiceInput:
    """The service rendered again with its weights in `folder` (only --model and the working
    folder change; the installed files it is compared with are the same paths)."""
    r = t.rendered
    rendered = render(t.manifest, r.host, t.secrets, role=r.role, model=r.model or None, folder=folder)
    return replace(t, rendered=rendered, spec=replace(t.spec, folder=folder) if t.spec is not None else None)


def swap_spec(facts: Mapping[str, HostFacts], entries: list[HostEntry], m: Manifest, request: Request,
              opts: Options) -> ServiceSpec:
    """Pure: the new service of a swap over its nodes (head first); with --replace it takes the
    replaced service's GPUs (when it needs as many) and port on each node that service runs on,
    unless it sleeps there: a wake keeps the process, so the port and GPUs it sleeps on."""
    name, head = request.name or m.name, entries[0]
    old_name = old_model_name(facts[head.name], name, head.name, opts.replace)
    took = {}
    if opts.replace and old_name and old_name != name and facts[head.name].asleep(name) is None:
        took = {e.name: p for e in entries if e.name in facts and (p := facts[e.name].placement(old_name, e.name))}
    return service_spec(m, entries, request, facts, took or None)


def swap_services(facts: HostFacts, entry: HostEntry, m: Manifest, request: Request,
                  manifests: Mapping[str, Manifest], opts: Options,
                  spec: ServiceSpec | None = None) -> tuple[ServiceSpec, tuple[Manifest, ServiceSpec] | None]:
    """Pure: the new service of a swap to M on this host (taking the replaced service's GPUs and
    port with --replace) and the service it replaces (its model's manifest, and the service as it
    is installed), None when it replaces none. `spec`: the new service resolved over all its nodes
    already (a swap across nodes)."""
    name = request.name or m.name
    old_name = old_model_name(facts, name, entry.name, opts.replace)
    spec = spec or swap_spec({entry.name: facts}, [entry], m, request, opts)
    if not old_name or old_name == name:
        return spec, None
    old_m = service_manifest(old_name, facts, manifests)
    if old_m is None:
        raise ConfigError(f"the active model {old_name!r} has no manifest in the models folder, so it "
                          f"could not be rolled back to", host=entry.name,
                          hint=f"restore models/{old_name}.yaml, or `vllm-orch stop {old_name}` first")
    return spec, (old_m, recorded_spec(old_m, entry, old_name, facts))


def for_swap(host: Host, entry: HostEntry, m: Manifest, request: Request, manifests: dict[str, Manifest],
             opts: Options, lock: LockFacts, spec: ServiceSpec | None = None,
             facts: HostFacts | None = None) -> PlanInput:
    """A swap to M (the service `request` names) on this host. `spec` and `facts`: given by a swap
    across nodes, which resolved the new service over all its nodes (this host one of them)."""
    facts = facts or host_facts(host, entry, m, request, manifests)
    spec, replaced = swap_services(facts, entry, m, request, manifests, opts, spec)
    reads = HostReads(host, entry)
    old = service_input(reads, entry, replaced[0], facts, replaced[1], True) if replaced is not None else None
    target = service_input(reads, entry, m, facts, spec)
    inp = PlanInput(entry=entry, facts=facts, opts=opts, lock=lock, target=target, old=old, hf_token=hf_token())
    if old is None and already_done(inp):
        return inp                               # serving these very files: nothing to do (the planner says so)
    asleep = facts.asleep(target.name)
    if asleep is not None and asleep.level == 1 and not opts.warm:
        # a wake at level 1 (the on-demand wake's path): the process runs with its weights in host RAM,
        # so nothing is downloaded, read or started, and preflight's checks are of a start: skipped
        # (0.7 s of download plan and 0.2 s of preflight of a 3.4 s wake on the SIMULATED host)
        return inp
    state = engine_state(host, entry, target, opts)
    checks = preflight(host, entry, target, facts, opts, stopping={old.name} if old else set(), engine_now=state)
    inp = replace(inp, preflight=checks, engine=state)
    return inp if _refused(checks) else _with_download(host, inp)


def recorded_spec(m: Manifest, entry: HostEntry, name: str, facts: HostFacts) -> ServiceSpec:
    """The service NAME of model M on this host as it is installed: where it was placed, and a node
    of a multi-node service as the node its installed record names (its role)."""
    installed = facts.installed.get(name)
    role = installed.role() if installed is not None else None
    spec = resolve(m, [entry], Request(), {entry.name: facts.recorded_placement(name)}, name=name,
                   roles=(role,) if role is not None else None)
    # its weights folder as installed: a regen never moves a service to another folder
    folder = facts.installed_folder(name) or weights_folder(m, spec.model, name, facts)
    return replace(spec, folder=folder)


def regen_services(facts: HostFacts, entry: HostEntry,
                   manifests: Mapping[str, Manifest]) -> tuple[list[tuple[Manifest, ServiceSpec]], list[str]]:
    """Pure: every installed service with a manifest, each where it is installed (its placement
    kept; a node of a multi-node service as the node its installed record names), and the
    installed services without a manifest now."""
    found = {n: service_manifest(n, facts, manifests) for n in sorted(facts.installed)}
    return ([(m, recorded_spec(m, entry, n, facts)) for n, m in found.items() if m is not None],
            [n for n, m in found.items() if m is None])


def for_regen(host: Host, entry: HostEntry, manifests: dict[str, Manifest], opts: Options, lock: LockFacts,
              restart: bool) -> RegenInput:
    facts = gather(host, entry)
    found, orphaned = regen_services(facts, entry, manifests)
    reads = HostReads(host, entry)
    services = [service_input(reads, entry, m, facts, spec, True) for m, spec in found]
    engines = {s.name: state for s in services if (state := engine_state(host, entry, s, opts)) is not None}
    return RegenInput(entry=entry, facts=facts, opts=opts, lock=lock, services=services, orphaned=orphaned,
                      restart=restart, engines=engines)


def service_manifest(name: str, facts: HostFacts, manifests: Mapping[str, Manifest]) -> Manifest | None:
    """The manifest of the model the service NAME runs on this host, as its records name it (a
    service deployed with --name runs a model under another name)."""
    model = facts.model_of(name)
    return manifests.get(model) or manifests.get(name)
