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
import re
import shlex
import time
from typing import Any, Collection, Mapping, Sequence

from .hosts.base import Host, Result, Script
from .paths import package_file
from .preflight import (FAIL, GpuNeeds, Check, check_env, check_flags, check_foreign_gpu_processes,
                        check_gpus, check_package_pairs, check_required_packages, check_torch_cuda,
                        check_vllm_version, packages_needed)
from .secret import Secret

_SEP = "@@vllm-orch@@"


def host_script(name: str, request: Mapping[str, Any] | None = None) -> bytes:
    """The text of orchestrator/remote/<name>.py, with the request prepended as `_REQUEST = '...'`."""
    text = package_file("remote", f"{name}.py").read_text()
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
    s = shlex.quote(nvidia_smi)
    return Script(f"{s} --query-gpu=index,uuid,name,memory.total,memory.used,driver_version "
                  f"--format=csv,noheader,nounits && echo {_SEP} && "
                  f"{s} --query-compute-apps=pid,process_name,gpu_uuid,used_memory "
                  f"--format=csv,noheader,nounits && echo {_SEP} && {s}")


def parse_nvidia_smi(text: str) -> tuple[list[dict], list[dict], str | None, str | None]:
    """(gpus, processes, driver_version, driver_cuda) from nvidia_smi_script()'s output."""
    parts = text.split(_SEP)
    gpu_text, apps_text, plain = (parts + ["", "", ""])[:3]
    gpus, by_uuid = [], {}
    for line in gpu_text.strip().splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) < 5 or not f[0].isdigit():
            continue
        g = {"index": int(f[0]), "uuid": f[1], "name": f[2], "memory_total_mib": int(float(f[3])),
             "memory_used_mib": int(float(f[4])), "driver_version": f[5] if len(f) > 5 else None}
        gpus.append(g)
        by_uuid[g["uuid"]] = g["index"]
    procs = []
    for line in apps_text.strip().splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) < 4 or not f[0].isdigit():
            continue
        used = f[3].split()[0] if f[3] else "0"
        procs.append({"pid": int(f[0]), "process_name": f[1], "gpu_index": by_uuid.get(f[2], -1),
                      "gpu_uuid": f[2], "used_mib": int(float(used)) if used.replace(".", "").isdigit() else None})
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", plain)
    driver = re.search(r"Driver Version:\s*([\d.]+)", plain)
    driver_version = driver.group(1) if driver else (gpus[0]["driver_version"] if gpus else None)
    return gpus, procs, driver_version, cuda.group(1) if cuda else None


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
                  timeout: float = 180.0) -> list[Check]:
    """All preflight checks for one model on one host, in plan order.

    env: the service's environment (the manifest's env); Secret values are not sent anywhere.
    required_packages: {package: why} on top of what packages_needed(argv, env) derives.
    gpu_needs / nvidia_smi None: the GPU checks are not made (not listed).
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
        r = host.run(nvidia_smi_script(nvidia_smi), timeout=30)
        t_smi = round(time.monotonic() - started, 3)
        if r.ok:
            smi = parse_nvidia_smi(r.stdout)
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
    """run_preflight keyword arguments from a Manifest (orchestrator.manifest), duck-typed:
    run_preflight(host, entry.python, r.argv, r.provenance, manifest_label=path, **manifest_kwargs(m))."""
    vram = getattr(m.requires, "vram_per_gpu_gib", 0) or 0
    return {"env": dict(m.env),
            "min_vllm": m.requires.min_vllm_version,
            "gpu_needs": GpuNeeds(count=m.serving.gpus, name_contains=m.requires.gpu_name,
                                  min_vram_mib=int(vram * 1024) or None,
                                  indices=list(m.serving.visible_devices))}
