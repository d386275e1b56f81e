"""Host-side: the versions of the Python packages a vLLM service depends on, as ONE JSON object.

Run by the host's vLLM Python, standard library only, and fast: nothing heavy is imported (importing
torch takes seconds); versions come from the installed distributions' metadata, torch's CUDA build
from its version suffix ("2.13.0+cu130") or, failing that, from torch/version.py read as text.

    python inspect_env.py            # or: python - < inspect_env.py
    -> {"python": "3.12.3", "executable": "...",
        "packages": {"vllm": "0.33.0", "torch": "2.13.0+cu130", "flashinfer-python": "0.7.2",
                     "flashinfer-cubin": null, ...},        # null = not installed
        "torch_cuda": "13.0" | null, "torch_cuda_source": "version suffix" | "torch/version.py" | null,
        "seconds": 0.01}

Extra package names may be given as arguments. Simulated hosts fake packages with *.dist-info folders on
PYTHONPATH; importlib.metadata reads those exactly like real ones.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

PACKAGES = ("vllm", "torch", "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache",
            "fastsafetensors", "transformers", "huggingface_hub", "triton")


def package_versions(names):
    from importlib.metadata import PackageNotFoundError, version
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
        except Exception:  # a broken METADATA file: say so rather than crash the whole report
            out[name] = "unreadable"
    return out


def cuda_from_suffix(torch_version):
    """'2.13.0+cu130' -> '13.0', '2.8.0+cu128' -> '12.8', '+cpu'/'+rocm..'/none -> None."""
    m = re.search(r"\+cu(\d+)(\d)$", torch_version or "")
    return f"{int(m.group(1))}.{m.group(2)}" if m else None


def cuda_from_version_py():
    """torch.version.cuda without importing torch: read torch/version.py as text."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("torch")   # locates the package; does not run it
    except Exception:
        return None
    if not spec or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "version.py")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            continue
        m = re.search(r"^cuda\s*(?::[^=]*)?=\s*(?:'([^']*)'|\"([^\"]*)\"|None)", text, re.MULTILINE)
        if m:
            return m.group(1) or m.group(2) or None
    return None


def inspect(extra=()):
    started = time.monotonic()
    names = list(PACKAGES) + [n for n in extra if n not in PACKAGES]
    versions = package_versions(names)
    cuda, source = cuda_from_suffix(versions.get("torch")), None
    if cuda:
        source = "version suffix"
    elif versions.get("torch"):
        cuda = cuda_from_version_py()
        source = "torch/version.py" if cuda else None
    return {"python": "%d.%d.%d" % sys.version_info[:3], "executable": sys.executable,
            "packages": versions, "torch_cuda": cuda, "torch_cuda_source": source,
            "seconds": round(time.monotonic() - started, 3)}


def main():
    extra = sys.argv[1:]
    sys.stdout.write(json.dumps(inspect(extra)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
