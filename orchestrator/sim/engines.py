"""SIMULATED engine wheels: a small local wheelhouse from which uv builds versioned simulated vLLM venvs
(a manifest's `engine:`), offline, as it builds real ones from a real wheelhouse.

- `vllm-<version>`: the package `vllm` (its `__version__`) with the simulated server inside
  (orchestrator/sim/vllm_server.py, copied in as `vllm/_sim_server.py`) and a `vllm` console script
  that runs it as that version: its parser, start-up lines and version traps follow the version
  (vllm_server.py, VERSIONED_FLAGS and the start line), and the packages it checks (the flashinfer
  pair) are the venv's own. It needs nothing but the standard library (psutil when present).
  It also answers preflight's parser check (argcheck.py): `vllm.utils.argparse_utils` and
  `vllm.entrypoints.cli.serve` build the serve parser from the same version's flag table.
- `torch-<version>` (`torch/version.py` with its CUDA build, as inspect_env.py reads it),
  `flashinfer-python-<version>` (module `flashinfer`), `flashinfer-cubin-<version>`.

Each import of a simulated `vllm` appends a line (pid, argv, version) to
`<host dir>/logs/sim-vllm-imports.jsonl` (`IMPORTS`; not named like a service's log): the tests count
what the engine check ran on a host (`vllm --version`, the verify's `python -c`).

A vLLM wheel may declare requirements (`requires`): a wheel that pulls a mismatched flashinfer pair
reproduces the start-up death after loading (vllm #49804) in a venv whose lock did not pin the pair.
The simulated server finds its host folder from its venv: engines_root is `<host dir>/engines`.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from orchestrator.paths import package_file

TAG = "py3-none-any"

_SIM_MAIN = '''"""SIMULATED vLLM {version}: runs vllm-orch's simulated server as this version."""
import os
import sys
from pathlib import Path

from vllm import __version__


def server():
    """The simulated server module, as this version (its parser follows the version)."""
    os.environ["VLLM_SIM_VLLM_VERSION"] = __version__
    # engines_root is <host dir>/engines: the venv is <host dir>/engines/<name>
    os.environ.setdefault("VLLM_SIM_HOST_DIR", str(Path(sys.prefix).resolve().parent.parent))
    from vllm import _sim_server
    return _sim_server


def main():
    return server().main()
'''

# What argcheck.py (orchestrator/host/remote/argcheck.py) imports of a vLLM to build `vllm serve`'s
# parser tree: FlexibleArgumentParser, and the serve subcommand whose subparser_init adds `serve`
# with this version's flags (the server's own table: a removed flag is argparse's "unrecognized
# arguments" from the top-level `vllm` parser, as in the real tree).
_SIM_ARGPARSE = '''"""SIMULATED vllm.utils.argparse_utils: FlexibleArgumentParser normalizes the argv first."""
import argparse
import sys

from vllm import _sim


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_args(_sim.server().normalize_argv(args), namespace)
'''

_SIM_SERVE = '''"""SIMULATED vllm.entrypoints.cli.serve: the `serve` subcommand."""
from vllm import _sim


class ServeSubcommand:
    name = "serve"

    def subparser_init(self, subparsers):
        return _sim.server().add_serve(subparsers)

    def validate(self, args):
        """vLLM validates a few flag combinations here; the simulated server checks none at start either."""
'''


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_wheel(folder: Path, dist: str, version: str, files: Mapping[str, str | bytes], *,
               scripts: Mapping[str, str] | None = None, requires: Iterable[str] = ()) -> Path:
    """A pure-Python wheel (PEP 427) of `files` ({path in the wheel: text}), with console `scripts`
    ({name: module:function}) and Requires-Dist lines."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = dist.replace("-", "_")
    info = f"{stem}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\nSummary: SIMULATED {dist} (vllm-orch sim)\n" \
        + "".join(f"Requires-Dist: {r}\n" for r in requires)
    entries: dict[str, bytes] = {k: v.encode() if isinstance(v, str) else v for k, v in files.items()}
    entries[f"{info}/METADATA"] = meta.encode()
    entries[f"{info}/WHEEL"] = f"Wheel-Version: 1.0\nGenerator: vllm-orch-sim\nRoot-Is-Purelib: true\nTag: {TAG}\n".encode()
    if scripts:
        entries[f"{info}/entry_points.txt"] = ("[console_scripts]\n" + "".join(
            f"{k} = {v}\n" for k, v in scripts.items())).encode()
    record = [_record_line(n, d) for n, d in entries.items()] + [f"{info}/RECORD,,"]
    entries[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{stem}-{version}-{TAG}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in entries.items():
            z.writestr(name, data)
    return path


_SIM_INIT = '''"""SIMULATED vLLM {version}."""
__version__ = "{version}"


def _log_import():
    """One line per import in <host dir>/logs/sim-vllm-imports.jsonl (the venv is <host dir>/engines/NAME)."""
    import json
    import os
    import sys
    logs = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(sys.prefix))), "logs")
    try:
        if os.path.isdir(logs):
            with open(os.path.join(logs, IMPORTS), "a") as f:
                f.write(json.dumps({{"pid": os.getpid(), "argv": sys.argv, "version": __version__}}) + "\\n")
    except OSError:
        pass


