"""The simulated vLLM's multi-node modes, run as local processes on 127.0.0.1: each "node" is its
own SIMULATED host (own GPUs, faults, page cache view) and its own `vllm serve` process; the ranks
meet over real TCP on --master-port (TP/PP across nodes) or --data-parallel-rpc-port (DP across
nodes), the way vLLM's ranks meet over torch.distributed's TCPStore and the engine handshake."""

from __future__ import annotations

import json
import re
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest
import yaml

from orchestrator.host.local import LocalHost
from orchestrator.probe import logsig
from orchestrator.sim import manager
from tests.integration import vllm_contract
from tests.plugins.sim_hosts import TEST_SPEED, SimHost, SimServer, free_port, make_model, wait_until

MODEL_ARGV = ["--served-model-name", "kimi-k25", "--trust-remote-code", "--kv-cache-dtype", "fp8",
              "--max-model-len", "65536", "--gpu-memory-utilization", "0.93"]


@pytest.fixture
def nodes(tmp_path, monkeypatch):
    """Three fresh SIMULATED hosts (sim, sim-2, sim-3), each with the same Kimi-K2.5 folder."""
    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path / "state"))
    home = manager.sim_home()
    manager.up(3, speed=TEST_SPEED, home=home)
    try:
        inv = yaml.safe_load(manager.inventory_file(home).read_text())["hosts"]
        out = []
        for name in ("sim", "sim-2", "sim-3"):
            host = SimHost(name, manager.host_dir(name, home), inv[name], LocalHost(name, env=inv[name]["env"]), home)
            make_model(host.dir, "kimi-k25-int4", "moonshotai/Kimi-K2.5", shards=16, total_size=547e9)
            out.append(host)
        yield out
    finally:
        manager.down(home)


def model(node: SimHost) -> str:
    return str(node.dir / "models" / "kimi-k25-int4")


