"""A cached virtual environment holding the REAL vLLM 0.33.0 argument parser, for CPU-only machines.

Why: preflight validates a rendered argv with the host's own vLLM parser. Tests (and anyone who wants
to rehearse a check with `vllm-orch sim up --vllm-python PATH`) need a real vLLM without a GPU. The
full `pip install vllm` pulls CUDA kernels worth many GB; the parser only needs vLLM's Python code,
torch (a CPU build is enough) and the packages vLLM imports at import time (listed below).

The venv is built once per machine and recipe:
  ~/.cache/vllm-orch/vllm-0.33.0-parser-<recipe hash>/
under a file lock (concurrent pytest sessions wait for one build), in a temporary folder that is
renamed into place only after a real parse succeeded, so a half-built venv is never used.

    python -m orchestrator.devtools.vllm_parser_venv          # build if needed, print the python path
    python -m orchestrator.devtools.vllm_parser_venv --info   # also print build time and size (JSON)
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

VLLM_VERSION = "0.33.0"
TORCH_VERSION = "2.13.0"   # vllm 0.33.0 pins 2.14.0; the parser does not care, and 2.13.0 CPU is on disk

# The packages vLLM imports while building its parser (vllm.entrypoints.common.cli_args.make_arg_parser),
# with vLLM 0.33.0's own
# version specifiers from its wheel METADATA. Installed WITH their dependencies; vllm itself --no-deps.
# Deliberately absent: fastapi's [standard] extra, flashinfer, triton, CUDA wheels, torchvision/audio.
# xgrammar is installed --no-deps (with its other requirements): its only other dependency is triton
# (1 GB installed), which vLLM replaces with a placeholder when missing - the parser is unaffected.
NO_DEPS: tuple[str, ...] = ("xgrammar==0.2.8", "apache-tvm-ffi==0.1.11", "typing-extensions>=4.9.0")
IMPORT_DEPS: tuple[str, ...] = (
    "transformers>=5.16.1,<5.21.0", "huggingface_hub>=1.31.0", "tokenizers>=0.23.2",
    "safetensors>=0.6.2", "fastapi>=0.133.0,<0.137.0", "starlette>=1.0.1", "aiohttp>=3.14.4",
    "openai>=2.25.0", "pydantic>=2.12.0", "orjson>=3.11.6", "prometheus_client>=0.18.0",
    "prometheus-fastapi-instrumentator>=8.0.0", "pillow>=13.0.0", "tiktoken>=0.6.0",
    "pyzmq>=25.0.0", "msgspec", "pyyaml", "einops", "cloudpickle", "watchfiles",
    "python-json-logger", "pybase64", "cbor2", "ijson", "setproctitle", "uvicorn", "uvloop", "regex",
    "cachetools", "psutil", "sentencepiece", "numpy", "requests>=2.33.0", "tqdm", "blake3",
    "py-cpuinfo", "protobuf>=5.29.6,!=6.30.*,!=6.31.*,!=6.32.*,!=6.33.0.*,!=6.33.1.*,!=6.33.2.*,!=6.33.3.*,!=6.33.4.*",
    "partial-json-parser", "jsonschema>=4.23.0", "filelock>=3.20.3", "oss-harmony>=0.0.11",
    "anthropic>=0.71.0", "mcp>=2.2.0,<3.0.0", "model-hosting-container-standards>=0.1.14,<1.0.0",
    "opentelemetry-sdk>=1.27.0", "opentelemetry-api>=1.27.0", "opentelemetry-exporter-otlp>=1.27.0",
    "opentelemetry-semantic-conventions-ai>=0.4.1", "compressed-tensors==0.17.0",
    "lm-format-enforcer==0.11.3", "outlines_core==0.2.14", "lark==1.2.2",
    "llguidance>=1.7.0,<1.8.0", "mistral_common[image]>=1.11.6", "opencv-python-headless>=4.13.0",
    "ninja", "depyf==0.20.0", "numba==0.65.0",
)

# The argv that proves the venv works: Kimi-K2.5 INT4 on 8 GPUs (models/kimi-k25-int4.yaml), plus the same
# parse must reject a removed flag.
SMOKE_ARGV = ["serve", "moonshotai/Kimi-K2.5", "--tensor-parallel-size", "8",
              "--tool-call-parser", "kimi_k2", "--reasoning-parser", "kimi_k2",
              "--kv-cache-dtype", "fp8", "--attention-backend", "TRITON_MLA",
              "--decode-context-parallel-size", "8", "--trust-remote-code"]

_SMOKE = r"""
import json, sys, time
t0 = time.monotonic()
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
ns = parser.parse_args(json.loads(sys.argv[1])[2:])
print(json.dumps({"seconds": round(time.monotonic() - t0, 2), "tp": ns.tensor_parallel_size}))
"""


def recipe() -> dict:
    """Everything that decides the venv's content; its hash names the cache folder."""
    return {"vllm": VLLM_VERSION, "torch": TORCH_VERSION, "deps": list(IMPORT_DEPS),
            "no_deps": list(NO_DEPS),
            "python": f"{sys.version_info.major}.{sys.version_info.minor}", "layout": 1}


