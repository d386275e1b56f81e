"""Engine venvs (a manifest's `engine:`) on a SIMULATED host, built by the REAL uv, offline, from a
wheelhouse the controller uploads (small simulated wheels made here: orchestrator/sim/engines.py; no
network): a deploy builds its venv and runs from it; two services on one host run two vLLM versions
(each with its version's flags and log lines); an upgrade whose new engine dies after loading rolls
back to the old venv; an engine the new venv's own checks refuse fails before anything stops; gc
removes the venv no service uses."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from orchestrator.config.engine import lock_of
from orchestrator.config.manifest import Manifest
from orchestrator.config.placement import Request
from orchestrator.host import http
from orchestrator.host.state import read_records
from orchestrator.ops.status import host_status
from orchestrator.ops.stop import gc_plan, run_gc
from orchestrator.plan.inputs import LockFacts
from orchestrator.sim import engines as sim_engines

from .deployhelp import SHIPPED, deploy, entry, free_port, statuses, swap

MM = "minimax-m25"             # TP4: GPUs 0-3 by its manifest
UV = shutil.which("uv", path=str(Path(os.sys.executable).parent)) or shutil.which("uv")
PY = f"{os.sys.version_info.major}.{os.sys.version_info.minor}"   # a Python uv finds on this machine
pytestmark = pytest.mark.skipif(UV is None, reason="uv is in the dev extra: ./dev test installs it")


OLD_TORCH, OLD_FLASHINFER = "2.13.0+cu130", "0.6.14"       # the older simulated versions' (they require none)


def with_engine(vllm: str, *, name: str = MM, port: int | None = None, flashinfer: str | None = "",
                torch: str = "") -> Manifest:
    """A manifest whose engine pins `vllm` with the torch and flashinfer its wheel requires (0.33.0:
    sim_engines.REQUIRES, as the real wheel's METADATA), else the older pair; None: no flashinfer pin."""
    new = vllm in sim_engines.REQUIRES
    torch = torch or (sim_engines.TORCH if new else OLD_TORCH)
    if flashinfer == "":
        flashinfer = sim_engines.FLASHINFER if new else OLD_FLASHINFER
    data = SHIPPED[MM].model_dump()
    data["name"], data["serving"]["port"] = name, port or free_port()
    data["serving"]["served_model_name"] = name
    data["engine"] = {"vllm": vllm, "torch": torch, "python": PY,
                      **({"flashinfer": flashinfer} if flashinfer else {})}
    return Manifest.model_validate(data)


@pytest.fixture
def wheels(tmp_path) -> Path:
    """The controller's wheelhouse: simulated vLLM 0.24.0 and 0.33.0, the torch and flashinfer each
    requires (2.14.0 and 0.7.2.post1 for 0.33.0, as its real METADATA; 2.13.0 and 0.6.14); and
    vLLM 0.26.0 whose wheel pulls flashinfer-python 0.6.14 with flashinfer-cubin 0.6.13 (the pair
    vllm #49804 saw mismatched on 0.26.0)."""
    house = sim_engines.wheelhouse(tmp_path / "wheelhouse", ("0.24.0", "0.33.0"))
    sim_engines.torch_wheel(house, OLD_TORCH)
    sim_engines.flashinfer_wheels(house, OLD_FLASHINFER)
    sim_engines.flashinfer_wheels(house, "0.6.13")
    sim_engines.vllm_wheel(house, "0.26.0", requires=["flashinfer-python==0.6.14", "flashinfer-cubin==0.6.13"])
    return house


def host_entry(sim_host, wheels: Path, **more):
    """The host with its engines under its folder, built by this machine's uv from `wheels`. Without
    the simulator's PYTHONPATH (the host folder's faked packages): an engine venv has its own."""
    env = {k: v for k, v in sim_host.entry["env"].items() if k != "PYTHONPATH"}
    return entry(sim_host, engines_root=str(sim_host.dir / "engines"), uv=UV, wheelhouse=str(wheels), env=env,
                 **more)


def venv_of(sim_host, m: Manifest) -> Path:
    assert m.engine is not None
    return sim_host.dir / "engines" / lock_of(m.engine).name


def version_at(sim_host, port: int) -> str:
    return http.request(sim_host.host, port, "GET", "/version", timeout=5).json()["version"]


def test_deploy_builds_the_engine_offline_from_the_uploaded_wheelhouse_and_runs_from_it(sim_host, wheels):
    e = host_entry(sim_host, wheels)
    m = with_engine("0.33.0")
    res = deploy(e, m)
    assert res.ok, res.error
    assert statuses(res)["engine"] == "done"
    venv = venv_of(sim_host, m)
    assert f"it can run {venv}/bin/vllm" in res.plan.text()         # preflight's service-user check
    marker = json.loads((venv / "vllm-orch-engine.json").read_text())
    assert marker["hash"] == lock_of(m.engine).hash and marker["vllm_version"] == "0.33.0"     # type: ignore[arg-type]
    assert sorted(p.name for p in (sim_host.dir / "engines" / ".wheelhouse").iterdir()) == \
        sorted(p.name for p in wheels.iterdir())
    writable = [p for p in venv.rglob("*") if not p.is_symlink() and p.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)]
    assert not writable, writable[:3]
    rec = read_records(sim_host.host, e)[MM]
    assert rec.engine == venv.name and rec.vllm_version == "0.33.0"
    unit = (sim_host.dir / "units" / f"vllm-{MM}.sh").read_text()
    assert f"{venv}/bin/vllm" in unit
    pid = int((sim_host.dir / "state" / "run" / f"vllm-{MM}.pid").read_text().split()[0])
    assert str(venv) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    row = next(s for s in host_status(e).services if s.name == MM)
    assert (row.vllm_version, row.engine) == ("0.33.0", venv.name)
    again = deploy(e, m)
    assert again.ok and statuses(again)["engine"] == "skipped"


