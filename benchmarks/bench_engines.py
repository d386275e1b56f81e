"""Figures for engine venvs (issue 30). Prints, does not assert.

  python benchmarks/bench_engines.py [--runs 3] [--real-wheel PATH]

- build time of an engine venv by the real uv, offline from an uploaded wheelhouse (the SIMULATED
  wheels of orchestrator/sim/engines.py: what vllm-orch and uv themselves cost, with the script's
  verification): cold (upload + empty uv cache), and warm (wheels on the host, uv's cache filled)
- with --real-wheel (a real vLLM wheel on disk, e.g. from `pip download --no-deps vllm==0.24.0`):
  uv installing it alone into a venv from a warm cache, and the venv's size
- an upgrade swap on a SIMULATED host (the same model, engine 0.24.0 -> 0.33.0): downtime (the
  restart -> the gates passed), and a failed upgrade's rollback time
- disk per venv: the simulated ones, and the machine's cached real venvs (~/.cache/vllm-orch)
- the engine check on every deploy: a no-op redeploy of an engine service on a SIMULATED host and the
  check alone, with the verdict recorded by an earlier check trusted (the default) and with the full
  check (--verify-engine, what every deploy ran before the verdict); with --real-venv, the check
  alone on vLLM's CPU build (the real_vllm cache), full and trusted, and a no-op redeploy of the tiny
  model it serves as an engine service
- preflight's parser check on every deploy: the same no-op redeploys with vLLM's parser answer the
  venv kept reused (the default) and asked again (the kept answer removed first: what every deploy
  ran before answers were kept), the parser checks on (a simulated host skips them by default)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from orchestrator.config.engine import lock_of  # noqa: E402
from orchestrator.config.inventory import HostEntry  # noqa: E402
from orchestrator.config.manifest import Engine, Manifest  # noqa: E402
from orchestrator.host import engine as host_engine  # noqa: E402
from orchestrator.host.local import LocalHost  # noqa: E402
from orchestrator.host.remote.engine import ARGCHECK  # noqa: E402
from orchestrator.sim import engines as sim_engines  # noqa: E402
from orchestrator.sim import manager  # noqa: E402
from tests.integration.deployhelp import SHIPPED, deploy, free_port, swap  # noqa: E402
from tests.integration.test_engine_verdict_real_vllm import linked_engine  # noqa: E402

UV = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
PY = f"{sys.version_info.major}.{sys.version_info.minor}"


def du(path: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*") if not p.is_symlink()) if path.exists() else 0


def sim_entry(home: Path, wheels: Path) -> HostEntry:
    os.environ["VLLM_ORCH_STATE_HOME"] = str(home.parent)
    manager.up(1, speed=2000.0, home=home)
    raw = manager.inventory_hosts(home)["sim"]
    env = {k: v for k, v in raw["env"].items() if k != "PYTHONPATH"}
    hdir = manager.host_dir("sim", home)
    return HostEntry.model_validate({**raw, "name": "sim", "env": env, "engines_root": str(hdir / "engines"),
                                     "uv": UV, "wheelhouse": str(wheels)})


def builds(tmp: Path, wheels: Path, runs: int) -> None:
    entry = sim_entry(tmp / "sim-build", wheels)
    host = LocalHost("sim", env=entry.env)
    try:
        cold, warm = [], []
        lock = lock_of(Engine(vllm="0.33.0", torch="2.13.0+cu130", flashinfer="0.6.14", python=PY))
        size = 0
        for i in range(runs):      # the first run is cold (nothing uploaded, no uv cache); then warm
            t0 = time.monotonic()
            done = host_engine.build(host, entry, lock)
            (cold if i == 0 else warm).append(time.monotonic() - t0)
            size = int(done.get("bytes") or 0)
            host_engine.remove(host, entry, lock.name)          # the next run builds it again
        print(f"engine venv from the uploaded wheelhouse (simulated wheels, {len(list(wheels.iterdir()))} files, "
              f"{du(wheels) / 1e6:.1f} MB): cold {cold[0]:.2f} s (upload + empty uv cache); warm "
              + (f"median {statistics.median(warm):.2f} s over {len(warm)}" if warm else "(no runs)")
              + f"; venv {size / 1e6:.1f} MB")
    finally:
        manager.down(tmp / "sim-build")


def real_wheel(tmp: Path, wheel: Path) -> None:
    venv = tmp / "real-venv"
    env = dict(os.environ, UV_CACHE_DIR=str(tmp / "uv-cache"))
    subprocess.run([UV, "venv", "-q", "--python", PY, str(venv)], check=True, env=env)
    t0 = time.monotonic()
    subprocess.run([UV, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "--no-deps",
                    "--link-mode", "copy", str(wheel)], check=True, env=env)
    cold = time.monotonic() - t0
    shutil.rmtree(venv)
    subprocess.run([UV, "venv", "-q", "--python", PY, str(venv)], check=True, env=env)
    t0 = time.monotonic()
    subprocess.run([UV, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), "--no-deps",
                    "--link-mode", "copy", str(wheel)], check=True, env=env)
    warm = time.monotonic() - t0
    print(f"real wheel {wheel.name} ({wheel.stat().st_size / 1e6:.0f} MB) alone, --no-deps: cold {cold:.1f} s, "
          f"warm uv cache {warm:.1f} s; venv {du(venv) / 1e9:.2f} GB")


def upgrade(tmp: Path, wheels: Path, runs: int) -> None:
    entry = sim_entry(tmp / "sim-upgrade", wheels)

    def manifest(vllm: str, port: int, flashinfer: str | None = "0.6.14") -> Manifest:
        data = SHIPPED["minimax-m25"].model_dump()
        data["serving"]["port"] = port
        data["engine"] = {"vllm": vllm, "torch": "2.13.0+cu130", "python": PY,
                          **({"flashinfer": flashinfer} if flashinfer else {})}
        return Manifest.model_validate(data)

    try:
        port = free_port()
        downtime, rollback = [], []
        for _ in range(runs):
            old, new = manifest("0.24.0", port), manifest("0.33.0", port)
            assert deploy(entry, old).ok
            res = swap(entry, new, {new.name: new})
            assert res.ok, res.error
            downtime.append(res.extra["downtime_s"])
            bad = manifest("0.26.0", port, flashinfer=None)
            res = swap(entry, bad, {bad.name: bad}, skip_checks=frozenset({"package-pairs"}))
            assert not res.ok and res.outcome is not None and res.outcome.recovery is not None
            rollback.append(res.outcome.recovery.seconds)
        print(f"upgrade swap minimax-m25 engine 0.24.0 -> 0.33.0 (SIMULATED, speed 2000): downtime median "
              f"{statistics.median(downtime):.2f} s over {runs} (a restart: stop + load + gates)")
        print(f"failed upgrade (0.26.0, a mismatched flashinfer pair, check skipped): rollback median "
              f"{statistics.median(rollback):.2f} s over {runs} (stop, restore, start, gates)")
        engines = Path(entry.engines_root)
        for v in sorted(p for p in engines.iterdir() if p.name.startswith("vllm-")):
            print(f"  disk: {v.name}: {du(v) / 1e6:.1f} MB (simulated wheels)")
    finally:
        manager.down(tmp / "sim-upgrade")


def median_s(times: list[float]) -> str:
    return f"median {statistics.median(times):.3f} s over {len(times)} (min {min(times):.3f}, max {max(times):.3f})"


def parser_on(entry: HostEntry) -> HostEntry:
    """The entry with preflight's parser checks (flags, env) on."""
    return entry.model_copy(update={"skip_checks": [c for c in entry.skip_checks if c not in ("flags", "env")]})