def recipe_hash() -> str:
    return hashlib.sha256(json.dumps(recipe(), sort_keys=True).encode()).hexdigest()[:12]


def cache_root() -> Path:
    """$VLLM_ORCH_CACHE, else $XDG_CACHE_HOME/vllm-orch, else ~/.cache/vllm-orch."""
    if os.environ.get("VLLM_ORCH_CACHE"):
        return Path(os.environ["VLLM_ORCH_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-orch"


def venv_dir() -> Path:
    return cache_root() / f"vllm-{VLLM_VERSION}-parser-{recipe_hash()}"


def venv_python(path: Path | None = None) -> Path:
    return (path or venv_dir()) / "bin" / "python"


@dataclass
class BuildInfo:
    python: Path
    built_now: bool          # False when the cached venv was reused
    seconds: float           # build time (or the recorded one when reused)
    size_bytes: int
    parse_seconds: float     # the smoke parse: import vLLM + build the parser + parse
    log: str = ""

    def as_dict(self) -> dict:
        return {"python": str(self.python), "built_now": self.built_now,
                "build_seconds": round(self.seconds, 1), "size_bytes": self.size_bytes,
                "size_gib": round(self.size_bytes / 2**30, 2),
                "parse_seconds": self.parse_seconds}


class BuildError(RuntimeError):
    """The venv could not be built. `offline` is True when pip could not reach a package index."""

    def __init__(self, message: str, log: str, offline: bool):
        super().__init__(message)
        self.log = log
        self.offline = offline


_OFFLINE_MARKERS = ("NewConnectionError", "Network is unreachable", "Temporary failure in name "
                    "resolution", "No matching distribution found", "Could not find a version",
                    "ConnectTimeoutError", "ProxyError", "Max retries exceeded")


def _dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _run(cmd: list[str], log: list[str], env: dict | None = None, timeout: float = 1800) -> None:
    log.append("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    log.append(proc.stdout[-4000:] + proc.stderr[-8000:])
    if proc.returncode != 0:
        text = proc.stdout + proc.stderr
        raise BuildError(f"{cmd[2:5]} exited {proc.returncode}: "
                         f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}", "\n".join(log),
                         offline=any(m in text for m in _OFFLINE_MARKERS))


def smoke_parse(python: Path | str, timeout: float = 300) -> float:
    """Build vLLM's serve parser with `python` and parse SMOKE_ARGV; returns the seconds it took."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run([str(python), "-c", _SMOKE, json.dumps(["vllm", *SMOKE_ARGV])],
                          capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise BuildError("the real vLLM parser did not build: "
                         + (proc.stderr.strip().splitlines() or ["?"])[-1], proc.stderr, False)
    return json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]


def _build(tmp: Path, log: list[str]) -> None:
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", str(tmp)], log)
    py = str(venv_python(tmp))
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    pip = [py, "-m", "pip", "install", "-q", "--prefer-binary"]
    # torch first and alone, so the resolver never considers a CUDA build or another version.
    _run(pip + [f"torch=={TORCH_VERSION}"], log, env)
    _run(pip + [f"torch=={TORCH_VERSION}", *IMPORT_DEPS], log, env)
    _run(pip + ["--no-deps", f"vllm=={VLLM_VERSION}", *NO_DEPS], log, env)


def ensure_venv(*, rebuild: bool = False) -> BuildInfo:
    """The cached venv's python, building it first if it is missing (or `rebuild`)."""
    final = venv_dir()
    final.parent.mkdir(parents=True, exist_ok=True)
    info_file = final / "vllm-orch-build.json"
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # another process may be building it right now
        if final.is_dir() and info_file.is_file() and not rebuild:
            rec = json.loads(info_file.read_text())
            return BuildInfo(venv_python(final), False, rec["build_seconds"], rec["size_bytes"],
                             rec["parse_seconds"])
        tmp = final.parent / f".{final.name}.building-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        log: list[str] = []
        started = time.monotonic()
        try:
            _build(tmp, log)
            parse_seconds = smoke_parse(venv_python(tmp))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        seconds = time.monotonic() - started
        size = _dir_size(tmp)
        (tmp / "vllm-orch-build.json").write_text(json.dumps(
            {"recipe": recipe(), "build_seconds": round(seconds, 1), "size_bytes": size,
             "parse_seconds": parse_seconds, "built_at": time.time()}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)      # atomic: readers see no venv or a complete, tested one
        return BuildInfo(venv_python(final), True, seconds, size, parse_seconds, "\n".join(log))


def is_built() -> bool:
    return (venv_dir() / "vllm-orch-build.json").is_file()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--info", action="store_true", help="print build facts as JSON")
    ap.add_argument("--rebuild", action="store_true", help="build again even if cached")
    args = ap.parse_args(argv)
    try:
        info = ensure_venv(rebuild=args.rebuild)
    except BuildError as exc:
        print(f"vllm parser venv: {exc}", file=sys.stderr)
        print(exc.log[-6000:], file=sys.stderr)
        return 1
    print(json.dumps(info.as_dict()) if args.info else info.python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