IMPORTS = "sim-vllm-imports.jsonl"
_log_import()
'''
IMPORTS = "sim-vllm-imports.jsonl"        # in the host's logs folder: one JSON line per import of a simulated vllm


# What a simulated vLLM wheel requires, as the real wheel's METADATA does (vllm-0.33.0 on PyPI:
# Requires-Dist torch==2.14.0, flashinfer-python==0.7.2.post1), so a lock pinning another torch or
# flashinfer fails uv's resolution as it would on a real host; the older simulated versions require
# nothing. The default wheelhouse carries what 0.33.0 requires.
REQUIRES = {"0.33.0": ("torch==2.14.0", "flashinfer-python==0.7.2.post1")}
TORCH = "2.14.0+cu130"
FLASHINFER = "0.7.2.post1"


def vllm_wheel(folder: Path, version: str, requires: Iterable[str] | None = None) -> Path:
    """A simulated vLLM wheel; `requires` None: what the real wheel of that version requires (REQUIRES)."""
    requires = REQUIRES.get(version, ()) if requires is None else requires
    server = package_file("sim", "vllm_server.py").read_text()
    return make_wheel(folder, "vllm", version, {
        "vllm/__init__.py": _SIM_INIT.format(version=version),
        "vllm/_sim.py": _SIM_MAIN.format(version=version),
        "vllm/_sim_server.py": server,
        "vllm/gpu_holder.py": package_file("sim", "gpu_holder.py").read_text(),
        "vllm/utils/__init__.py": "",
        "vllm/utils/argparse_utils.py": _SIM_ARGPARSE,
        "vllm/entrypoints/__init__.py": "",
        "vllm/entrypoints/cli/__init__.py": "",
        "vllm/entrypoints/cli/serve.py": _SIM_SERVE,
    }, scripts={"vllm": "vllm._sim:main"}, requires=requires)


def torch_wheel(folder: Path, version: str) -> Path:
    cuda = None
    if "+cu" in version:
        digits = version.split("+cu", 1)[1]
        cuda = f"{int(digits[:-1])}.{digits[-1]}"
    return make_wheel(folder, "torch", version, {
        "torch/__init__.py": f'"""SIMULATED torch."""\n__version__ = "{version}"\nfrom torch import version\n',
        "torch/version.py": f'__version__ = "{version}"\ncuda = {cuda!r}\n',
    })


def flashinfer_wheels(folder: Path, version: str, cubin: str | None = None) -> list[Path]:
    """flashinfer-python at `version` and flashinfer-cubin at `cubin` (default: the same)."""
    return [make_wheel(folder, "flashinfer-python", version,
                       {"flashinfer/__init__.py": f'"""SIMULATED flashinfer."""\n__version__ = "{version}"\n'}),
            make_wheel(folder, "flashinfer-cubin", cubin or version,
                       {"flashinfer_cubin/__init__.py": f'__version__ = "{cubin or version}"\n'})]


def wheelhouse(folder: Path, vllm_versions: Iterable[str] = ("0.33.0",), *, torch: str = TORCH,
               flashinfer: Iterable[str] = (FLASHINFER,)) -> Path:
    """A wheelhouse with a simulated vLLM of each version, torch, and flashinfer pairs."""
    for v in vllm_versions:
        vllm_wheel(folder, v)
    torch_wheel(folder, torch)
    for f in flashinfer:
        flashinfer_wheels(folder, f)
    return folder


# An sdist's build runs its own code (setup.py, or the build backend its pyproject.toml names) as
# whoever runs uv: the simulated one's backend is its setup.py (in-tree, no build requirements, so it
# builds offline as a setuptools sdist would with setuptools at hand) and leaves a line in `ran`.
_SDIST_SETUP = '''"""SIMULATED sdist {name} {version}: its setup.py is its build backend (PEP 517, in-tree)."""
import base64, hashlib, json, os, zipfile

with open({ran!r}, "a") as f:
    f.write(json.dumps({{"sdist": "{name}", "uid": os.getuid(), "pid": os.getpid()}}) + "\\n")


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    stem = "{stem}-{version}"
    info = stem + ".dist-info"
    entries = {{"{stem}/__init__.py": b"", info + "/METADATA": b"Metadata-Version: 2.1\\nName: {name}\\nVersion: {version}\\n",
               info + "/WHEEL": b"Wheel-Version: 1.0\\nGenerator: sim\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}}
    record = ["%s,sha256=%s,%d" % (n, base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=").decode(),
                                   len(d)) for n, d in entries.items()] + [info + "/RECORD,,"]
    entries[info + "/RECORD"] = ("\\n".join(record) + "\\n").encode()
    name = stem + "-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as z:
        for n, d in entries.items():
            z.writestr(n, d)
    return name
'''


def sdist(folder: Path, dist: str, version: str, ran: Path) -> Path:
    """A source distribution (`<name>-<version>.tar.gz`) whose build runs its setup.py, which appends
    one JSON line ({"sdist", "uid", "pid"}) to `ran`: what a hostile package's setup.py could do."""
    import io
    import tarfile

    folder.mkdir(parents=True, exist_ok=True)
    stem = dist.replace("-", "_")
    top = f"{stem}-{version}"
    files = {
        "pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "setup"\nbackend-path = ["."]\n\n'
                          f'[project]\nname = "{dist}"\nversion = "{version}"\n',
        "PKG-INFO": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        "setup.py": _SDIST_SETUP.format(name=dist, stem=stem, version=version, ran=str(ran)),
    }
    path = folder / f"{top}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return path
