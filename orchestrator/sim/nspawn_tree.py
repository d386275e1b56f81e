"""The root tree that `--systemd` simulated hosts boot from: built once per machine, then cached.

Why a cache: debootstrap takes ~45 s, a boot ~1 s. Every container boots the same read-only tree
with `--volatile=overlay`, so a tree is never modified after it is built. The cache key is a hash
of the recipe below, so changing the recipe builds a new tree beside the old one.

Layout of `<cache_dir>/<recipe hash>/`:
    tree/            the Debian root (bookworm, minbase + systemd + sshd + python3 + sudo)
    id_ed25519[.pub] the key root logs in with (authorized in tree/root/.ssh/authorized_keys)
    build.json       recipe + how long the build took
The build runs in `<hash>/tree.building` under an exclusive flock on `<hash>.lock`, and is renamed
to `tree` only when complete, so parallel test workers wait for one build instead of racing.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_CACHE_DIR = Path("~/.cache/vllm-orch/nspawn").expanduser()
SUITE = "bookworm"
# libnuma1: vLLM's CPU build (the real vLLM of `sim up --systemd --real-vllm`) links it.
PACKAGES = ("systemd", "systemd-sysv", "dbus", "openssh-server", "python3", "python3-venv",
            "iproute2", "procps", "psmisc", "sudo", "libnuma1")
PIP_PACKAGES = ("huggingface_hub",)
VENV = "/opt/vllm"
# Paths inside the container that the inventory names; they point into the bound host folder
# (/opt/sim) so that the sim programs' Path(__file__).resolve().parent.parent is that folder.
SIM_MOUNT = "/opt/sim"
SIM_LINKS = {f"{VENV}/bin/vllm": f"{SIM_MOUNT}/bin/vllm",
             "/usr/local/bin/nvidia-smi": f"{SIM_MOUNT}/bin/nvidia-smi"}
RECIPE_VERSION = 1


class TreeBuildError(RuntimeError):
    """A build step failed; the message names the step and ends with its last output lines."""


def debian_mirror(sources_dir: Path = Path("/etc/apt")) -> str:
    """The Debian mirror this machine's apt uses (deb822 `.sources` or one-line `.list`)."""
    files = [sources_dir / "sources.list", *sorted((sources_dir / "sources.list.d").glob("*"))]
    for f in files:
        if not f.is_file() or not (f.name.endswith(".list") or f.name.endswith(".sources")):
            continue
        text = f.read_text(errors="replace")
        if f.name.endswith(".sources"):
            for stanza in re.split(r"\n\s*\n", text):
                fields = dict(re.findall(r"^([A-Za-z-]+):\s*(.*)$", stanza, re.M))
                suites = fields.get("Suites", "").split()
                if SUITE in suites and "deb" in fields.get("Types", "").split():
                    return fields["URIs"].split()[0]
        else:
            for line in text.splitlines():
                m = re.match(r"^\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)", line)
                if m and m.group(2) == SUITE:
                    return m.group(1)
    return "http://deb.debian.org/debian"


def recipe(mirror: str | None = None) -> dict:
    return {"version": RECIPE_VERSION, "suite": SUITE, "variant": "minbase",
            "packages": list(PACKAGES), "pip": list(PIP_PACKAGES), "venv": VENV,
            "links": SIM_LINKS, "mirror": mirror or debian_mirror()}


def recipe_hash(r: dict) -> str:
    return hashlib.sha256(json.dumps(r, sort_keys=True).encode()).hexdigest()[:12]


def tree_key_path(tree: Path) -> Path:
    """The private key that logs in as root to every container booted from `tree`."""
    return tree.parent / "id_ed25519"


