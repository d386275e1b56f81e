"""A REAL two-node vLLM: vLLM's CPU build, one service spanning two "hosts" (two network namespaces
with their own addresses, routed through this machine as the real-systemd test hosts are), tensor
parallel 2 over gloo: `--nnodes 2 --node-rank 0 --master-addr A --master-port P` on A and the same with
`--node-rank 1 --headless` on B, GLOO_SOCKET_IFNAME and VLLM_HOST_IP per node (docs/multi-node.md).

What it pins down about vLLM 0.32 itself (the simulator and the deploy's gates must agree):
- the head serves only once the headless rank has joined its torch.distributed store at A:P;
- a killed headless node is NOT visible at the head: /health stays 200 until a request needs the
  dead rank, which then fails (500) naming the peer's address, and the head exits;
- a rank that never joins fails the head after --distributed-timeout-seconds
  ("Timed out after N seconds waiting for clients. 1/2 clients joined.").
Tensor parallel, not pipeline parallel: with --enforce-eager the CPU build's PP rank > 0 never
allocates its intermediate tensors (no warm-up run) and the first request fails; TP needs no warm-up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from orchestrator.devtools import real_vllm_venv
from tests.integration.probehelp import head_watch, root_restart
from tests.plugins.real_vllm import READY_TIMEOUT
from tests.plugins.remote_hosts import routed_namespaces

pytestmark = pytest.mark.real_vllm

API_PORT = 8000           # each node has its own address: no clash with anything on this machine
MASTER_PORT = 29500


@pytest.fixture(scope="module")
def two_nodes():
    """Two network namespaces that reach each other: [(netns, address), (netns, address)]."""
    with routed_namespaces(2, "rv") as nodes:
        yield nodes


class Node:
    """`vllm serve` of the CPU build inside a network namespace, in its own process group."""

    def __init__(self, real: dict, model: Path, netns: str, address: str, args: list[str], log: Path,
                 port: int = API_PORT):
        self.address, self.log_path = address, log
        env = {**real_vllm_venv.CPU_ENV, "GLOO_SOCKET_IFNAME": "eth0", "VLLM_HOST_IP": address}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", netns, "env", *(f"{k}={v}" for k, v in env.items()),
                 real["vllm"], "serve", str(model), "--host", address, "--port", str(port),
                 "--max-model-len", "1024", "--enforce-eager", "--gpu-memory-utilization", "0.1", *args],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(model),
                start_new_session=True)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = READY_TIMEOUT) -> float:
        t0 = time.monotonic()
        while text not in self.log:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited {self.proc.returncode} before {text!r}:\n{self.log[-4000:]}")
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"no {text!r} after {timeout:.0f} s:\n{self.log[-4000:]}")
            time.sleep(0.5)
        return time.monotonic() - t0

    def exit_code(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout:.0f} s:\n{self.log[-4000:]}") from None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)     # the node's every process: the node is gone
        except ProcessLookupError:
            pass
        self.proc.wait()


def http(address: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict | str]:
    req = urllib.request.Request(f"http://{address}:{API_PORT}{path}", method="POST" if body else "GET",
                                 data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read().decode(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


@pytest.fixture(scope="module")
def lone_head(real_vllm, tiny_model, two_nodes, tmp_path_factory):
    """A head whose rank never comes, started with the module (on B's address, its own ports) so that
    its wait overlaps the two-node test's start: the module stays well under three minutes. A head
    watch (the units' probe) starts with it, to hold its idle connection while the head waits:
    yields (head, the watch's process, the watch's folder)."""
    _, (ns_b, b) = two_nodes
    tmp = tmp_path_factory.mktemp("lone")
    head = Node(real_vllm, tiny_model(), ns_b, b,
                ["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "0", "--master-addr", b,
                 "--master-port", str(MASTER_PORT + 1), "--distributed-timeout-seconds", "20"],
                tmp / "head.log", port=API_PORT + 1)
    watch = head_watch(b, MASTER_PORT + 1, tmp)
    yield head, watch, tmp
    watch.kill()
    head.kill()


def test_a_real_two_node_tensor_parallel_service_serves_and_a_dead_node_is_named_by_the_head(
        real_vllm, tiny_model, two_nodes, lone_head, tmp_path):
    model = tiny_model()
    (ns_a, a), (ns_b, b) = two_nodes
    common = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", a, "--master-port", str(MASTER_PORT)]
    t0 = time.monotonic()
    worker = Node(real_vllm, model, ns_b, b, [*common, "--node-rank", "1", "--headless"], tmp_path / "b.log")
    head = Node(real_vllm, model, ns_a, a, [*common, "--node-rank", "0"], tmp_path / "a.log")
    try:
        head.wait_for("Application startup complete.")
        started = time.monotonic() - t0
        # The rendezvous really crossed the namespaces: B dialled A's store, and got TP rank 1.
        assert f"headless multiproc executor, with head node address {a}:{MASTER_PORT} " in worker.log
        assert f"distributed_init_method=tcp://{a}:{MASTER_PORT} backend=gloo" in worker.log
        assert "is assigned as DP rank 0, PP rank 0, PCP rank 0, TP rank 1," in worker.log
        assert "is assigned as DP rank 0, PP rank 0, PCP rank 0, TP rank 0," in head.log
        assert "Application startup complete." not in worker.log        # headless: no API server

        status, answer = http(a, "/v1/chat/completions", {
            "model": str(model), "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})
        assert status == 200, answer
        assert isinstance(answer, dict) and answer["usage"]["completion_tokens"] == 8
        assert answer["choices"][0]["message"]["content"].strip()

        # The headless node dies: the head does not notice by itself ...
        worker.kill()
        assert http(a, "/health", timeout=30)[0] == 200
        assert head.proc.poll() is None
        # ... the next request needs the dead rank: it fails, naming the peer, and the head exits.
        status, answer = http(a, "/v1/chat/completions", {
            "model": str(model), "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})
        assert status == 500, answer
        head.exit_code(120)
        # gloo names the peer either way: "Connection closed by peer [B]:port" or "Read error [B]:port:
        # Connection reset by peer" (which one depends on where the head's worker was in its read)
        assert any("gloo/transport/tcp/pair.cc" in line and f" [{b}]:" in line and "peer" in line
                   for line in head.log.splitlines()), head.log[-4000:]
        assert "EngineCore encountered a fatal error." in head.log
        print(f"two-node TP2 start to ready: {started:.1f} s")
    finally:
        worker.kill()
        head.kill()


def test_a_rank_that_never_joins_fails_the_head_after_its_distributed_timeout(lone_head, two_nodes):
    """... and a headless node's head watch (the units' probe, watch-head) holds its idle connection to
    the real head's store without counting as a rank (still 1/2 clients joined), then sees the head go
    and asks for a restart (exit 75), which the unit's root part carries out (systemctl is a stand-in
    here: these namespaces run no systemd)."""
    _, (_, b) = two_nodes
    head, watch, tmp_path = lone_head
    head.wait_for(f"distributed_init_method=tcp://{b}:{MASTER_PORT + 1} backend=gloo")
    assert head.exit_code(READY_TIMEOUT) != 0
    log = head.log
    assert "Timed out after " in log and " seconds waiting for clients. 1/2 clients joined." in log
    assert "EngineCore failed to start." in log
    assert "Application startup complete." not in log
    out, _ = watch.communicate(timeout=60)
    assert watch.returncode == 75, out          # the watch (the service user's) asks; root restarts
    assert f"holding a connection to the head's store at {b}:{MASTER_PORT + 1}" in out
    assert not (tmp_path / "systemctl.log").exists()
    done = root_restart(tmp_path, watch.returncode, "head-lost-restart", "x", "--address", b,
                        "--port", str(MASTER_PORT + 1))    # the unit's ExecStopPost=+, as systemd runs it
    assert done.returncode == 0, done.stdout + done.stderr
    # reset-failed first: a watcher's own restart must not count against the unit's start limit
    assert (tmp_path / "systemctl.log").read_text().split() == ["reset-failed", "vllm-x.service", "restart", "--no-block",
                                                                 "vllm-x.service"]
    record = json.loads((tmp_path / "state" / "history.jsonl").read_text().splitlines()[-1])
    assert record["operation"] == "head-lost-restart" and record["ok"] and "closed (its vLLM exited)" in record["reason"]

