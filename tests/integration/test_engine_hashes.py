"""An engine with a hashed lock (`engine.lock_file`, what `uv pip compile --generate-hashes` writes)
is installed with uv's --require-hashes (issue 42, "hashes required in the lock"): built by the REAL
uv, offline, from simulated wheels (orchestrator/sim/engines.py). The lock is compiled here by the
real uv too. A wheel of the wheelhouse replaced by other bytes under the same name and version (a
tampered mirror) installs without the lock, and is refused with it, nothing installed; a lock that
lacks a dependency the install needs is refused."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from orchestrator.config.engine import lock_of
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Engine, load_manifest
from orchestrator.errors import DeployFailed
from orchestrator.host import engine
from orchestrator.host.local import LocalHost
from orchestrator.sim import engines as sim_engines

UV = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
PY = f"{sys.version_info.major}.{sys.version_info.minor}"
# as root the build's uv runs as the service user (an unprivileged one every Debian has)
USER = "nobody" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
PINS = {"vllm": "0.33.0", "torch": sim_engines.TORCH, "python": PY}

pytestmark = pytest.mark.skipif(UV is None, reason="uv is in the dev extra: ./dev test installs it")


@pytest.fixture
def top() -> Path:
    """A folder the service user can enter (pytest's tmp_path is root's 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="vllm-orch-engine-hashes-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def compile_lock(top: Path, house: Path, pins: list[str]) -> str:
    """The real uv's hashed lock of these pins, from the wheelhouse."""
    (top / "req.in").write_text("\n".join(pins) + "\n")
    r = subprocess.run([UV, "pip", "compile", "--generate-hashes", "--offline", "--no-index", "--find-links",
                        str(house), "--python-version", PY, "--no-header", "-q", str(top / "req.in")],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, UV_NO_CONFIG="1"))
    assert r.returncode == 0, r.stderr
    return r.stdout


def manifest_with_lock(top: Path, text: str, **engine_fields):
    models = top / "models-manifests"
    models.mkdir(exist_ok=True)
    (models / "tiny.lock").write_text(text)
    data = {"source": {"repo": "org/tiny"}, "serving": {"gpus": 1},
            "engine": {**PINS, **engine_fields, "lock_file": "tiny.lock"}}
    (models / "tiny.yaml").write_text(yaml.safe_dump(data))
    return load_manifest(models / "tiny.yaml")


def host_entry(top: Path, house: Path) -> HostEntry:
    return HostEntry.model_validate({
        "name": "h", "address": "local", "service_manager": "process", "service_user": USER,
        "models_root": str(top / "models"), "state_dir": str(top / "state"), "python": sys.executable,
        "engines_root": str(top / "engines"), "uv": UV, "wheelhouse": str(house)})


def tamper(house: Path, name: str) -> None:
    """Another wheel of the same name and version, with other bytes (what a tampered mirror serves)."""
    wheel = next(house.glob(f"{name}-*.whl"))
    other = house.parent / "other"
    other.mkdir(exist_ok=True)
    version = wheel.name.split("-")[1]
    sim_engines.make_wheel(other, name, version, {f"{name}/__init__.py": "print('not the locked bytes')\n"})
    made = next(other.glob(f"{name}-*.whl"))
    assert made.name == wheel.name and made.read_bytes() != wheel.read_bytes()
    shutil.move(made, wheel)


def test_a_hashed_lock_builds_and_a_tampered_wheel_or_a_missing_dependency_is_refused(top):
    house = sim_engines.wheelhouse(top / "wheelhouse")
    flashinfer = f"flashinfer-python=={sim_engines.FLASHINFER}"
    text = compile_lock(top, house, ["vllm==0.33.0", f"torch=={sim_engines.TORCH}", flashinfer])
    e, host = host_entry(top, house), LocalHost("h")

    m = manifest_with_lock(top, text)
    lock = lock_of(m.engine)
    assert lock.hashed and all("--hash=sha256:" in line for line in lock.requirements), lock.requirements
    steps: list[dict] = []
    done = engine.build(host, e, lock, on_event=steps.append)
    assert done.get("built") is True and done.get("vllm_version") == "0.33.0", done
    assert any("hashes required" in str(s.get("what", "")) for s in steps), steps
    assert engine.check(host, e, lock).ok

    tamper(house, "torch")
    shutil.rmtree(Path(e.engines_root))              # a fresh host: uv's cache holds the good wheel
    with pytest.raises(DeployFailed) as refused:
        engine.build(host, e, lock)
    assert "Hash mismatch for `torch" in refused.value.message, refused.value.message
    assert "differ from the engine's lock_file" in (refused.value.hint or "")
    assert not (Path(e.engines_root) / lock.name).exists()           # nothing left half-installed

    # the same tampered wheelhouse, without the lock: uv installs the other bytes
    unlocked = lock_of(Engine.model_validate({**PINS, "flashinfer": sim_engines.FLASHINFER}))
    engine.build(host, e, unlocked)
    torch_init = next((Path(e.engines_root) / unlocked.name).rglob("torch/__init__.py"))
    assert "not the locked bytes" in torch_init.read_text()

    # a lock without flashinfer-python, which the vLLM wheel requires: refused before installing
    lines = [ln for ln in lock.requirements if not ln.startswith("flashinfer")]
    missing = manifest_with_lock(top, "\n".join(lines) + "\n")
    house2 = sim_engines.wheelhouse(top / "wheelhouse2")
    with pytest.raises(DeployFailed) as refused:
        engine.build(host, host_entry(top, house2).model_copy(update={"engines_root": str(top / "engines2")}),
                     lock_of(missing.engine))
    message = refused.value.message
    assert "no trusted hash was provided" in message and "`flashinfer-python`" in message, message
    assert "lacks a package" in (refused.value.hint or "")
