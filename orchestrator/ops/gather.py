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
from collections.abc import Collection, Mapping
from dataclasses import replace
from pathlib import Path

from orchestrator.config.effective import effective
from orchestrator.config.inventory import HostEntry, ServingOverride
from orchestrator.config.manifest import Manifest
from orchestrator.config.placement import NodeRole
from orchestrator.errors import ConfigError, DeployFailed
from orchestrator.host import scripts
from orchestrator.host.base import Host, Result
from orchestrator.host.download import plan_download
from orchestrator.host.facts import HostFacts, gather
from orchestrator.host.state import lock_holder
from orchestrator.host.warm import plan_warm
from orchestrator.plan import prepare
from orchestrator.plan.deploy import placement_refusal
from orchestrator.plan.inputs import DownloadPlan, LockFacts, PlanInput, RegenInput, ServiceInput, WarmFacts
from orchestrator.plan.preflight import FAIL, SKIPPED, Check, HostAnswer, PreflightFacts, evaluate, needs_for
from orchestrator.plan.run import Options
from orchestrator.plan.service import placement_holders, recorded_role
from orchestrator.plan.swap import old_model_name
from orchestrator.probe import api
from orchestrator.render.artifacts import env_path, is_ray_worker, read_env_values, render, secrets_from_environ
from orchestrator.secret import Secret

VERSION_CHECKS = {"vllm-version", "version-traps", "package-pairs", "torch-cuda", "required-packages"}


def lock_facts(host: Host, entry: HostEntry, held: bool) -> LockFacts:
    path = f"{entry.state_dir}/deploy.lock"
    return LockFacts(held=held, holder=None if held else lock_holder(host, entry), path=path)


def hf_token() -> Secret | None:
    """The Hub token for downloads: $HF_TOKEN, else the file named by $HF_TOKEN_FILE."""
    if os.environ.get("HF_TOKEN"):
        return Secret(os.environ["HF_TOKEN"])
    path = os.environ.get("HF_TOKEN_FILE")
    if path and Path(path).expanduser().is_file():
        return Secret(Path(path).expanduser().read_text().strip())
    return None


def serving_now(host: Host, m: Manifest, api_key: Secret | None = None) -> bool:
    """/health answers 200 and /v1/models lists the served name (asked with the key), right now."""
    ep = api.Endpoint(host, m.serving.port, api_key)
    if api.health(ep, m.probes.health_path, timeout=3) != 200:
        return False
    try:
        return m.served_name in api.served_models(ep, timeout=3)
    except api.HttpError:
        return False


def gpu_names(facts: HostFacts | None) -> dict[int, str] | None:
    """nvidia-smi's GPU names by index (what picks a manifest's hardware class); None when unread."""
    if facts is None or facts.gpu_error or not facts.gpus:
        return None
    return {g.index: g.name for g in facts.gpus if g.index is not None}


def service_port(m: Manifest, entry: HostEntry) -> int:
    """The model's port on this host (a host override may move it; a hardware class cannot)."""
    return effective(m, entry).manifest.serving.port


def service_input(host: Host, entry: HostEntry, m: Manifest, facts: HostFacts,
                  role: NodeRole | None = None, keep_installed_secrets: bool = False) -> ServiceInput:
    """The manifest as it runs on this host (its GPUs' hardware class and the host's settings
    applied), rendered (as this node of a multi-node service: `role`), what is installed now, and
    whether it already serves (a worker node serves no HTTP: never asked). keep_installed_secrets
    (regen, a swap's rollback target): a secret vllm-orch is not given keeps the value of the
    installed env file instead of refusing (exit 2) or dropping it."""
    eff = effective(m, entry, gpu_names(facts))
    m = eff.manifest
    installed_env = host.get(env_path(m, entry)) if keep_installed_secrets and m.serving.secret_env else None
    kept = read_env_values(installed_env.decode(errors="replace")) if installed_env else None
    secrets = secrets_from_environ(m, installed=kept)
    rendered = render(m, entry, secrets, role=role)
    installed = {f.path: host.get(f.path) for f in rendered.files}
    st = facts.services.get(m.name)
    serving = bool(st and st.active) and (role is None or role.head) and \
        serving_now(host, m, secrets.get("VLLM_API_KEY"))
    return ServiceInput(manifest=m, rendered=rendered, secrets=secrets, installed_files=installed, serving=serving,
                        effective=eff)


