"""An engine venv is built and checked as root on a real host, yet none of its code runs as root
(issue 42, "engine: runs code as root"): a wheel a manifest's `packages:` pins can carry a `.pth`
file, which every start of the venv's Python runs (`python -I` does not stop it). Here a wheel's
`.pth` appends the uid it ran with to a file; the build (uv, the verify), a forced re-verify, the
parser check (argcheck.py) and the package check (inspect_env.py) run it, and every uid recorded is
the service user's. Built by the REAL uv, offline, from simulated wheels (orchestrator/sim/engines.py);
runs as root, as CI does (a non-root run cannot switch users: nothing to prove there).
"""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from orchestrator.config.engine import lock_of
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Engine
from orchestrator.host import engine, scripts
from orchestrator.host.base import Script
from orchestrator.host.local import LocalHost
from orchestrator.sim import engines as sim_engines

UV = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
PY = f"{sys.version_info.major}.{sys.version_info.minor}"
USER = "nobody"                  # an unprivileged user every Debian has

pytestmark = [
    pytest.mark.skipif(UV is None, reason="uv is in the dev extra: ./dev test installs it"),
    pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root (CI runs as root)"),
]


@pytest.fixture
def world() -> tuple[Path, Path]:
    """A folder every user can enter (pytest's tmp_path is root's 0700), and in it the file the
    probe's .pth appends to (0666: whoever runs the venv's Python)."""
    top = Path(tempfile.mkdtemp(prefix="vllm-orch-engine-uid-", dir="/tmp"))
    top.chmod(0o755)
    ran = top / "uids.txt"
    ran.touch()
    ran.chmod(0o666)
    yield top, ran
    shutil.rmtree(top, ignore_errors=True)


def probe_wheel(folder: Path, ran: Path) -> None:
    """`uidprobe` 1.0: its .pth runs at every start of the venv's Python, as a hostile package's would."""
    line = f"import os; open({str(ran)!r}, 'a').write('%d\\n' % os.getuid())\n"
    sim_engines.make_wheel(folder, "uidprobe", "1.0", {"uidprobe/__init__.py": "", "uidprobe.pth": line})


def uids(ran: Path) -> list[int]:
    return [int(x) for x in ran.read_text().split()]


def test_the_build_the_verify_the_parser_and_the_package_check_run_the_venvs_code_as_the_service_user(world):
    top, ran = world
    house = sim_engines.wheelhouse(top / "wheelhouse")
    probe_wheel(house, ran)
    nobody = pwd.getpwnam(USER).pw_uid
    e = HostEntry.model_validate({
        "name": "h", "address": "local", "service_manager": "process", "service_user": USER,
        "models_root": str(top / "models"), "state_dir": str(top / "state"), "python": sys.executable,
        "engines_root": str(top / "engines"), "uv": UV, "wheelhouse": str(house)})
    lock = lock_of(Engine.model_validate({"vllm": "0.33.0", "torch": sim_engines.TORCH, "python": PY,
                                          "flashinfer": sim_engines.FLASHINFER,
                                          "packages": {"uidprobe": "1.0"}}))
    host = LocalHost("h")
    steps: list[dict] = []
    done = engine.build(host, e, lock, on_event=steps.append)
    assert done.get("built") is True and done.get("vllm_version") == "0.33.0", done
    installs = [s for s in steps if str(s.get("what", "")).startswith("uv ")]
    assert installs and all(s.get("user") == USER for s in installs), installs    # uv ran as the user
    after_build = uids(ran)
    assert after_build and set(after_build) == {nobody}, after_build          # the verify's Pythons

    venv = Path(e.engines_root) / lock.name
    owners = {p.lstat().st_uid for p in [venv, *venv.rglob("*")]}
    assert owners == {0}, owners                           # root's again before anything in it ran
    writable = [p for p in venv.rglob("*") if not p.is_symlink() and p.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)]
    assert not writable, writable[:3]
    for shared in (".uv-cache", ".python"):                # uv's cache and Pythons: root's again too
        folder = Path(e.engines_root) / shared
        assert {p.lstat().st_uid for p in [folder, *folder.rglob("*")]} == {0}, shared

    state = engine.check(host, e, lock, force=True)        # --verify-engine: the full verify again
    assert state.ok and state.verified == "now", state
    python = str(venv / "bin" / "python")
    answer, result = scripts.run_json(host, python, "inspect_env.py", user=USER)
    assert answer is not None, result.stderr
    parsed, result = scripts.run_json(host, python, "argcheck.py",
                                      [json.dumps({"argv": ["serve", "org/m", "--port", "8000"], "env": {}})],
                                      user=USER)
    assert parsed is not None and parsed.get("ok") is True, (parsed, result.stderr)
    seen = uids(ran)
    assert len(seen) > len(after_build) + 2 and set(seen) == {nobody}, seen    # never uid 0


def test_before_the_service_user_exists_the_venvs_code_runs_as_nobody_never_as_root(world):
    """A fresh host's preflight runs before the plan's `user` step makes the service user."""
    top, ran = world
    line = f"import os; open({str(ran)!r}, 'a').write('%d\\n' % os.getuid())"
    r = LocalHost("h").run(Script(scripts.as_user("no-such-user-42") + "/usr/bin/python3 -c " + shlex.quote(line)),
                           timeout=30)
    assert r.exit_code == 0, r.stderr
    assert uids(ran) == [pwd.getpwnam("nobody").pw_uid], uids(ran)
