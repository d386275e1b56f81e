"""Run preflight on a host: gather the facts with three host calls, then apply the pure checks.

    checks = run_preflight(host, python, argv, provenance, manifest_label="models/kimi.yaml",
                           env=manifest.env, min_vllm="0.19.1", gpu_needs=GpuNeeds(8, "RTX PRO 6000"),
                           skip={"torch-cuda"})

Host calls (each one round trip; they work the same over LocalHost and SshHost):
  1. `python -` + inspect_env.py       -> package versions, torch's CUDA build       (~0.1 s)
  2. `python -` + argcheck.py           -> the host's own vLLM parser on the argv     (~5-10 s)
  3. `sh -c 'nvidia-smi ...'`           -> GPUs, GPU processes, the driver's CUDA     (~0.1-1 s)
A call whose checks are all skipped is not made. Each Check's `seconds` is the duration of the host
call that fed it (flags/env share argcheck's; the version checks share inspect_env's).
"""

from __future__ import annotations

import json
import shlex
import time
from typing import Any, Collection, Mapping, Sequence

from orchestrator.host.base import Host, Result, Script
from orchestrator.paths import package_file
from orchestrator.host import nvidia_smi as gpu
from orchestrator.plan.preflight import (FAIL, GpuNeeds, Check, check_env, check_flags, check_foreign_gpu_processes, check_gpus, check_package_pairs, check_required_packages, check_torch_cuda, check_vllm_version, packages_needed)
from orchestrator.secret import Secret

_SEP = "@@vllm-orch@@"


def host_script(name: str, request: Mapping[str, Any] | None = None) -> bytes:
    """The text of orchestrator/host/remote/<name>.py, with the request prepended as `_REQUEST = '...'`."""
    text = package_file("host", "remote", f"{name}.py").read_text()
    if request is not None:
        text = f"_REQUEST = {json.dumps(request)!r}\n" + text
    return text.encode()


def run_host_script(host: Host, python: str, name: str, request: Mapping[str, Any] | None = None,
                    timeout: float = 180.0) -> tuple[dict | None, Result]:
    """Run a host-side script with the host's Python; (its one JSON line or None, the Result)."""
    result = host.run([python, "-"], input=host_script(name, request), timeout=timeout)
    for line in reversed(result.stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line), result
            except ValueError:
                break
    return None, result


def _broken(name: str, what: str, python: str, result: Result) -> Check:
    tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
    return Check(name, FAIL, f"could not run {what} with {python} (exit {result.exit_code})"
                 + (f": {tail[-1]}" if tail else ""), details=tail,
                 fix="check the inventory's `python:` (the Python of the host's vLLM)",
                 seconds=round(result.duration, 3))


# -- nvidia-smi ---------------------------------------------------------------------------------------
def nvidia_smi_script(nvidia_smi: str) -> Script:
    """The GPU list, the compute processes and the banner, in one round trip."""
    gpus = " ".join(shlex.quote(a) for a in gpu.query_gpus_argv(nvidia_smi))
    apps = " ".join(shlex.quote(a) for a in gpu.query_compute_apps_argv(nvidia_smi))
    return Script(f"{gpus} && echo {_SEP} && {apps} && echo {_SEP} && {shlex.quote(nvidia_smi)}")


def parse_nvidia_smi(text: str) -> tuple[list[dict], list[dict], str | None, str | None]:
    """(gpus, processes, driver_version, driver_cuda) from nvidia_smi_script()'s output, parsed by
    orchestrator.host.nvidia_smi (the parsers tested on recorded real nvidia-smi output)."""
    parts = text.split(_SEP)
    gpu_text, apps_text, plain = (parts + ["", "", ""])[:3]
    parsed = [g for g in gpu.parse_gpus(gpu_text.strip(), gpu.GPU_QUERY_FIELDS) if g.index is not None]
    gpus = [{"index": g.index, "uuid": g.uuid, "name": g.name or "?", "memory_total_mib": g.memory_total_mib or 0,
             "memory_used_mib": g.memory_used_mib or 0, "driver_version": g.driver_version} for g in parsed]
    by_uuid = {g["uuid"]: g["index"] for g in gpus}
    procs = [{"pid": p.pid, "process_name": p.process_name or "?", "gpu_index": by_uuid.get(p.gpu_uuid, -1),
              "gpu_uuid": p.gpu_uuid, "used_mib": p.used_memory_mib}
             for p in gpu.parse_compute_apps(apps_text.strip(), gpu.COMPUTE_APPS_FIELDS)]
    info = gpu.parse_driver_info(plain)
    driver_version = info.driver_version or (gpus[0]["driver_version"] if gpus else None)
    return gpus, procs, driver_version, info.cuda_version