def test_a_lock_with_another_torch_than_the_vllm_wheel_requires_fails_its_build_before_anything_stops(sim_host,
                                                                                                       wheels):
    """vllm-0.33.0's METADATA requires torch==2.14.0 (so does its simulated wheel): a manifest that
    pins torch 2.13.0 does not resolve, and the deploy fails at the engine step with uv's reason,
    before anything starts."""
    e = host_entry(sim_host, wheels)
    m = with_engine("0.33.0", torch=OLD_TORCH)
    res = deploy(e, m)
    assert not res.ok and res.error is not None and res.error.step == "engine", res.error
    assert "did not build" in res.error.message and "torch" in res.error.message, res.error.message
    assert "unsatisfiable" in res.error.message, res.error.message
    assert statuses(res).get("start") != "done"
    assert not read_records(sim_host.host, e).get(MM)


def test_a_wheel_url_builds_offline_from_the_wheelhouse_copy_of_that_wheel(sim_host, wheels):
    """`engine.vllm: https://.../vllm-0.33.0-py3-none-any.whl` on a host that builds offline from
    the wheelhouse (uv --offline fetches no URL): the wheelhouse's file of that name is installed;
    a URL whose wheel the wheelhouse lacks is refused when the plan is made (exit 2, one line), and
    so is one outside the host's wheel_url_prefixes (root's uv would install what it names)."""
    from orchestrator.errors import ConfigError

    pins = {"torch": sim_engines.TORCH, "flashinfer": sim_engines.FLASHINFER}      # what 0.33.0 requires
    elsewhere = with_engine("https://wheels.example.invalid/other/vllm-0.33.0-py3-none-any.whl", **pins)
    for e in (host_entry(sim_host, wheels), host_entry(sim_host, wheels, wheel_url_prefixes=[
            "https://wheels.example.invalid/vllm/"])):
        with pytest.raises(ConfigError) as outside:
            deploy(e, elsewhere, dry_run=True)
        assert "is not under the host sim's wheel_url_prefixes" in outside.value.message, outside.value
        assert outside.value.exit_code == 2 and "\n" not in str(outside.value)
    assert not (sim_host.dir / "engines").exists() or not any((sim_host.dir / "engines").glob("vllm-*"))
    e = host_entry(sim_host, wheels, wheel_url_prefixes=["https://wheels.example.invalid/vllm/"])
    missing = with_engine("https://wheels.example.invalid/vllm/vllm-0.33.0%2Bcu130-py3-none-any.whl", **pins)
    with pytest.raises(ConfigError) as refused:         # the CLI's one error boundary: exit 2, one line
        deploy(e, missing, dry_run=True)
    assert "has no vllm-0.33.0+cu130-py3-none-any.whl" in refused.value.message, refused.value
    assert refused.value.exit_code == 2
    m = with_engine("https://wheels.example.invalid/vllm/vllm-0.33.0-py3-none-any.whl", **pins)
    res = deploy(e, m)
    assert res.ok, res.error
    assert read_records(sim_host.host, e)[MM].vllm_version == "0.33.0"




