"""A manifest's `engine:` as it lands on a host: the locked set of packages (the lock), its hash,
and the venv it names. Pure.

One venv per distinct lock, content-addressed: `<engines_root>/vllm-<version>-<hash>`, the hash
being sha256 of the lock's canonical JSON (the Python version and the sorted requirement lines).
Two services whose manifests lock the same set share one venv; a changed pin is another venv,
built beside the one the old service keeps serving from. A manifest without `engine:` runs the
inventory's `vllm` (today's behaviour).
"""

from __future__ import annotations

import hashlib
import json
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass

from orchestrator.config.inventory import HostEntry
from orchestrator.config.lockfile import requirement
from orchestrator.config.manifest import Engine, Manifest, pkg_key
from orchestrator.errors import ConfigError

MARKER = "vllm-orch-engine.json"          # written last into a venv that built and verified


@dataclass(frozen=True)
class Lock:
    """What one venv holds: the Python version and pinned requirement lines, sorted by name."""

    python: str
    requirements: tuple[str, ...]
    vllm_version: str
    pins: tuple[tuple[str, str], ...]       # (normalized name, version) of every pinned package
    hashed: bool = False                    # requirements from a hashed lock: installed with --require-hashes

    def as_json(self) -> str:
        return json.dumps({"python": self.python, "requirements": list(self.requirements)},
                          sort_keys=True, separators=(",", ":"))

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.as_json().encode()).hexdigest()[:16]

    @property
    def name(self) -> str:
        """The venv's folder name: readable, and its content's address."""
        return f"vllm-{self.vllm_version}-{self.hash}"

    def as_dict(self) -> dict:
        return {"python": self.python, "requirements": list(self.requirements), "hash": self.hash,
                "name": self.name, "vllm_version": self.vllm_version, "pins": [list(p) for p in self.pins],
                "hashed": self.hashed}


def lock_of(engine: Engine) -> Lock:
    """The lock of an `engine:` section: vllm (a version, or `vllm @ URL` of a wheel), torch,
    flashinfer-python and flashinfer-cubin at one version, the other packages."""
    reqs: dict[str, str] = {}
    pins: dict[str, str] = {}
    if engine.vllm.startswith("https://"):
        reqs["vllm"] = f"vllm @ {engine.vllm}"
    else:
        reqs["vllm"] = f"vllm=={engine.vllm}"
    pins["vllm"] = engine.vllm_version
    if engine.torch:
        reqs["torch"] = f"torch=={engine.torch}"
        pins["torch"] = engine.torch
    if engine.flashinfer:
        for half in ("flashinfer-python", "flashinfer-cubin"):
            reqs[half] = f"{half}=={engine.flashinfer}"
            pins[half] = engine.flashinfer
    for name, version in engine.packages.items():
        key = pkg_key(name)
        reqs[key] = f"{key}=={version}"
        pins[key] = version
    if engine.locked:               # a hashed lock (engine.lock_file): every package, with its sha256
        return Lock(engine.python, tuple(engine.locked), engine.vllm_version, tuple(sorted(pins.items())), True)
    return Lock(engine.python, tuple(reqs[k] for k in sorted(reqs)), engine.vllm_version,
                tuple(sorted(pins.items())))


def wheel_file(url: str) -> str:
    """The file name of a wheel URL: its last path part, %-decoded (`%2B` is the `+` of a local version)."""
    return urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])


def allowed_wheel_url(url: str, entry: HostEntry) -> None:
    """ConfigError unless `url` (`engine.vllm`) is a version, or a wheel URL under one of the host's
    `wheel_url_prefixes` (the service runs that wheel's code: whoever writes the manifest would choose the
    code root runs). A URL with a `.` or `..` part (also %-encoded) is refused: a URL client resolves
    it, so `https://ok/allowed/../other/` leaves the allowed folder."""
    if not url.startswith("https://"):
        return
    parts = urllib.parse.unquote(urllib.parse.urlsplit(url).path).split("/")
    if any(p in (".", "..") for p in parts):
        raise ConfigError(f"engine.vllm {url[:120]} has a `.` or `..` part: write the address it means",
                          hint="a wheel URL names its folder directly")
    if not any(url.startswith(prefix) for prefix in entry.wheel_url_prefixes):
        where = ", ".join(entry.wheel_url_prefixes) or "none"
        raise ConfigError(f"engine.vllm {url[:120]} is not under the host {entry.name or entry.address}'s "
                          f"wheel_url_prefixes ({where})",
                          hint="the service runs that wheel's code: add its folder (https://.../) to the host's "
                               "wheel_url_prefixes in the inventory, or pin a vLLM version")


def offline_requirements(lock: Lock, wheels: Iterable[str], wheelhouse: str, where: str) -> tuple[str, ...]:
    """The lines uv installs from the host's copy of the wheelhouse (`--offline --no-index
    --find-links`, which fetches no URL): a `vllm @ URL` line names the wheelhouse's file of that
    name. ConfigError when the wheelhouse has none (`where`: the inventory's wheelhouse, to name)."""
    have = set(wheels)
    out = []
    for line in lock.requirements:
        if line.startswith("vllm @ "):
            req = requirement(line)
            name, hashes = wheel_file(req.removeprefix("vllm @ ")), line[len(req):]
            if name not in have:
                raise ConfigError(f"engine.vllm is a wheel URL, and the host builds offline from the wheelhouse "
                                  f"{where}, which has no {name}",
                                  hint=f"put {name} into {where} (uv --offline fetches no URL), or drop the "
                                       f"inventory's wheelhouse for a host that reaches the URL")
            line = f"vllm @ file://{wheelhouse}/{urllib.parse.quote(name)}{hashes}"
        out.append(line)
    return tuple(out)


def hashes_required(lock: Lock, entry: HostEntry, model: str) -> None:
    """ConfigError when the host takes hashed locks only (`require_hashes`) and this one is not."""
    if entry.require_hashes and not lock.hashed:
        raise ConfigError(f"the host {entry.name or entry.address} builds engines from hashed locks only "
                          f"(require_hashes), and {model}'s engine: has no lock_file",
                          hint="compile one: uv pip compile --generate-hashes --python-version "
                               f"{lock.python} -o {model}.lock requirements.in (the engine's pins, one per line), "
                               "and name it in engine.lock_file (docs/operations.md, \"Engines\")")


def venv_path(entry: HostEntry, lock: Lock) -> str:
    return f"{entry.engines_root}/{lock.name}"


def vllm_path(m: Manifest, entry: HostEntry) -> str:
    """The vllm executable the service runs: its engine venv's, else the inventory's."""
    if m.engine is None:
        return entry.vllm
    return f"{venv_path(entry, lock_of(m.engine))}/bin/vllm"


def python_path(m: Manifest, entry: HostEntry) -> str:
    """The Python whose vLLM parser and packages preflight asks: the engine venv's, else the
    inventory's `python` (the host's vLLM venv by default)."""
    if m.engine is None:
        return entry.python
    return f"{venv_path(entry, lock_of(m.engine))}/bin/python"