def forget_parser(entry: HostEntry, m: Manifest) -> None:
    """Remove the parser answer the engine venv kept: the next deploy asks vLLM's parser again."""
    (Path(entry.engines_root) / lock_of(m.engine).name / ARGCHECK).unlink(missing_ok=True)  # type: ignore[arg-type]


def engine_checks(tmp: Path, wheels: Path, runs: int) -> None:
    """A no-op redeploy and the engine check alone, trusted verdict vs full check, interleaved; and
    the no-op redeploy with the parser's kept answer reused vs asked again."""
    entry = parser_on(sim_entry(tmp / "sim-check", wheels))
    host = LocalHost("sim", env=entry.env)
    try:
        data = SHIPPED["minimax-m25"].model_dump()
        data["serving"]["port"] = free_port()
        data["engine"] = {"vllm": "0.33.0", "torch": "2.13.0+cu130", "python": PY, "flashinfer": "0.6.14"}
        m = Manifest.model_validate(data)
        assert deploy(entry, m).ok
        lock = lock_of(m.engine)  # type: ignore[arg-type]
        times: dict[str, list[float]] = {"deploy trusted": [], "deploy full": [], "check trusted": [], "check full": [],
                                         "deploy trusted, parser asked again": []}
        for _ in range(runs):
            forget_parser(entry, m)
            t0 = time.monotonic()
            assert deploy(entry, m).ok
            times["deploy trusted, parser asked again"].append(time.monotonic() - t0)
            for full in (False, True):
                t0 = time.monotonic()
                assert deploy(entry, m, verify_engine=full).ok
                times["deploy full" if full else "deploy trusted"].append(time.monotonic() - t0)
                t0 = time.monotonic()
                state = host_engine.check(host, entry, lock, force=full)
                times["check full" if full else "check trusted"].append(time.monotonic() - t0)
                assert state.verified == ("now" if full else "earlier"), state
        for what, t in times.items():
            print(f"SIMULATED engine service, no-op redeploy / engine check alone: {what}: {median_s(t)}"
                  + (" (parser answer reused)" if what == "deploy trusted" else ""))
    finally:
        manager.down(tmp / "sim-check")


