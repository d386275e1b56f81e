"""Check a rendered systemd unit with the real `systemd-analyze verify`, on a machine that has
neither the unit's ExecStart binary nor a running systemd.

Why a temporary root: verify fails when the ExecStart binary is missing ("Command ... is not
executable") and needs the standard units (sysinit.target...) to resolve dependencies. So each
check builds a throwaway root holding a copy of the system's unit folder (~1 MB, ~20 ms), the unit
under test in etc/systemd/system, and an executable stub at every path the unit runs.
An unknown key or a bad value only warns (exit code 0), so `ok` also requires empty stderr.

    ok, stderr = verify_unit(unit_text, ["/opt/vllm/bin/vllm"], unit_name="vllm-kimi.service")
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

SYSTEM_UNITS = Path("/usr/lib/systemd/system")


def available() -> str | None:
    """None when verify_unit can run here, else why not (for test skips)."""
    if not shutil.which("systemd-analyze"):
        return "systemd-analyze not found (apt-get install systemd)"
    if not SYSTEM_UNITS.is_dir():
        return f"{SYSTEM_UNITS} missing (no systemd units on this machine)"
    return None


def verify_unit(unit_text: str, exec_binary_paths: list[str], *,
                unit_name: str = "vllm-orch-check.service",
                extra_files: dict[str, str] | None = None,
                units_from: Path = SYSTEM_UNITS, timeout: float = 30.0) -> tuple[bool, str]:
    """(ok, stderr with the temporary root's prefix removed). `extra_files` maps absolute paths to
    contents placed in the root too (e.g. an EnvironmentFile)."""
    reason = available()
    if reason:
        return False, reason
    with tempfile.TemporaryDirectory(prefix="vllm-orch-unitcheck-") as tmp:
        root = Path(tmp)
        shutil.copytree(units_from, root / "usr/lib/systemd/system", symlinks=True)
        unit = root / "etc/systemd/system" / unit_name
        unit.parent.mkdir(parents=True, exist_ok=True)
        unit.write_text(unit_text)
        for path in exec_binary_paths:
            stub = root / path.lstrip("/")
            stub.parent.mkdir(parents=True, exist_ok=True)
            stub.write_text("#!/bin/sh\nexit 0\n")
            stub.chmod(0o755)
        for path, content in (extra_files or {}).items():
            f = root / path.lstrip("/")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(content)
        proc = subprocess.run(["systemd-analyze", "verify", f"--root={root}", unit_name],
                              capture_output=True, text=True, timeout=timeout)
        stderr = (proc.stderr + proc.stdout).replace(str(root), "").strip()
    return proc.returncode == 0 and not stderr, stderr