def test_an_sdist_for_a_pinned_package_is_refused_and_its_setup_py_never_runs(sim_host, wheels):
    """`packages:` pins a package the host's find-links folder has only as an sdist (a .tar.gz):
    uv would build it, running its setup.py as the build's user (root on a real host). Built with
    --no-build, uv refuses it, and the engine step fails naming the package (uv's own words)."""
    e = host_entry(sim_host, wheels)
    ran = sim_host.dir / "sdist-ran.jsonl"
    sim_engines.sdist(sim_host.dir / "engines" / ".wheelhouse", "evilpkg", "1.0", ran)
    m = with_engine("0.33.0")
    data = m.model_dump()
    data["engine"]["packages"] = {"evilpkg": "1.0"}
    m = Manifest.model_validate(data)
    res = deploy(e, m)
    assert not ran.exists(), ran.read_text()                        # its setup.py never ran
    assert not res.ok and res.error is not None and res.error.step == "engine", res.error
    assert "did not build" in res.error.message and "evilpkg" in res.error.message, res.error.message
    assert "building from source is disabled" in res.error.message, res.error.message     # uv's hint
    assert "wheels only" in (res.error.hint or ""), res.error.hint
    assert statuses(res).get("start") != "done"
    assert not venv_of(sim_host, m).exists()


def test_two_services_on_one_host_run_two_vllm_versions_each_with_its_flags_and_lines(sim_host, wheels):
    e = host_entry(sim_host, wheels)
    new, old = with_engine("0.33.0"), with_engine("0.24.0", name="mm-old")
    assert deploy(e, new).ok
    res = deploy(e, old, request=Request(None, (4, 5, 6, 7), old.serving.port))
    assert res.ok, res.error
    assert version_at(sim_host, new.serving.port) == "0.33.0"
    assert version_at(sim_host, old.serving.port) == "0.24.0"
    logs = {n: (sim_host.dir / "logs" / f"vllm-{n}.log").read_text() for n in (MM, "mm-old")}
    assert "[entry.py:139] Starting vLLM server on" in logs[MM]
    assert "[api_server.py:581] Starting vLLM server on" in logs["mm-old"]
    rows = {s.name: s.vllm_version for s in host_status(e).services}
    assert rows == {MM: "0.33.0", "mm-old": "0.24.0"}
    assert venv_of(sim_host, new) != venv_of(sim_host, old)


