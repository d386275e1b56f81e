"""Fixtures: a REAL vLLM server (vLLM's CPU build) and simulated hosts whose vLLM it is.

  real_vllm         (session) {"venv", "vllm", "python", "version"} of the cached venv with vLLM's CPU
                     build (orchestrator/devtools/real_vllm_venv.py): ~2.5 min cold, instant when
                     cached. With CI=true a failed build FAILS the tests; elsewhere they skip only
                     when no package index is reachable.
  real_vllm_host    (module) a SIMULATED process host whose vLLM is the real one (`sim up --real-vllm`)
                     in a private sim home; `sim down` at the end stops every process it ran.
  tiny_model        (session) factory: tiny_model("vllm-orch-sim/tiny-llama-a") -> a model folder
                     written by orchestrator/sim/tinymodel.py (the same bytes the hub mirror serves).
  RealServer        `<venv>/bin/vllm serve DIR ARGS --port P` started by hand in its own session,
                     for tests about the server itself; stop() ends its whole process group.

Tests that use these carry the `real_vllm` marker. The machine has few cores: keep real servers
few and short-lived, and share one across tests where a fresh one is not the point.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from orchestrator.devtools import cached_venv, real_vllm_venv
from orchestrator.host.local import LocalHost
from orchestrator.sim import manager
from orchestrator.sim.tinymodel import write_model

from .sim_hosts import SimHost, free_port

BUILD_TIMEOUT = 1800     # the first test that needs the venv may build it (pyproject: 300 s a test)
READY_TIMEOUT = 240.0    # a real start is ~30 s on an idle 2-core machine; several times that when busy
# A real-vLLM deploy's or swap's start-up budget in the tests: only a guard under the tier's 900 s test
# timeout. What catches a hang is the product's own no-progress window (the tiny manifests: 120 s
# without a log line). A fixed 240 s failed a data-parallel deploy still loading, beside three busy
# workers and a busy core, on a slower 2-core machine.
START_BUDGET_S = 600.0
STILL_S = 60.0           # RealServer.wait_ready: this long with no new log line and no CPU is a hang
PROGRESS_CHECK_S = 5.0


def pytest_collection_modifyitems(config, items):
    if real_vllm_venv.is_built():
        return
    for item in items:
        if item.get_closest_marker("real_vllm"):
            item.add_marker(pytest.mark.timeout(BUILD_TIMEOUT))
            break


@pytest.fixture(scope="session")
def real_vllm() -> dict:
    try:
        real_vllm_venv.ensure_venv()
    except real_vllm_venv.BuildError as exc:
        if exc.offline and not cached_venv.in_ci():
            pytest.skip(f"cannot build vLLM's CPU build venv (no package index reachable): {exc}")
        pytest.fail(f"building vLLM's CPU build venv failed: {exc}\n{exc.log[-4000:]}")
    return manager.real_vllm_env(build=False)


@pytest.fixture(scope="module")
def real_vllm_host(real_vllm, tmp_path_factory):
    old = os.environ.get("VLLM_ORCH_STATE_HOME")
    os.environ["VLLM_ORCH_STATE_HOME"] = str(tmp_path_factory.mktemp("real-vllm-state"))
    home = manager.sim_home()
    manager.up(1, speed=2000, real_vllm=True, home=home)
    try:
        entry = yaml.safe_load(manager.inventory_file(home).read_text())["hosts"]["sim"]
        yield SimHost("sim", manager.host_dir("sim", home), entry,
                      LocalHost("sim", env=entry["env"]), home)
    finally:
        manager.down(home)
        if old is None:
            os.environ.pop("VLLM_ORCH_STATE_HOME", None)
        else:
            os.environ["VLLM_ORCH_STATE_HOME"] = old


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    made: dict[str, Path] = {}

    def make(repo: str = "vllm-orch-sim/tiny-llama-a") -> Path:
        if repo not in made:
            made[repo] = write_model(tmp_path_factory.mktemp("tiny") / repo.split("/")[-1], repo)
        return made[repo]
    return make


class RealServer:
    """The real `vllm serve` of the CPU build, by hand: output in a file, its own process group."""

    def __init__(self, real: dict, model: Path, args: list[str], *, env: dict | None = None,
                 log_dir: Path, port: int | None = None):
        self.port = port or free_port()
        self.log_path = log_dir / f"real-vllm-{self.port}.log"
        full = {**os.environ, **real_vllm_venv.CPU_ENV, **(env or {})}
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [real["vllm"], "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                 "--max-model-len", "1024", "--enforce-eager", "--gpu-memory-utilization", "0.1",
                 *args], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full,
                cwd=str(model), start_new_session=True)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout: float | None = None, api_servers: int = 1) -> float:
        """Seconds from start to "Application startup complete." (the last start-up line), logged
        by each of `api_servers` API servers (data parallel runs one per engine; the first to be up
        answers requests while the others may not have logged their start yet).

        Gives up on a hang, not on a slow machine: when for STILL_S neither the log grew nor the
        server's processes used CPU (or after `timeout`, when given). A data-parallel start beside
        three busy workers took over 240 s on a slower 2-core machine while every process was still
        importing; a fixed 240 s failed it. The test's own timeout bounds the whole."""
        t0 = time.monotonic()
        seen = (-1, -1.0)
        moved = checked = t0
        while timeout is None or time.monotonic() - t0 < timeout:
            log = self.log
            if log.count("Application startup complete.") >= api_servers:
                return time.monotonic() - t0
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited {self.proc.returncode}:\n{log[-4000:]}")
            now = time.monotonic()
            if now - checked >= PROGRESS_CHECK_S:
                # against the last check (an exited process lowers the sum): a line, or a tenth of a core
                mark = (len(log), self.group_cpu_s())
                if mark[0] > seen[0] or mark[1] > seen[1] + 0.1 * (now - checked):
                    moved = now
                seen, checked = mark, now
                if now - moved >= STILL_S:
                    raise AssertionError(f"vllm serve made no progress for {STILL_S:.0f} s (no new log line, "
                                         f"no CPU), {now - t0:.0f} s after its start:\n{log[-4000:]}")
            time.sleep(0.2)
        raise AssertionError(f"vllm serve not ready after {timeout:.0f}s:\n{self.log[-4000:]}")

    def group_cpu_s(self) -> float:
        """CPU seconds used so far by the server's live processes (its own process group)."""
        total = 0.0
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == self.proc.pid:
                    t = p.cpu_times()
                    total += t.user + t.system
            except (psutil.Error, ProcessLookupError):
                continue
        return total

    def wait_exit(self, timeout: float = READY_TIMEOUT) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # the group: engine and workers too
        except ProcessLookupError:
            pass
        self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
