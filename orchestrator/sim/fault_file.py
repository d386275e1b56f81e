"""`<hostdir>/faults.json`: pending faults `[{"fault": NAME, "model": NAME|null, ...}]`.

Shared by whoever adds faults (`vllm-orch sim fault`) and whoever consumes them (the simulated vLLM,
the Hub mirror). Every read-modify-write holds an exclusive flock on `<hostdir>/faults.json.lock`
and replaces the file atomically (in place where the folder is not the writer's), so two consumers
never both take a one-shot fault.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

FAULTS = "faults.json"


@contextlib.contextmanager
def _locked(hostdir: Path) -> Iterator[None]:
    fd = os.open(hostdir / (FAULTS + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # closing releases the lock


def _read(hostdir: Path) -> list[dict]:
    try:
        data = json.loads((hostdir / FAULTS).read_text() or "[]")
    except FileNotFoundError:
        return []
    except (OSError, ValueError):
        return []
    return [e for e in data if isinstance(e, dict) and "fault" in e] if isinstance(data, list) else []


def _write(hostdir: Path, entries: list[dict]) -> None:
    """Atomically; where the folder is not ours (a systemd SIMULATED host's is root's and only the
    file is shared), in place, under the lock every writer holds."""
    text = json.dumps(entries, indent=1) + "\n"
    tmp = hostdir / f".{FAULTS}.{os.getpid()}.tmp"
    try:
        tmp.write_text(text)
        with contextlib.suppress(OSError):          # keep the file's mode (shared: 0666)
            tmp.chmod((hostdir / FAULTS).stat().st_mode & 0o7777)
        os.replace(tmp, hostdir / FAULTS)
    except PermissionError:
        with open(hostdir / FAULTS, "r+") as f:
            f.write(text)
            f.truncate()


def add_fault(hostdir: str | Path, fault: str, model: str | None = None, **extra) -> None:
    hostdir = Path(hostdir)
    with _locked(hostdir):
        entries = _read(hostdir)
        entries.append({"fault": fault, "model": model, **extra})
        _write(hostdir, entries)


def clear_faults(hostdir: str | Path, prefix: str = "") -> None:
    """Remove every fault whose name starts with `prefix` (all of them by default)."""
    hostdir = Path(hostdir)
    with _locked(hostdir):
        _write(hostdir, [e for e in _read(hostdir) if not str(e["fault"]).startswith(prefix)])


def take_fault(hostdir: str | Path, match: Callable[[dict], bool], *, consume: bool = True) -> dict | None:
    """The first pending fault for which match(entry) is true; removed from the file if `consume`.
    Cheap when the file is absent (no lock taken)."""
    hostdir = Path(hostdir)
    if not (hostdir / FAULTS).exists():
        return None
    with _locked(hostdir):
        entries = _read(hostdir)
        for i, entry in enumerate(entries):
            if match(entry):
                if consume:
                    del entries[i]
                    _write(hostdir, entries)
                return entry
    return None