def ensure_tree(cache_dir: Path = DEFAULT_CACHE_DIR, *, log=None) -> Path:
    """Return a complete tree for the current recipe, building it first if needed (root only)."""
    r = recipe()
    base = Path(cache_dir) / recipe_hash(r)
    tree = base / "tree"
    if (base / "build.json").is_file() and tree.is_dir():
        return tree
    base.mkdir(parents=True, exist_ok=True)
    with open(base.parent / f"{base.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # another worker may be building: wait for it
        if (base / "build.json").is_file() and tree.is_dir():
            return tree
        timings = _build(base, r, log or (lambda msg: print(msg, file=sys.stderr)))
        (base / "build.json").write_text(json.dumps({"recipe": r, "seconds": timings}, indent=1))
    return tree


def _build(base: Path, r: dict, log) -> dict[str, float]:
    work = base / "tree.building"
    if work.exists():
        shutil.rmtree(work)
    timings: dict[str, float] = {}

    t = time.monotonic()
    log(f"nspawn tree: debootstrap {r['suite']} from {r['mirror']} (about 45 s, once per machine)")
    _sh(["debootstrap", f"--variant={r['variant']}", "--include=" + ",".join(r["packages"]),
         r["suite"], str(work), r["mirror"]], "debootstrap", timeout=1800)
    timings["debootstrap"] = time.monotonic() - t

    t = time.monotonic()
    _install_venv(work, r)
    timings["venv"] = time.monotonic() - t

    t = time.monotonic()
    _configure(work, base, r)
    timings["configure"] = time.monotonic() - t

    tree = base / "tree"
    if tree.exists():
        shutil.rmtree(tree)
    work.rename(tree)
    log("nspawn tree: ready in " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))
    return timings


def _install_venv(work: Path, r: dict) -> None:
    """A venv standing in for the host's vLLM venv, with huggingface_hub from PyPI.

    Wheels are fetched by this machine's pip (its index settings may point at local folders the
    chroot cannot see) for the tree's Python version, then installed offline inside the chroot."""
    venv = r["venv"]
    _sh(["chroot", str(work), "python3", "-m", "venv", venv], "python3 -m venv in chroot")
    tree_py = subprocess.run(["chroot", str(work), f"{venv}/bin/python", "-c",
                              "import sys; print(f'{sys.version_info[0]}{sys.version_info[1]}')"],
                             capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(dir=work / "tmp") as wheels:
        _sh([sys.executable, "-m", "pip", "download", "-q", "-d", wheels, "--only-binary=:all:",
             "--python-version", tree_py, "--platform", "manylinux2014_x86_64",
             "--platform", "manylinux_2_28_x86_64", "--platform", "linux_x86_64",
             *r["pip"]], "pip download", timeout=600)
        inside = "/" + str(Path(wheels).relative_to(work))
        _sh(["chroot", str(work), f"{venv}/bin/pip", "install", "-q", "--no-index",
             "--no-cache-dir", "--find-links", inside, *r["pip"]], "pip install in chroot",
            timeout=600)


def _configure(work: Path, base: Path, r: dict) -> None:
    key = tree_key_path(work.parent / "tree")
    if not key.exists():
        _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "vllm-orch-nspawn",
             "-f", str(key)], "ssh-keygen")
    ssh_dir = work / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
    os.chmod(ssh_dir / "authorized_keys", 0o600)
    for inside, target in r["links"].items():
        link = work / inside.lstrip("/")
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    # A fresh machine id per boot; no fixed hostname (nspawn sets it from -M).
    (work / "etc/machine-id").write_text("")
    (work / "etc/hostname").unlink(missing_ok=True)
    # sshd answers faster without reverse DNS; the tree has no resolver anyway.
    (work / "etc/ssh/sshd_config.d").mkdir(exist_ok=True)
    (work / "etc/ssh/sshd_config.d/vllm-orch-sim.conf").write_text("UseDNS no\n")
    for pattern in ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*_*", "root/.cache"):
        for p in work.glob(pattern):
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _sh(argv: list[str], step: str, timeout: float = 300) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-8:]
        raise TreeBuildError(f"{step} exited {proc.returncode}: " + " | ".join(tail))