def with_recorded_placement(entry: HostEntry, name: str, facts: HostFacts) -> HostEntry:
    """A service placed on the command line (deploy --gpus/--port) stays there: its installed
    record keeps what the command line chose, and a later deploy, swap or regen without those
    options re-applies it (a command line that gives them wins)."""
    placed = (facts.installed.get(name) or {}).get("placed")
    if entry.command_line_for(name) is not None or not isinstance(placed, dict):
        return entry
    try:
        return entry.with_command_line(name, ServingOverride.model_validate(placed))
    except ValueError:
        return entry                    # a hand-edited record: the inventory and manifest decide


def download_plan(host: Host, entry: HostEntry, m: Manifest, facts: HostFacts,
                  token: Secret | None) -> DownloadPlan:
    src = m.source
    folder = facts.models.get(m.model_name)
    known = prepare.download_from_record(folder.verified if folder else None, src.repo, src.revision, src.pinned)
    if known is not None:
        return known
    event = plan_download(host, entry.python, src.repo, src.revision, prepare.model_path(entry, m.model_name),
                          src.allow_patterns, src.ignore_patterns, state_dir=entry.state_dir, token=token)
    return DownloadPlan.from_event(event)


def _answer(value: dict | None, result: Result) -> HostAnswer:
    tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
    return HostAnswer(value=value, exit_code=result.exit_code, tail=tail, seconds=round(result.duration, 3))


def preflight_facts(host: Host, python: str, argv: list[str], env: dict[str, str], facts: HostFacts | None,
                    skip: set[str], timeout: float = 180.0) -> PreflightFacts:
    """Ask the host's Python for its package versions and its vLLM parser's verdict on the argv
    (each only when a check needs it); GPUs come from the host facts already read."""
    packages = None
    if VERSION_CHECKS - skip:
        packages = _answer(*scripts.run_json(host, python, "inspect_env.py", timeout=60))
    argcheck = None
    if {"flags", "env"} - skip:
        argcheck = _answer(*scripts.run_json(host, python, "argcheck.py", [json.dumps({"argv": argv, "env": env})],
                                             timeout=timeout))
    if facts is None:
        return PreflightFacts(python=python, packages=packages, argcheck=argcheck, gpus=None,
                              gpu_error="no host facts")
    return PreflightFacts(python=python, packages=packages, argcheck=argcheck,
                          gpus=facts.gpus if not facts.gpu_error else None, gpu_error=facts.gpu_error,
                          driver_version=facts.driver_version, driver_cuda=facts.cuda_version,
                          service_reach=facts.service_reach, root_trust=facts.root_trust)


def preflight(host: Host, entry: HostEntry, svc: ServiceInput, facts: HostFacts, opts: Options,
              stopping: Collection[str] = ()) -> list[Check]:
    m, r = svc.manifest, svc.rendered
    needs = needs_for(m, r.argv, r.provenance, manifest_label=f"models/{m.model_name}.yaml", effective=svc.effective)
    skip = set(opts.skip_checks) | set(entry.skip_checks)
    # A Ray worker node's unit runs `ray start`, not `vllm serve`: vLLM's parser has nothing to check there
    # (the head's argv carries the service's flags, and is checked on the head).
    ray_worker = {"flags", "env"} if is_ray_worker(m, r.role) else set()
    pf = preflight_facts(host, entry.python, list(r.argv), dict(needs.env), facts, skip | ray_worker)
    checks = evaluate(pf, needs, placement_holders(facts, m, stopping), kill_foreign=opts.kill_foreign,
                      skip=skip | ray_worker)
    for c in checks:    # skipped by the inventory, not by the command line: say so
        if c.status == SKIPPED and c.name in entry.skip_checks and c.name not in opts.skip_checks:
            c.summary = "skipped (host setting)"
        elif c.status == SKIPPED and c.name in ray_worker and c.name not in skip:
            c.summary = "skipped (a Ray worker node runs `ray start`; the head's vLLM command line is checked on the head)"
    return checks


def _refused(checks: list[Check]) -> bool:
    return any(c.status == FAIL for c in checks)


def for_check(host: Host, entry: HostEntry, m: Manifest, opts: Options, lock: LockFacts,
              role: NodeRole | None = None) -> PlanInput:
    """What preflight needs, and no more (`vllm-orch check`, and the start of a deploy); `role`:
    this host as a node of a multi-node service (its own argv is what the parser checks)."""
    facts = gather(host, entry, [m.name], ports=[service_port(m, entry)])
    target = service_input(host, entry, m, facts, role)
    checks = preflight(host, entry, target, facts, opts)
    return PlanInput(entry=entry, facts=facts, opts=opts, lock=lock, target=target, preflight=checks,
                     hf_token=hf_token())