def test_an_upgrade_that_dies_after_loading_rolls_back_to_the_old_venv_and_gc_removes_the_new(sim_host, wheels):
    e = host_entry(sim_host, wheels)
    old = with_engine("0.24.0")
    assert deploy(e, old).ok
    ep_port = old.serving.port
    # the new lock leaves flashinfer to vLLM 0.26.0's own requirements: a mismatched pair. Its own
    # check (package-pairs, asked of the new venv by the engine step) refuses it before anything stops
    new = with_engine("0.26.0", port=ep_port, flashinfer=None)
    refused = swap(e, new, {MM: new})
    assert not refused.ok and refused.error is not None and refused.error.step == "engine"
    assert "package-pairs" in refused.error.message, refused.error.message
    assert "stop" not in statuses(refused) and version_at(sim_host, ep_port) == "0.24.0"
    # skipped, the start dies after loading (flashinfer's RuntimeError) and the swap rolls back
    res = swap(e, new, {MM: new}, skip_checks=frozenset({"package-pairs"}))
    assert not res.ok
    assert res.outcome is not None and res.outcome.recovery is not None and res.outcome.recovery.ok, res.outcome
    assert "flashinfer" in str(res.error)
    assert version_at(sim_host, ep_port) == "0.24.0"
    assert read_records(sim_host.host, e)[MM].engine == venv_of(sim_host, old).name
    assert f"{venv_of(sim_host, old)}/bin/vllm" in (sim_host.dir / "units" / f"vllm-{MM}.sh").read_text()
    assert venv_of(sim_host, new).is_dir()                  # built, kept until gc
    plan = gc_plan(sim_host.host, e, LockFacts(held=True))
    assert plan.info["delete_engines"] == [venv_of(sim_host, new).name]
    record = run_gc(sim_host.host, e, plan)
    assert record["ok"], record
    assert not venv_of(sim_host, new).exists() and venv_of(sim_host, old).is_dir()


def engine_runs(sim_host) -> dict[str, int]:
    """What the engine check ran in the host's simulated venvs: `vllm --version`, and the verify's
    `python -I -c` (each imports vllm: the simulated one logs it, orchestrator/sim/engines.py)."""
    path = sim_host.dir / "logs" / sim_engines.IMPORTS
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {"vllm --version": sum(1 for x in lines if x["argv"][1:2] == ["--version"]),
            "verify": sum(1 for x in lines if x["argv"][:1] == ["-c"])}


def engine_step(res) -> str:
    return next(a.summary for a in res.plan.actions if a.step == "engine")


def test_a_redeploy_trusts_the_recorded_verdict_and_a_reinstall_or_a_garbled_verdict_re_verifies(sim_host, wheels):
    e = host_entry(sim_host, wheels)
    m = with_engine("0.33.0")
    assert deploy(e, m).ok
    assert engine_runs(sim_host) == {"vllm --version": 1, "verify": 1}          # the build's own verify
    venv = venv_of(sim_host, m)
    assert json.loads((venv / "vllm-orch-verified.json").read_text())["vllm_version"] == "0.33.0"

    def redeploy(ran: int, **kw) -> str:
        before = engine_runs(sim_host)
        res = deploy(e, m, **kw)
        assert res.ok, res.error
        assert statuses(res)["engine"] == "skipped"
        assert engine_runs(sim_host) == {k: v + ran for k, v in before.items()}, engine_step(res)
        return engine_step(res)

    step = redeploy(0)                    # the second deploy imports vllm nowhere in the engine check
    assert "verified earlier, unchanged" in step and "--verify-engine" in step, step
    # vLLM reinstalled in the venv by the real uv (the same wheel): a new dist-info folder
    site = next(venv.glob("lib/python*/site-packages"))
    dist_before = (site / "vllm-0.33.0.dist-info").stat().st_ctime_ns
    subprocess.run([UV, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "--reinstall-package",
                    "vllm", "--offline", "--no-index", "--find-links", str(wheels), "vllm==0.33.0"], check=True,
                   env=dict(os.environ, UV_CACHE_DIR=str(sim_host.dir / "engines" / ".uv-cache"), UV_NO_CONFIG="1"))
    assert (site / "vllm-0.33.0.dist-info").stat().st_ctime_ns != dist_before     # (its inode may be reused)
    step = redeploy(1)
    assert "the full check" in step and "the venv changed since it was verified" in step, step
    assert "verified earlier, unchanged" in redeploy(0)
    (venv / "vllm-orch-verified.json").write_text('{"hash": "garbled')           # cut short, say
    step = redeploy(1)
    assert "the full check" in step and "does not parse" in step, step
    step = redeploy(1, verify_engine=True)
    assert "the full check" in step and "--verify-engine" in step, step
    assert "verified earlier, unchanged" in redeploy(0)
