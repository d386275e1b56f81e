"""The plan step `engine` (a manifest with `engine:`): the service's venv, one per distinct lock
under the host's engines_root. Nothing to do when it exists and verifies (its marker's lock hash,
the pinned versions, the imports, `vllm --version`; or the verdict such a check recorded on the host,
when the venv's files are unchanged since: host/remote/engine.py); else it is built with uv (from the host's
registries, or offline from the wheelhouse the controller uploads) while the old service keeps
serving, like the download: deploy and swap place it before anything stops.

A venv that was missing when preflight ran could not answer preflight's parser and package checks:
they were deferred to this step, which asks the new venv (its vLLM's own parser on the rendered
argv, its package versions) right after building it and fails before anything stops when they do.
"""

from __future__ import annotations

import json
import time

from orchestrator.config.engine import allowed_wheel_url, hashes_required, lock_of, python_path
from orchestrator.errors import DeployFailed
from orchestrator.fmt import fmt_bytes, fmt_duration
from orchestrator.host import scripts
from orchestrator.host.engine import SCRIPT, EngineState, argcheck_request, build, build_args, remember_argcheck
from orchestrator.plan.inputs import PlanInput
from orchestrator.plan.model import Action
from orchestrator.plan.preflight import FAIL, HostAnswer, PreflightFacts, evaluate, needs_for
from orchestrator.plan.run import RunEnv

# The preflight checks that ask the service's vLLM venv: deferred to the engine step when it is built.
ENGINE_CHECKS = frozenset({"flags", "env", "vllm-version", "version-traps", "package-pairs", "torch-cuda",
                           "required-packages"})


def service_vllm_version(inp: PlanInput) -> str | None:
    """The vLLM version the service runs: its engine's (the lock's), else the host's vllm."""
    m = inp.target.manifest
    if m.engine is None:
        return inp.facts.vllm_version
    return (inp.engine.vllm_version if inp.engine is not None and inp.engine.ok else None) or m.engine.vllm_version


def after_build_checks(env: RunEnv, inp: PlanInput, skip: frozenset[str]) -> list[str]:
    """Preflight's engine checks, against the venv just built: the failures' lines."""
    m, r = inp.target.manifest, inp.target.rendered
    python = python_path(m, env.entry)
    needs = needs_for(m, r.argv, r.provenance, manifest_label=f"models/{inp.target.model}.yaml",
                      effective=inp.target.effective)
    todo = ENGINE_CHECKS - skip
    user = env.entry.service_user            # the new venv's code never runs as root
    packages = HostAnswer.of(*scripts.run_json(env.host, python, "inspect_env.py", timeout=120, user=user)) \
        if todo - {"flags", "env"} else None
    argcheck = HostAnswer.of(*scripts.run_json(env.host, python, "argcheck.py",
                                               [json.dumps({"argv": list(r.argv), "env": dict(needs.env)})],
                                               timeout=300, user=user)) if todo & {"flags", "env"} else None
    if argcheck is not None and argcheck.value and m.engine is not None:    # the next deploy reuses a passing answer
        remember_argcheck(env.host, env.entry, lock_of(m.engine), argcheck_request(r.argv, needs.env), argcheck.value)
    facts = inp.facts
    pf = PreflightFacts(python=python, packages=packages, argcheck=argcheck, gpus=None, gpu_error=None,
                        driver_version=facts.driver_version, driver_cuda=facts.cuda_version)
    checks = evaluate(pf, needs, None, skip=set(skip) | {"service-user", "root-programs", "root-folders"})
    return [f"{c.name}: {c.summary}" + (f" (fix: {c.fix})" if c.fix else "")
            for c in checks if c.status == FAIL and c.name in ENGINE_CHECKS]


def when(stamp: float | None) -> str:
    """A time the host wrote (untrusted: any number) as UTC, or "at an unknown time"."""
    try:
        return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(stamp)) if stamp else "at an unknown time"
    except (OverflowError, OSError, ValueError):
        return "at an unknown time"


def verified(state: EngineState) -> str:
    """How an ok venv was found ok: its verdict trusted (verified earlier, unchanged since: stats
    only), or the full check run now (and why)."""
    what = f"lock {state.lock.hash}, vLLM {state.vllm_version}" + (f", {fmt_bytes(state.bytes)}" if state.bytes else "")
    if state.verified == "earlier":
        return f"verified earlier, unchanged ({what}; verified {when(state.verified_at)}, its files unchanged " \
               f"since; --verify-engine checks it in full)"
    took = f" in {fmt_duration(state.verify_seconds)}" if state.verify_seconds is not None else ""
    why = f"; {state.why_verified}" if state.why_verified else ""
    return f"exists and verifies ({what}): the full check{took} (pins, imports, vllm --version{why})"


def engine_action(inp: PlanInput) -> Action | None:
    """None for a manifest without `engine:` (the inventory's vllm); else the venv's step."""
    m, entry = inp.target.manifest, inp.entry
    if m.engine is None:
        return None
    allowed_wheel_url(m.engine.vllm, entry)        # exit 2 at plan time, even for a venv built earlier
    lock = lock_of(m.engine)
    hashes_required(lock, entry, m.name)
    state = inp.engine
    path = f"{entry.engines_root}/{lock.name}"
    if state is not None and state.ok:
        return Action("engine", f"nothing to do, because {path} {verified(state)}", noop=True)
    source = "the uploaded wheelhouse (offline)" if entry.wheelhouse else "the host's registries"
    why = f"{state.state}: {state.detail}" if state is not None else "not checked"
    skip = frozenset(inp.opts.skip_checks) | frozenset(entry.skip_checks)
    shown = scripts.command(entry.python, SCRIPT, build_args(entry, lock))

    def run(env: RunEnv) -> str:
        def on_event(event: dict) -> None:
            if event.get("event") == "step":
                env.event("engine", str(event.get("what", "")))

        done = build(env.host, env.entry, lock, on_event=on_event)
        failed = after_build_checks(env, inp, skip)
        if failed:
            raise DeployFailed(f"the new engine {lock.name} refuses the service: {failed[0]}", host=env.entry.name,
                               step="engine", details=failed[1:],
                               hint="fix the manifest for this vLLM version, or pin the version it was validated "
                                    "with (the venv stays; gc removes it once no service uses it)")
        env.record.engine = {"name": lock.name, "vllm_version": done.get("vllm_version"),
                             "seconds": done.get("seconds"), "bytes": done.get("bytes"),
                             "uploaded_bytes": done.get("uploaded_bytes"), "built": done.get("built")}
        return (f"{path}: vLLM {done.get('vllm_version')}, {fmt_bytes(done.get('bytes') or 0)} in "
                f"{done.get('seconds')}s, verified (imports, vllm --version)"
                + (f"; uploaded {fmt_bytes(done['uploaded_bytes'])} of wheels" if done.get("uploaded_bytes") else ""))

    return Action("engine", f"build {path} (vLLM {lock.vllm_version}, Python {lock.python}, "
                            f"{len(lock.requirements)} pinned{', hashes required' if lock.hashed else ''}) with uv "
                            f"from {source}, while the old service "
                            f"serves ({why})", commands=[shown], run=run,
                  details=[f"lock: {line}" for line in lock.requirements])