def for_deploy(host: Host, entry: HostEntry, m: Manifest, opts: Options, lock: LockFacts,
               role: NodeRole | None = None) -> PlanInput:
    inp = for_check(host, entry, m, opts, lock, role)
    if _refused(inp.preflight) or placement_refusal(inp):
        return inp
    return _with_download(host, inp)


def warm_facts(host: Host, entry: HostEntry, m: Manifest) -> WarmFacts:
    """The model's weight files in vLLM's load order and how much of each is cached (no reads)."""
    model_dir = prepare.model_path(entry, m.model_name)
    try:
        event = plan_warm(host, entry.python, model_dir, entry.meminfo)
    except DeployFailed as err:
        return WarmFacts(model_dir, error=err.message)
    return WarmFacts.from_event(model_dir, event)


def _with_download(host: Host, inp: PlanInput) -> PlanInput:
    """The download plan, and when the run warms the page cache, the weight files' state."""
    inp = replace(inp, download=download_plan(host, inp.entry, inp.target.manifest, inp.facts, inp.hf_token))
    if inp.opts.warm:
        inp = replace(inp, warm=warm_facts(host, inp.entry, inp.target.manifest))
    return inp


def for_swap(host: Host, entry: HostEntry, m: Manifest, manifests: dict[str, Manifest], opts: Options,
             lock: LockFacts, role: NodeRole | None = None) -> PlanInput:
    """`role`: this host as a node of the new (multi-node) service."""
    facts = gather(host, entry, sorted({m.name, *manifests}), ports=[service_port(m, entry)])
    old_name = old_model_name(facts, m.name, entry.name, opts.replace)
    if opts.replace and old_name and old_name != m.name:
        entry = takes_place_of(entry, m, facts.record(old_name) or facts.installed.get(old_name) or {})
        if service_port(m, entry) not in facts.ports:
            facts = gather(host, entry, sorted({m.name, *manifests}), ports=[service_port(m, entry)])
    old = None
    if old_name and old_name != m.name:
        old_m = service_manifest(old_name, facts, manifests)
        if old_m is None:
            raise ConfigError(f"the active model {old_name!r} has no manifest in the models folder, so it "
                              f"could not be rolled back to", host=entry.name,
                              hint=f"restore models/{old_name}.yaml, or `vllm-orch stop {old_name}` first")
        old = service_input(host, entry, old_m, facts, keep_installed_secrets=True)
    target = service_input(host, entry, m, facts, role)
    inp = PlanInput(entry=entry, facts=facts, opts=opts, lock=lock, target=target, old=old, hf_token=hf_token())
    if old is None and old_name == m.name and target.serving:
        return inp                               # the planner decides whether there is nothing to do
    checks = preflight(host, entry, target, facts, opts, stopping={old.name} if old else set())
    inp = replace(inp, preflight=checks)
    return inp if _refused(checks) else _with_download(host, inp)


def takes_place_of(entry: HostEntry, m: Manifest, old: Mapping) -> HostEntry:
    """`swap NEW --replace OLD`: NEW takes OLD's GPUs (when it needs as many) and port, unless the
    command line placed it (--gpus / --port win)."""
    given = entry.command_line_for(m.name)
    gpus = [int(i) for i in old.get("gpus") or []]
    port = old.get("port")
    serving = ServingOverride(
        gpu_ids=given.gpu_ids if given and given.gpu_ids is not None else
        (gpus if len(gpus) == m.serving.gpus else None),
        port=given.port if given and given.port is not None else (int(port) if port else None))
    return entry.with_command_line(m.name, serving)


def for_regen(host: Host, entry: HostEntry, manifests: dict[str, Manifest], opts: Options, lock: LockFacts,
              restart: bool) -> RegenInput:
    facts = gather(host, entry)
    installed = sorted(facts.installed)
    found = {n: service_manifest(n, facts, manifests) for n in installed}
    # a node of a multi-node service is re-rendered as that node (its installed record names its role)
    services = [service_input(host, entry, m, facts, recorded_role(facts.installed.get(m.name)), True)
                for m in found.values() if m is not None]
    return RegenInput(entry=entry, facts=facts, opts=opts, lock=lock, services=services,
                      orphaned=[n for n, m in found.items() if m is None], restart=restart)


def service_manifest(name: str, facts: HostFacts, manifests: Mapping[str, Manifest]) -> Manifest | None:
    """The manifest of the service NAME on this host: its model's (as its records name it: a
    service deployed with --name runs a model under another name), as that service."""
    model = facts.model_of(name)
    m = manifests.get(model) or manifests.get(name)
    return m.as_service(name) if m is not None else None
