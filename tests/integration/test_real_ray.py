"""A REAL Ray cluster from the commands vllm-orch renders for `multinode.backend: ray`: the head's
`ray start --head --port P --node-ip-address A ... --block` (its ray-<service>.service) and a worker's
`ray start --address A:P --node-ip-address B ... --block` (the worker's vllm-<service>.service), run
unchanged (Ray 2.60 from PyPI, CPU only) in two routed network namespaces with their own addresses.
It shows that Ray accepts the rendered flags and that the nodes form ONE cluster across hosts, each
known by its cluster address. Not shown here: vLLM on that cluster - vLLM's CPU build refuses Ray
("current platform cpu does not support ray", vllm/v1/executor/ray_utils.py), see docs/multi-node.md."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.config.placement import node_roles
from orchestrator.devtools import cached_venv, ray_venv
from orchestrator.render.artifacts import build_argv, ray_argv
from tests.plugins.remote_hosts import routed_namespaces

from .deployhelp import SHIPPED

pytestmark = pytest.mark.ray

RAY_PORT = 6379
NODES_SCRIPT = ("import json, ray; ray.init(address='auto', logging_level='ERROR'); "
                "print(json.dumps(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))")


@pytest.fixture(scope="module")
def ray_bin() -> Path:
    try:
        ray_venv.ensure_venv()
    except cached_venv.BuildError as exc:
        if exc.offline and not cached_venv.in_ci():
            pytest.skip(f"cannot build the Ray venv (no package index reachable): {exc}")
        pytest.fail(f"building the Ray venv failed: {exc}\n{exc.log[-4000:]}")
    return ray_venv.ray_path()


def ray_manifest() -> Manifest:
    data = SHIPPED["kimi-k25-int4-2node"].model_dump()
    data["multinode"]["backend"] = "ray"
    data["multinode"]["ray_port"] = RAY_PORT
    return Manifest.model_validate(data)


class RayNode:
    """A rendered `ray start ... --block` in a namespace, in its own process group (as systemd would
    run the unit: one cgroup), with its own Ray temp folder (each real host has its own /tmp)."""

    def __init__(self, netns: str, argv: list[str], tmp: Path):
        tmp.mkdir(parents=True, exist_ok=True)
        self.log_path = tmp / "ray.log"
        self.env = {"RAY_TMPDIR": str(tmp), "RAY_USAGE_STATS_ENABLED": "0"}
        self.netns = netns
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(["ip", "netns", "exec", netns, "env", *(f"{k}={v}" for k, v in self.env.items()),
                                          *argv], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.netns, "env", *(f"{k}={v}" for k, v in self.env.items()),
                               *argv], capture_output=True, text=True, timeout=timeout)

    def stop(self, timeout: float = 60) -> bool:
        """SIGTERM to `ray start --block` (what systemd sends the unit's main process); True when the
        whole process group was gone within `timeout` (anything left is killed)."""
        try:
            os.kill(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                self.proc.wait()
                return True
            self.proc.poll()
            time.sleep(0.5)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        return False


@pytest.fixture
def short_tmp():
    """Ray's socket paths must stay under 107 bytes (AF_UNIX): pytest's tmp_path is too deep."""
    d = Path(tempfile.mkdtemp(prefix="vo-ray-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_rendered_ray_head_and_worker_form_one_cluster_across_two_hosts(ray_bin, short_tmp):
    m = ray_manifest()
    tmp_path = short_tmp
    with routed_namespaces(2, "ry") as ((ns_a, a), (ns_b, b)):
        venv_vllm = str(ray_bin.with_name("vllm"))          # render puts `ray` beside the host's vllm
        entries = [HostEntry(name=n, address=addr, vllm=venv_vllm, cluster={"interface": "eth0"})
                   for n, addr in (("gpu1", a), ("gpu2", b))]
        roles = node_roles(m, entries)
        head_argv = ray_argv(m, entries[0], roles[0])
        worker_argv, _ = build_argv(m, entries[1], roles[1])     # a Ray worker's service IS `ray start`
        assert head_argv[:4] == [str(ray_bin), "start", "--head", "--port"] and "--block" in head_argv
        assert worker_argv[:4] == [str(ray_bin), "start", "--address", f"{a}:{RAY_PORT}"]

        head = RayNode(ns_a, head_argv, tmp_path / "a")
        worker = None
        try:
            deadline = time.monotonic() + 180
            while head.run(str(ray_bin), "status", "--address", f"{a}:{RAY_PORT}").returncode != 0:
                assert head.proc.poll() is None, head.log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, head.log_path.read_text()[-3000:]
                time.sleep(1)
            worker = RayNode(ns_b, worker_argv, tmp_path / "b")
            python = str(ray_bin.with_name("python"))
            nodes: list[str] = []
            while nodes != sorted([a, b]):
                assert worker.proc.poll() is None, worker.log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, (nodes, worker.log_path.read_text()[-3000:])
                r = head.run(python, "-c", NODES_SCRIPT, timeout=120)
                nodes = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else []
                time.sleep(1)
            # `ray status` (the autoscaler's view) catches up with the cluster's node table a little later
            while (status := head.run(str(ray_bin), "status", "--address", f"{a}:{RAY_PORT}")).stdout.count(" node_") != 2:
                assert time.monotonic() < deadline, status.stdout                # two active nodes
                time.sleep(1)
            # each node's Ray servers listen on the ports rendered for the service (pinned per service:
            # GPUs 0-7, the first block), so the clash check before a deploy looks at the right ones
            for node, argv in ((head, head_argv), (worker, worker_argv)):
                listening = node.run("ss", "-ltnH").stdout
                for flag in ("--node-manager-port", "--object-manager-port"):
                    assert f":{argv[argv.index(flag) + 1]} " in listening, (flag, listening)
            # systemd stops a unit with SIGTERM to its main process: `ray start --block` takes its node down
            assert worker.stop(), worker.log_path.read_text()[-3000:]
            assert head.stop(), head.log_path.read_text()[-3000:]
        finally:
            if worker:
                worker.stop(5)
            head.stop(5)
