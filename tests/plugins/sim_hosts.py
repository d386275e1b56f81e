"""Fixtures: the default SIMULATED host (LocalHost + the sim programs), and helpers to start the
simulated vLLM server by hand and wait on its log.

    def test_x(sim_host):
        sim_host.dir / "bin" / "vllm"         # the simulated vLLM 0.33 server
        sim_host.entry                        # its inventory entry (dict, as in hosts.d/sim.yaml)
        sim_host.host.run(["nvidia-smi", ...])  # a LocalHost with the entry's env
        model = make_model(sim_host.dir, "kimi-k25-int4", "moonshotai/Kimi-K2.5")
        with SimServer(sim_host, [str(model), "--tensor-parallel-size", "8", ...]) as srv:
            srv.wait_ready()
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.host.local import LocalHost
from orchestrator.sim import manager
from orchestrator.sim.sshd import free_port  # noqa: F401  (re-exported for the tests)

TEST_SPEED = 2000.0   # Kimi (547 GB) loads in ~1 s


@dataclass
class SimHost:
    name: str
    dir: Path
    entry: dict
    host: LocalHost
    home: Path

    def nvidia_smi(self, *args: str) -> str:
        out = subprocess.run([str(self.dir / "bin" / "nvidia-smi"), *args], capture_output=True,
                             text=True, timeout=10)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout


@pytest.fixture
def sim_host(tmp_path, monkeypatch):
    """A fresh SIMULATED host `sim` in a tmp state home (speed 2000); torn down afterwards."""
    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path / "state"))
    home = manager.sim_home()
    manager.up(1, speed=TEST_SPEED, home=home)
    try:
        entry = manager.inventory_hosts(home)["sim"]
        yield SimHost("sim", manager.host_dir("sim", home), entry,
                      LocalHost("sim", env=entry["env"]), home)
    finally:
        manager.down(home)


def make_model(host_dir: Path, name: str, repo_id: str, *, shards: int = 4,
               total_size: float | None = None, custom_code: bool = True) -> Path:
    """A model folder like the mirror's synthetic repos: config.json naming the repo (so the
    server picks its profile) and an index whose metadata carries the real total size."""
    d = host_dir / "models" / name
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"_name_or_path": repo_id}
    if custom_code:
        cfg["auto_map"] = {"AutoConfig": "configuration.Config"}
    (d / "config.json").write_text(json.dumps(cfg))
    files = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    for f in files:
        (d / f).write_bytes(b"\0" * 16)
    index = {"weight_map": {f"w{i}": f for i, f in enumerate(files)}}
    if total_size:
        index["metadata"] = {"total_size": int(total_size)}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def wait_until(predicate, budget: float = 10.0, what: str = "condition"):
    """Poll until predicate() is true (and return its value): what a fixed sleep would hope for,
    without betting on how fast a busy machine gets there."""
    deadline = time.monotonic() + budget
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what} not met within {budget} s"
        time.sleep(0.05)
    return value


def fired(hdir: Path, fault: str) -> list[dict]:
    """The firings of `fault` on a simulated host, oldest first (`<hostdir>/logs/faults-fired.jsonl`,
    written as a server takes an armed fault)."""
    path = hdir / "logs" / "faults-fired.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r["fault"] == fault]


class SimServer:
    """`<hostdir>/bin/vllm serve ARGS --port P` with its output in a file; kills what it started
    (the server, and its GPU-holder workers via gpu-procs) on exit. new_session: the server leads
    its own process group, as a `vllm serve` typed into an interactive shell does."""

    def __init__(self, sim: SimHost, args: list, *, env: dict | None = None,
                 port: int | None = None, host: str = "127.0.0.1", new_session: bool = False):
        self.sim = sim
        self.port = port or free_port()
        self.log_path = sim.dir / "logs" / f"vllm-{self.port}.log"
        self.err_path = sim.dir / "logs" / f"vllm-{self.port}.err"
        full_env = {**os.environ, **sim.entry["env"], **(env or {})}
        with open(self.log_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [str(sim.dir / "bin" / "vllm"), "serve", *args, "--host", host,
                 "--port", str(self.port)], stdout=out, stderr=err, env=full_env,
                stdin=subprocess.DEVNULL, start_new_session=new_session)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log:
                return
            if self.proc.poll() is not None and text not in self.log:
                raise AssertionError(f"server exited {self.proc.returncode} before {text!r}:\n"
                                     + self.log[-3000:] + self.stderr[-2000:])
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {text!r}:\n" + self.log[-3000:])

    def wait_ready(self, timeout: float = 15.0) -> None:
        self.wait_for("Application startup complete.", timeout)

    def wait_exit(self, timeout: float = 15.0) -> int:
        return self.proc.wait(timeout)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def holders(self) -> list:
        out = []
        for f in (self.sim.dir / "gpu-procs").glob("*.json"):
            try:
                out.append(json.loads(f.read_text()))
            except (OSError, ValueError):
                pass
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for h in self.holders():
            manager.stop_pid(int(h["pid"]), h.get("start_time"), timeout=3)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# -- hub_mirror: a real SIMULATED Hub mirror process per test -------------------------------


@dataclass
class HubMirror:
    """A running `python -m orchestrator.sim.hub` (its own host folder, faults and request log)."""

    hostdir: Path
    port: int
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a client process: HF_ENDPOINT at the mirror, no telemetry, a private HF_HOME."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
        env.update(HF_ENDPOINT=self.url, HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
                   HF_HOME=str(self.hostdir / "hf-home"), **extra)
        return env

    def add_fault(self, fault: str, model: str | None = None, **extra) -> None:
        from orchestrator.sim.fault_file import add_fault
        add_fault(self.hostdir, fault, model, **extra)

    def requests(self) -> list[dict]:
        """Every request served so far (the mirror's JSON-lines log)."""
        log = self.hostdir / "hub-requests.jsonl"
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def start_hub_mirror(hostdir: Path, *args: str, timeout: float = 10.0) -> HubMirror:
    hostdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.sim.hub", "--host-dir", str(hostdir),
                              "--port", "0", "--bind", "127.0.0.1", *args],
                             cwd=str(Path(__file__).resolve().parents[2]),
                             stdout=subprocess.DEVNULL, stderr=open(hostdir / "hub.stderr", "wb"))
    port_file = hostdir / "hub.port"
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"hub mirror did not start: {(hostdir / 'hub.stderr').read_text()[-500:]}")
        time.sleep(0.02)
    return HubMirror(hostdir, int(port_file.read_text()), proc)


def stop_hub_mirror(mirror: HubMirror) -> None:
    mirror.proc.terminate()
    try:
        mirror.proc.wait(10)
    except subprocess.TimeoutExpired:
        mirror.proc.kill()
        mirror.proc.wait()


@pytest.fixture
def hub_mirror(tmp_path):
    """A SIMULATED Hub mirror on 127.0.0.1 (scale 10000) with `vllm-orch-sim/tiny-random-3shard`,
    the gated `vllm-orch-sim/gated-tiny` and the shipped models' repos. Stopped after the test."""
    mirror = start_hub_mirror(tmp_path / "hub-host")
    yield mirror
    stop_hub_mirror(mirror)