def tp_pp_argv(node: SimHost, rank: int, nnodes: int, master_port: int, pp: int = 2) -> list:
    argv = [model(node), *MODEL_ARGV, "--tensor-parallel-size", str(8 * nnodes // pp),
            "--pipeline-parallel-size", str(pp), "--nnodes", str(nnodes), "--node-rank", str(rank),
            "--master-addr", "127.0.0.1", "--master-port", str(master_port)]
    return argv + (["--headless"] if rank else [])


def dp_argv(node: SimHost, rank: int, rpc_port: int, local: int = 1) -> list:
    """DP 2 x local over two nodes, TP 8 / local on each engine (8 GPUs a node)."""
    argv = [model(node), *MODEL_ARGV, "--tensor-parallel-size", str(8 // local), "--data-parallel-size",
            str(2 * local), "--data-parallel-size-local", str(local), "--data-parallel-address", "127.0.0.1",
            "--data-parallel-rpc-port", str(rpc_port), "--enable-expert-parallel"]
    return argv + (["--data-parallel-start-rank", str(local), "--headless"] if rank else [])


def get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status


def complete(port: int) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                 data=json.dumps({"model": "kimi-k25", "prompt": "Hello",
                                                  "max_tokens": 4}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except ConnectionRefusedError:
        return True


def titles(node: SimHost) -> list:
    return sorted(json.loads(f.read_text())["process_name"] for f in (node.dir / "gpu-procs").glob("*.json"))


def fatal(log: str):
    return logsig.root_cause(log.splitlines())


def test_tp_pp_across_three_nodes_joins_then_the_head_serves(nodes):
    port = free_port()
    with SimServer(nodes[1], tp_pp_argv(nodes[1], 1, 3, port, pp=3)) as w1, \
            SimServer(nodes[2], tp_pp_argv(nodes[2], 2, 3, port, pp=3)) as w2:
        w1.wait_for("distributed_init_method=tcp://127.0.0.1:")
        with SimServer(nodes[0], tp_pp_argv(nodes[0], 0, 3, port, pp=3)) as head:
            head.wait_for("Starting to load model", timeout=60)
            assert refused(head.port)                       # not serving while loading
            head.wait_ready(timeout=120)
            assert get(head.url("/health")) == 200
            assert complete(head.port)["usage"]["completion_tokens"] == 4
            # vLLM's titles by global rank: TP8 x PP3, 8 ranks per node
            assert titles(nodes[0]) == sorted(f"VLLM::Worker_PP0_TP{t}" for t in range(8))
            assert titles(nodes[2]) == sorted(f"VLLM::Worker_PP2_TP{t}" for t in range(8))
            for w, rank0 in ((w1, 8), (w2, 16)):
                log = w.log
                assert re.search(r"^INFO \d\d-\d\d [\d:]+ \[serve\.py:224\] Launching vLLM \(v0\.33\.0\) headless "
                                 rf"multiproc executor, with head node address 127\.0\.0\.1:{port} for "
                                 r"torch\.distributed process group\.$", log, re.M), log[:2000]
                assert re.search(rf"^\(Worker pid=\d+\) INFO .* world_size=24 rank={rank0} local_rank=0 "
                                 rf"distributed_init_method=tcp://127\.0\.0\.1:{port} backend=nccl$", log, re.M)
                assert re.search(rf"^\(Worker_PP{rank0 // 8}_TP0 pid=\d+\) INFO .*\] rank {rank0} in world size 24 is "
                                 rf"assigned as DP rank 0, PP rank {rank0 // 8}, PCP rank 0, TP rank 0, ETP rank 0, "
                                 r"EP rank N/A, EPLB rank N/A$", log, re.M)
                assert "Loading weights took" in log
                assert "Starting vLLM server" not in log        # headless ranks never serve HTTP
                assert w.proc.poll() is None
            assert re.search(r"\(EngineCore pid=\d+\) INFO .*\] DP group leader: node_rank=0, "
                             r"node_rank_within_dp=0, master_addr=127\.0\.0\.1, .* world_size=24, "
                             r"local_world_size=8$", head.log, re.M)
            # the head stops: like the real vLLM's, the headless nodes do not notice and run on,
            # silent, holding their GPUs, until they are stopped themselves
            head.proc.send_signal(signal.SIGTERM)
            assert head.wait_exit(30) == 0
            quiet = len(w1.log)
            time.sleep(2)
            assert w1.proc.poll() is None and w2.proc.poll() is None
            assert w1.log[quiet:] == "" and len(titles(nodes[1])) == 8
            for w in (w1, w2):
                w.proc.send_signal(signal.SIGTERM)
                assert w.wait_exit(30) == 0
            assert titles(nodes[1]) == titles(nodes[2]) == []


def test_the_head_waits_for_a_missing_rank_then_times_out_naming_the_count(nodes):
    port = free_port()
    # at DEBUG the API server says what it waits for, every 10 s (STARTUP_POLL_PERIOD_MS)
    env = {"VLLM_SIM_JOIN_TIMEOUT_S": "14", "VLLM_LOGGING_LEVEL": "DEBUG"}
    with SimServer(nodes[0], tp_pp_argv(nodes[0], 0, 2, port), env=env) as head:
        head.wait_for("distributed_init_method=tcp://127.0.0.1:", timeout=30)
        head.wait_for("core engine proc(s) to start.", timeout=30)
        assert re.search(r"^\(APIServer pid=\d+\) DEBUG .*\[utils\.py:1448\] Waiting for 1 local, 0 remote core "
                         r"engine proc\(s\) to start\.$", head.log, re.M)
        assert head.proc.poll() is None and refused(head.port)
        assert "Starting to load model" not in head.log       # loads only when all have joined
        assert head.wait_exit(60) == 1
        log = head.log
        assert "torch.distributed.DistStoreError: Timed out after 15 seconds waiting for clients. " \
               "8/16 clients joined." in log
        assert "Engine core initialization failed" in log
        sig, line = fatal(log)
        assert sig is not None and sig.key == "join-timeout", (sig, line)


def test_a_rank_that_cannot_reach_the_head_fails_with_torchs_connect_timeout(nodes):
    port = free_port()
    manager.add_fault("sim-2", "unreachable-head", home=nodes[1].home)
    env = {"VLLM_SIM_JOIN_TIMEOUT_S": "3"}
    with SimServer(nodes[1], tp_pp_argv(nodes[1], 1, 2, port), env=env) as w1:
        assert w1.wait_exit(60) == 1
        log = w1.log
        assert (f"torch.distributed.DistNetworkError: The client socket has timed out after 3000ms while "
                f"trying to connect to (127.0.0.1, {port}).") in log
        assert "WorkerProc initialization failed due to an exception in a background process" in log
        assert re.search(rf"^\[W\d+ [\d:.]+ socket\.cpp:\d+\] \[c10d\] The client socket has failed to connect "
                         rf"to \[127\.0\.0\.1\]:{port} \(errno: 110 - Connection timed out\)\.$", w1.stderr, re.M)
        sig, line = fatal(log)
        assert sig is not None and sig.key == "head-unreachable", (sig, line)
        assert titles(nodes[1]) == []


def test_a_rank_crash_while_loading_kills_the_head_with_a_named_line(nodes):
    port = free_port()
    manager.add_fault("sim-2", "rank-crash-loading", home=nodes[1].home)
    with SimServer(nodes[1], tp_pp_argv(nodes[1], 1, 2, port)) as w1, \
            SimServer(nodes[0], tp_pp_argv(nodes[0], 0, 2, port)) as head:
        assert w1.wait_exit(60) == 1
        assert "CUDA error: an illegal memory access was encountered" in w1.log
        assert head.wait_exit(60) == 1
        log = head.log
        assert re.search(r"Connection closed by peer \[127\.0\.0\.1\]:\d+$", log, re.M)
        assert "Application startup complete." not in log
        sig, _line = fatal(log)
        assert sig is not None and sig.key == "peer-closed"
        assert fatal(w1.log)[0].key == "cuda-error"


def test_a_head_with_another_revision_fails_loading_and_takes_the_ranks_down(nodes):
    port = free_port()
    manager.add_fault("sim", "wrong-revision", home=nodes[0].home)
    with SimServer(nodes[1], tp_pp_argv(nodes[1], 1, 2, port)) as w1, \
            SimServer(nodes[0], tp_pp_argv(nodes[0], 0, 2, port)) as head:
        assert head.wait_exit(60) == 1
        assert fatal(head.log)[0].key == "weights-mismatch"
        # 1 if its workers were still loading (the executor's start fails), 0 if they were loaded
        # and waiting for the head's next step (run_headless returns after its worker monitor)
        assert w1.wait_exit(60) in (0, 1)
        assert fatal(w1.log)[0].key == "head-gone"


def test_a_node_with_another_revision_fails_loading_and_takes_the_head_down(nodes):
    port = free_port()
    manager.add_fault("sim-2", "wrong-revision", home=nodes[1].home)
    with SimServer(nodes[1], tp_pp_argv(nodes[1], 1, 2, port)) as w1, \
            SimServer(nodes[0], tp_pp_argv(nodes[0], 0, 2, port)) as head:
        assert w1.wait_exit(60) == 1
        assert re.search(r"^\(Worker_PP1_TP0 pid=\d+\) AssertionError: Attempted to load weight "
                         r"\(torch\.Size\(\[\d+, \d+\]\)\) into parameter \(torch\.Size\(\[\d+, \d+\]\)\)$",
                         w1.log, re.M), w1.log[-2000:]
        assert fatal(w1.log)[0].key == "weights-mismatch"
        assert head.wait_exit(60) == 1
        assert fatal(head.log)[0].key == "peer-closed"


def failed_completion(port: int) -> tuple[int, float]:
    """(HTTP status, seconds) of a completion expected to fail."""
    t0 = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as err:
        complete(port)
    return err.value.code, time.monotonic() - t0


@pytest.mark.parametrize("layout", ["pp", "tp"])
def test_a_node_lost_while_serving_is_noticed_by_the_head_only_at_its_next_request(nodes, layout):
    """As the real vLLM (0.32, two nodes over Gloo, docs/multi-node.md) behaved: the idle head says
    nothing and keeps answering /health 200; the next request fails naming the lost peer's address.
    TP across nodes: HTTP 500 at once. PP across nodes: the engine waits for the last stage's output
    until VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, then `RPC call to sample_tokens timed out.`"""
    port, pp = free_port(), 2 if layout == "pp" else 1
    with SimServer(nodes[1], tp_pp_argv(nodes[1], 1, 2, port, pp=pp)) as w1, \
            SimServer(nodes[0], tp_pp_argv(nodes[0], 0, 2, port, pp=pp),
                      env={"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "3"}) as head:
        head.wait_ready(timeout=120)
        w1.proc.kill()                                      # the node's vLLM dies (SIGKILL)
        quiet = len(head.log)
        time.sleep(3)                                       # idle: not noticed
        assert head.proc.poll() is None
        assert get(head.url("/health")) == 200
        assert "ERROR" not in head.log[quiet:]
        code, took = failed_completion(head.port)
        assert code == 500
        # TP fails at once, PP only once its execute timeout (3 s) has passed: told apart by the
        # timeout's own line below, and PP never before 3 s (an upper bound is a busy machine's figure)
        if layout == "pp":
            assert took >= 3, took
        assert head.wait_exit(30) == 1
        assert re.search(r"^\(Worker_(PP0_)?TP0 pid=\d+\) RuntimeError: \[.*pair\.cc:\d+\] Connection closed by peer "
                         r"\[127\.0\.0\.1\]:\d+$", head.log, re.M), head.log[-2000:]
        if layout == "pp":
            assert re.search(r"^\(EngineCore(_DP0)? pid=\d+\) TimeoutError: RPC call to sample_tokens timed out\.$",
                             head.log, re.M), head.log[-2000:]
        else:
            assert "RuntimeError: Worker failed with error" in head.log
            assert "RPC call to sample_tokens timed out" not in head.log, head.log[-2000:]
        assert fatal(head.log)[0].key == "peer-closed"
        assert titles(nodes[0]) == []


@pytest.mark.parametrize("local", [1, 2], ids=["dp2-tp8", "dp4-tp4"])
def test_data_parallel_across_nodes_handshakes_then_serves(nodes, local):
    rpc = free_port()
    tp = 8 // local
    with SimServer(nodes[1], dp_argv(nodes[1], 1, rpc, local)) as w1:
        w1.wait_for("data parallel engine(s) in headless mode")
        with SimServer(nodes[0], dp_argv(nodes[0], 0, rpc, local)) as head:
            head.wait_ready(timeout=120)
            assert complete(head.port)["usage"]["completion_tokens"] == 4
            log = w1.log
            assert re.search(rf"^INFO .*\[serve\.py:239\] Launching {local} data parallel engine\(s\) in "
                             rf"headless mode, with head node address tcp://127\.0\.0\.1:{rpc}\.$", log, re.M)
            for d in range(local, 2 * local):
                assert re.search(rf"^\(EngineCore_DP{d} pid=\d+\) INFO .* Initializing a V1 LLM engine", log, re.M)
            assert "Starting vLLM server" not in log
            assert titles(nodes[1]) == sorted(f"VLLM::Worker_DP{d}_TP{t}_EP{d * tp + t}"
                                              for d in range(local, 2 * local) for t in range(tp))
            assert titles(nodes[0]) == sorted(f"VLLM::Worker_DP{d}_TP{t}_EP{d * tp + t}"
                                              for d in range(local) for t in range(tp))
            w1.proc.send_signal(signal.SIGTERM)
            assert w1.wait_exit(30) == 0
            assert head.wait_exit(30) == 1                  # a lost engine kills the serving head
            assert fatal(head.log)[0].key == "peer-closed"


def test_a_dp_engine_that_cannot_reach_the_head_gives_up_with_vllms_handshake_line(nodes):
    manager.add_fault("sim-2", "unreachable-head", home=nodes[1].home)
    with SimServer(nodes[1], dp_argv(nodes[1], 1, free_port()), env={"VLLM_SIM_JOIN_TIMEOUT_S": "2"}) as w1:
        assert w1.wait_exit(60) == 0                        # run_headless returns after its engines died
        assert "RuntimeError: Did not receive response from front-end process within 5 minutes" in w1.log
        assert w1.log.rstrip().endswith("Shutting down.")
        assert fatal(w1.log)[0].key == "dp-handshake-timeout"


def test_the_multinode_lines_are_vllms_and_torchs_own(vllm_parser_python, tmp_path):
    """Every piece of every line in the simulator's MULTINODE_LINES stands in vLLM 0.33's source
    (or in torch's C++ library, for torch's messages) as installed in the real parser venv."""
    problems = vllm_contract.multinode_source_problems(vllm_parser_python)
    assert problems == []


def test_a_headless_rank_stopped_while_it_waits_for_the_head_exits_and_frees_its_gpus(nodes):
    with SimServer(nodes[1], tp_pp_argv(nodes[1], 1, 2, free_port())) as w1:
        w1.wait_for("distributed_init_method=tcp://127.0.0.1:", timeout=30)
        wait_until(lambda: len(titles(nodes[1])) == 8, 30, "eight workers registered")
        servers = manager.status(nodes[1].home)["hosts"]["sim-2"]["vllm_servers"]   # `sim status` sees it
        assert [(s["pid"], s["headless"], s["node_rank"]) for s in servers] == [(w1.proc.pid, True, 1)]
        w1.proc.send_signal(signal.SIGTERM)
        assert w1.wait_exit(30) == 0
        assert titles(nodes[1]) == []


def test_the_multinode_faults_are_listed_with_their_help():
    catalog = manager.fault_catalog()
    assert "cannot reach the head" in catalog["unreachable-head"]
    assert "crashes while loading" in catalog["rank-crash-loading"]
    assert "another revision" in catalog["wrong-revision"]