# -- the runner ---------------------------------------------------------------------------------------
def run_preflight(host: Host, python: str, argv: Sequence[str],
                  provenance: Sequence[tuple[str, str]], *,
                  manifest_label: str | None = None,
                  env: Mapping[str, Any] | None = None,
                  env_fields: Mapping[str, str] | None = None,
                  min_vllm: str | None = None,
                  gpu_needs: GpuNeeds | None = None,
                  nvidia_smi: str | None = "nvidia-smi",
                  managed_pids: Collection[int] = (),
                  kill_foreign: bool = False,
                  required_packages: Mapping[str, str] | None = None,
                  skip: Collection[str] = (),
                  timeout: float = 180.0,
                  gpu_facts: tuple[list[dict], list[dict], str | None, str | None] | None = None,
                  parser_optional: bool = False) -> list[Check]:
    """All preflight checks for one model on one host, in plan order.

    env: the service's environment (the manifest's env); Secret values are not sent anywhere.
    required_packages: {package: why} on top of what packages_needed(argv, env) derives.
    gpu_needs / nvidia_smi None: the GPU checks are not made (not listed).
    gpu_facts: (gpus, processes, driver_version, driver_cuda) already read from the host (the deploy's
    facts): then nvidia-smi is not called again.
    parser_optional: a host whose Python cannot import vLLM (a SIMULATED host) skips the flag check
    instead of failing it.
    """
    skip = set(skip)
    plain_env = {k: str(v) for k, v in (env or {}).items() if not isinstance(v, Secret)}
    checks: list[Check] = []

    # 1. packages
    version_checks = {"vllm-version", "package-pairs", "torch-cuda", "required-packages"}
    info, res = ({}, None)
    if version_checks - skip:
        info, res = run_host_script(host, python, "inspect_env", {"packages": []}, timeout=60)
    t_env = round(res.duration, 3) if res else None
    pk = (info or {}).get("packages", {})

    # 3. GPUs (before the slow parser call so a GPU-less host fails fast; listed after it)
    gpu_checks: list[Check] = []
    smi = None
    want_gpus = gpu_needs is not None and nvidia_smi and (
        {"gpus", "foreign-gpu-processes", "torch-cuda"} - skip)
    if want_gpus:
        started = time.monotonic()
        r = host.run(nvidia_smi_script(nvidia_smi), timeout=30) if gpu_facts is None else None
        t_smi = round(time.monotonic() - started, 3)
        if r is None or r.ok:
            smi = gpu_facts if r is None else parse_nvidia_smi(r.stdout)
            gpus, procs, _driver, _cuda = smi
            targets = gpu_needs.indices if gpu_needs.indices is not None else \
                [g["index"] for g in gpus][:gpu_needs.count]
            for c in (check_gpus(gpus, gpu_needs, skip=skip),
                      check_foreign_gpu_processes(procs, targets, managed_pids,
                                                  kill_foreign=kill_foreign, skip=skip)):
                c.seconds = t_smi
                gpu_checks.append(c)
        else:
            for name in ("gpus", "foreign-gpu-processes"):
                c = (Check(name, "skipped", f"skipped (--skip-check {name})") if name in skip else
                     Check(name, FAIL, f"nvidia-smi failed (exit {r.exit_code}): "
                           + ((r.stderr or r.stdout).strip().splitlines() or ["?"])[-1],
                           fix=f"check the NVIDIA driver; nvidia-smi is `{nvidia_smi}` in the inventory"))
                c.seconds = t_smi
                gpu_checks.append(c)

    # 2. flags + env with the host's own vLLM parser
    if {"flags", "env"} - skip:
        ac, r2 = run_host_script(host, python, "argcheck", {"argv": list(argv), "env": plain_env},
                                 timeout=timeout)
        if ac is None:
            checks.append(_broken("flags", "argcheck.py", python, r2))
        elif parser_optional and ac.get("stage") == "import":
            checks.append(Check("flags", "skipped", f"{python} cannot import vLLM (a SIMULATED host without a "
                                "real vLLM): run `vllm-orch sim up --vllm-python PATH` to check flags with one",
                                seconds=round(r2.duration, 3)))
            checks.append(Check("env", "skipped", "skipped with the flag check", seconds=round(r2.duration, 3)))
        else:
            c = check_flags(ac, provenance, manifest=manifest_label, skip=skip)
            c.seconds = round(r2.duration, 3)
            checks.append(c)
            c = check_env(plain_env, ac.get("unknown_env") or (), env_fields=env_fields, skip=skip)
            c.seconds = round(r2.duration, 3)
            checks.append(c)
    else:
        checks += [check_flags({}, (), skip=skip), check_env({}, skip=skip)]

    if info is None:
        checks.append(_broken("vllm-version", "inspect_env.py", python, res))
    else:
        needs = {**packages_needed(argv, plain_env), **(required_packages or {})}
        driver_version, driver_cuda = (smi[2], smi[3]) if smi else (None, None)
        for c in (check_vllm_version(pk.get("vllm"), min_vllm, python=python, skip=skip),
                  check_package_pairs(pk, plain_env, skip=skip),
                  check_torch_cuda(info.get("torch_cuda"), driver_cuda, torch_version=pk.get("torch"),
                                   driver_version=driver_version, skip=skip),
                  check_required_packages(needs, pk, skip=skip)):
            c.seconds = t_env if c.status != "skipped" else None
            checks.append(c)
    return checks + gpu_checks


def manifest_kwargs(m: Any) -> dict[str, Any]:
    """run_preflight keyword arguments from a Manifest (orchestrator.config.manifest), duck-typed:
    run_preflight(host, entry.python, r.argv, r.provenance, manifest_label=path, **manifest_kwargs(m))."""
    vram = getattr(m.requires, "vram_per_gpu_gib", 0) or 0
    return {"env": dict(m.env),
            "min_vllm": m.requires.min_vllm_version,
            "gpu_needs": GpuNeeds(count=m.serving.gpus, name_contains=m.requires.gpu_name,
                                  min_vram_mib=int(vram * 1024) or None,
                                  indices=list(m.serving.visible_devices))}
