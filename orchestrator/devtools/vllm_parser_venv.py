"""A cached virtual environment holding the REAL vLLM 0.33.0 argument parser, for CPU-only machines.

Why: preflight validates a rendered argv with the host's own vLLM parser. Tests (and anyone who wants
to rehearse a check with `vllm-orch sim up --vllm-python PATH`) need a real vLLM without a GPU. The
full `pip install vllm` pulls CUDA kernels worth many GB; the parser only needs vLLM's Python code,
torch (a CPU build is enough) and the packages vLLM imports at import time (listed below).

The venv is built once per machine and recipe:
  ~/.cache/vllm-orch/vllm-0.33.0-parser-<recipe hash>/
under a file lock, and counts as built only after a real parse succeeded (devtools/cached_venv.py).

    python -m orchestrator.devtools.vllm_parser_venv          # build if needed, print the python path
    python -m orchestrator.devtools.vllm_parser_venv --info   # also print build time and size (JSON)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from orchestrator.devtools import cached_venv
from orchestrator.devtools.cached_venv import BuildError, BuildInfo, cache_root, run  # noqa: F401

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
    return cached_venv.recipe_hash(recipe())


def venv_dir() -> Path:
    return cache_root() / f"vllm-{VLLM_VERSION}-parser-{recipe_hash()}"


def venv_python(path: Path | None = None) -> Path:
    return cached_venv.python_of(path or venv_dir())


def smoke_parse(python: Path | str, timeout: float = 300) -> float:
    """Build vLLM's serve parser with `python` and parse SMOKE_ARGV; returns the seconds it took."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run([str(python), "-c", _SMOKE, json.dumps(["vllm", *SMOKE_ARGV])],
                          capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise BuildError("the real vLLM parser did not build: "
                         + (proc.stderr.strip().splitlines() or ["?"])[-1], proc.stderr, False)
    return json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]


def _build(venv: Path, log: list[str]) -> dict:
    base = getattr(sys, "_base_executable", sys.executable)
    run([base, "-m", "venv", str(venv)], log)
    py = str(venv_python(venv))
    env = cached_venv.pip_env()
    pip = [py, "-m", "pip", "install", "-q", "--prefer-binary"]
    # torch first and alone, so the resolver never considers a CUDA build or another version.
    run(pip + [f"torch=={TORCH_VERSION}"], log, env)
    run(pip + [f"torch=={TORCH_VERSION}", *IMPORT_DEPS], log, env)
    run(pip + ["--no-deps", f"vllm=={VLLM_VERSION}", *NO_DEPS], log, env)
    return {"parse_seconds": smoke_parse(venv_python(venv))}


def ensure_venv(*, rebuild: bool = False) -> BuildInfo:
    """The cached venv's python, building it first if it is missing (or `rebuild`)."""
    return cached_venv.ensure(venv_dir(), recipe(), _build, rebuild=rebuild)


def is_built() -> bool:
    return cached_venv.is_built(venv_dir())


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