def real_checks(tmp: Path, runs: int) -> None:
    from orchestrator.devtools import real_vllm_venv as rv

    if not rv.is_built():
        print("vLLM's CPU build is not built here (python -m orchestrator.devtools.real_vllm_venv): no real figures")
        return
    env = manager.real_vllm_env(build=False)
    entry, lock = linked_engine(tmp / "real", Path(env["venv"]), env["version"])
    host = LocalHost("h")
    full, trusted = [], []
    for _ in range(runs):
        t0 = time.monotonic()
        state = host_engine.check(host, entry, lock, force=True)
        full.append(time.monotonic() - t0)
        assert state.verified == "now", state
        t0 = time.monotonic()
        state = host_engine.check(host, entry, lock)
        trusted.append(time.monotonic() - t0)
        assert state.verified == "earlier", state
    print(f"REAL vLLM {env['version']} (CPU build) engine check, full (pins, import vllm, vllm --version side by "
          f"side): {median_s(full)}")
    print(f"REAL vLLM {env['version']} engine check, the recorded verdict trusted (stats only): {median_s(trusted)}")


def real_deploys(tmp: Path, runs: int) -> None:
    """A no-op redeploy of the tiny model served by a REAL vLLM (the CPU build) as an engine service
    (its engine venv: the cached venv, linked_engine), full check vs the verdict trusted."""
    from orchestrator.devtools import real_vllm_venv as rv

    if not rv.is_built():
        return
    env = manager.real_vllm_env(build=False)
    home = tmp / "sim-real"
    os.environ["VLLM_ORCH_STATE_HOME"] = str(home.parent)
    manager.up(1, speed=2000, real_vllm=True, home=home)
    try:
        raw = manager.inventory_hosts(home)["sim"]
        linked, _lock = linked_engine(tmp / "real-deploy", Path(env["venv"]), env["version"])
        entry = parser_on(HostEntry.model_validate({**raw, "name": "sim", "engines_root": linked.engines_root}))
        data = SHIPPED["tiny-llama-a"].model_dump()
        data["serving"]["port"] = free_port()
        data["engine"] = {"vllm": env["version"].split("+")[0], "python": "3.11"}
        m = Manifest.model_validate(data)
        first = deploy(entry, m, budget_s=600, poll_s=0.5)
        assert first.ok, first.error
        times: dict[str, list[float]] = {"trusted, parser answer reused": [], "trusted, parser asked again": [],
                                         "full (and the parser asked)": []}
        for _ in range(runs):
            forget_parser(entry, m)
            t0 = time.monotonic()
            res = deploy(entry, m, budget_s=600, poll_s=0.5)
            times["trusted, parser asked again"].append(time.monotonic() - t0)
            assert res.ok, res.error
            for full in (False, True):
                t0 = time.monotonic()
                res = deploy(entry, m, budget_s=600, poll_s=0.5, verify_engine=full)
                times["full (and the parser asked)" if full else "trusted, parser answer reused"].append(
                    time.monotonic() - t0)
                assert res.ok, res.error
        for what, t in times.items():
            print(f"REAL vLLM {env['version']} tiny-llama-a as an engine service, no-op redeploy, engine check "
                  f"{what}: {median_s(t)}")
    finally:
        manager.down(home)


def cached_real_venvs() -> None:
    root = Path.home() / ".cache" / "vllm-orch"
    for v in sorted(root.glob("vllm-*")):
        info = v / "vllm-orch-build.json"
        built = json.loads(info.read_text()).get("seconds") if info.exists() else None
        print(f"  disk: {v.name}: {du(v) / 2 ** 30:.2f} GiB" + (f" (built in {built:.0f} s)" if built else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--real-wheel", type=Path, help="a real vLLM wheel on disk")
    ap.add_argument("--real-venv", action="store_true", help="the engine check on vLLM's CPU build (cached)")
    ap.add_argument("--checks-only", action="store_true", help="only the engine check's figures")
    args = ap.parse_args()
    if UV is None:
        sys.exit("uv is in the dev extra (pip install uv)")
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as d:
        tmp = Path(d)
        wheels = sim_engines.wheelhouse(tmp / "wheelhouse", ("0.24.0", "0.33.0"))
        sim_engines.flashinfer_wheels(wheels, "0.6.13")
        sim_engines.vllm_wheel(wheels, "0.26.0", requires=["flashinfer-python==0.6.14", "flashinfer-cubin==0.6.13"])
        engine_checks(tmp, wheels, args.runs)
        if args.real_venv:
            real_checks(tmp, args.runs)
            real_deploys(tmp, args.runs)
        if args.checks_only:
            return
        builds(tmp, wheels, args.runs + 1)
        upgrade(tmp, wheels, args.runs)
        if args.real_wheel:
            real_wheel(tmp, args.real_wheel)
    print("the machine's cached real venvs (what a real engine venv weighs without CUDA wheels):")
    cached_real_venvs()


if __name__ == "__main__":
    main()
