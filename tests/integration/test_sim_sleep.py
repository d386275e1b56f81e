"""The simulated vLLM's sleep mode, as vLLM 0.33 has it (entrypoints/serve/dev/sleep/api_router.py,
v1/executor/abstract.py, v1/worker/gpu_worker.py, device_allocator/cumem.py): the endpoints exist
only with VLLM_SERVER_DEV_MODE=1, outside the API key; a sleep frees the GPUs but for a CUDA context
each (level 1 keeps the weights in host RAM); a wake needs the memory back; the faults."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

from orchestrator.host.nvidia_smi import parse_gpus
from orchestrator.sim import vllm_server
from orchestrator.sim.fault_file import add_fault
from tests.plugins.sim_hosts import SimServer, make_model

RESIDENT = vllm_server.CUDA_CONTEXT_MIB + vllm_server.GRAPH_POOL_MIB + vllm_server.NCCL_BUFFERS_MIB
ARGV = ["--served-model-name", "tiny", "--tensor-parallel-size", "2", "--gpu-memory-utilization",
        "0.9", "--max-model-len", "4096"]
DEV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": "sekrit"}
KEY = {"authorization": "Bearer sekrit"}


def call(srv, method, path, body=None, headers=None):
    req = urllib.request.Request(srv.url(path), method=method, headers={
        "content-type": "application/json", **(headers or {})},
        data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def used(sim_host) -> dict:
    return {g.index: g.memory_used_mib for g in parse_gpus(sim_host.nvidia_smi(
        "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"), ["index", "memory.used"])}


def answer(srv) -> str:
    _, out = call(srv, "POST", "/v1/completions", {"model": "tiny", "prompt": "What is 2+2?",
                                                   "max_tokens": 16, "temperature": 0}, KEY)
    return out["choices"][0]["text"]


def sleep_state(srv) -> dict:
    """vllm:engine_sleep_state by its sleep_state label (one engine)."""
    with urllib.request.urlopen(srv.url("/metrics"), timeout=30) as r:
        text = r.read().decode()
    return {lab: float(v) for lab, v in re.findall(r'vllm:engine_sleep_state\{[^}]*sleep_state="(\w+)"[^}]*\} (\S+)', text)}


def model(sim_host):
    return make_model(sim_host.dir, "tiny", "meta-llama/Llama-3.1-8B-Instruct", shards=2,
                      total_size=16e9, custom_code=False)


def test_without_dev_mode_the_endpoints_do_not_exist(sim_host):
    with SimServer(sim_host, [str(model(sim_host)), *ARGV, "--enable-sleep-mode"]) as srv:
        srv.wait_ready()
        assert call(srv, "POST", "/sleep?level=1") == (404, {"detail": "Not Found"})
        assert call(srv, "GET", "/is_sleeping")[0] == 404
        assert "SECURITY WARNING" not in srv.log


def test_sleep_and_wake_free_and_take_back_the_gpus_with_vllms_lines(sim_host):
    with SimServer(sim_host, [str(model(sim_host)), *ARGV, "--enable-sleep-mode"], env=DEV) as srv:
        srv.wait_ready()
        log = srv.log
        assert ("SECURITY WARNING: Development endpoints are enabled! This should NOT be used in "
                "production!") in log
        assert "Route: /wake_up, Methods: POST" in log
        before = answer(srv)
        awake = used(sim_host)
        assert awake[0] > 80000 and awake[1] > 80000
        # the dev endpoints are outside GUARDED_PREFIX: no key needed (vLLM's middleware)
        assert call(srv, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
        assert call(srv, "POST", "/sleep?level=3")[0] == 422
        assert call(srv, "POST", "/sleep?level=1") == (200, {"status": "sleeping", "level": 1})
        assert call(srv, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
        asleep = used(sim_host)
        # vLLM 0.33 keeps the CUDA-graph pool (not offloaded by default) and NCCL's buffers (TP2)
        kept = vllm_server.CUDA_CONTEXT_MIB + vllm_server.GRAPH_POOL_MIB + vllm_server.NCCL_BUFFERS_MIB
        assert asleep[0] == kept and asleep[1] == kept
        srv.wait_for("It took ")
        log = srv.log
        assert "Using sleep-mode backend: cumem" in log
        assert "GiB is backed up in CPU" in log
        assert "Sleep mode freed " in log and " GiB memory is still in use." in log
        assert " seconds to fall asleep." in log
        assert call(srv, "POST", "/wake_up") == (200, {"status": "awake", "tags": None})
        assert "wake up the engine with tags: None" in srv.log
        assert "seconds to wake up tags {'weights', 'kv_cache'}." in srv.log
        assert used(sim_host) == awake
        assert answer(srv) == before


def test_a_level_2_wake_maps_empty_weights_until_reload_weights_reads_them(sim_host):
    """vLLM 0.33 restores a level-2 sleep as snapshot/server.py does: wake the weights, then
    collective_rpc("reload_weights"), then the KV cache. A bare /wake_up maps the weights back
    without their contents (cumem backs up only level 1's): junk until a reload."""
    with SimServer(sim_host, [str(model(sim_host)), *ARGV, "--enable-sleep-mode"], env=DEV) as srv:
        srv.wait_ready()
        good, awake = answer(srv), used(sim_host)
        assert sleep_state(srv) == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
        # a bare wake after level 2: fully awake, answering junk
        assert call(srv, "POST", "/sleep?level=2")[0] == 200
        assert sleep_state(srv) == {"awake": 0.0, "weights_offloaded": 0.0, "discard_all": 1.0}
        assert call(srv, "POST", "/wake_up") == (200, {"status": "awake", "tags": None})
        assert answer(srv) != good
        # reload_weights reads the checkpoint into the mapped weights: sensible again
        assert call(srv, "POST", "/collective_rpc", {"method": "reload_weights"}) == (200, {"results": [None, None]})
        assert answer(srv) == good
        srv.wait_for("Reloading and processing weights took ")
        assert "Reloading weights inplace..." in srv.log
        # vLLM's order, each step as vLLM answers it: a partial wake is "sleeping", no request runs
        assert call(srv, "POST", "/sleep?level=2")[0] == 200
        assert call(srv, "POST", "/wake_up?tags=weights") == (200, {"status": "sleeping", "tags": ["weights"]})
        assert call(srv, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
        part = used(sim_host)
        assert sleep_state(srv)["awake"] == 0.0          # vLLM records awake only once fully awake
        assert RESIDENT < part[0] < awake[0]        # the weights' share is mapped, the KV cache is not
        assert call(srv, "POST", "/wake_up?tags=weights") == (200, {"status": "sleeping", "tags": ["weights"]})
        srv.wait_for("Tag weights is not in sleeping tags {'kv_cache'}")
        assert call(srv, "POST", "/collective_rpc", {"method": "reload_weights"})[0] == 200
        assert call(srv, "POST", "/wake_up?tags=kv_cache") == (200, {"status": "awake", "tags": ["kv_cache"]})
        assert used(sim_host) == awake
        assert answer(srv) == good
        # the RPC's own checks (entrypoints/serve/dev/rpc/api_router.py)
        assert call(srv, "POST", "/collective_rpc", {})[0] == 400
        assert call(srv, "POST", "/collective_rpc", [1])[0] == 400


def test_reload_weights_into_sleeping_weights_kills_the_engine(sim_host):
    """The weights' memory is not mapped while they sleep: the copy faults, as on a GPU."""
    with SimServer(sim_host, [str(model(sim_host)), *ARGV, "--enable-sleep-mode"], env=DEV) as srv:
        srv.wait_ready()
        assert call(srv, "POST", "/sleep?level=2")[0] == 200
        status, out = call(srv, "POST", "/collective_rpc", {"method": "reload_weights"})
        assert status == 500 and "illegal memory access" in out["error"]["message"]
        srv.wait_for("an illegal memory access was encountered")
        assert call(srv, "GET", "/health")[0] != 200


def test_a_level_1_wake_needs_no_reload(sim_host):
    with SimServer(sim_host, [str(model(sim_host)), *ARGV, "--enable-sleep-mode"], env=DEV) as srv:
        srv.wait_ready()
        good = answer(srv)
        assert call(srv, "POST", "/sleep?level=1")[0] == 200
        assert sleep_state(srv) == {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0}
        assert call(srv, "POST", "/wake_up?tags=weights")[1]["status"] == "sleeping"
        assert call(srv, "POST", "/wake_up?tags=kv_cache")[1]["status"] == "awake"
        assert answer(srv) == good


def test_without_enable_sleep_mode_a_sleep_frees_nothing(sim_host):
    with SimServer(sim_host, [str(model(sim_host)), *ARGV], env=DEV) as srv:
        srv.wait_ready()
        awake = used(sim_host)
        assert call(srv, "POST", "/sleep?level=1")[0] == 200
        assert used(sim_host) == awake
        srv.wait_for("Sleep mode freed 0.0 GiB memory")


def test_a_wake_fails_while_another_process_holds_the_memory(sim_host):
    with SimServer(sim_host, [str(model(sim_host)), *ARGV, "--enable-sleep-mode"], env=DEV) as srv:
        srv.wait_ready()
        assert call(srv, "POST", "/sleep?level=2")[0] == 200
        with SimServer(sim_host, [str(model(sim_host)), *ARGV]) as other:
            other.wait_ready()
            status, out = call(srv, "POST", "/wake_up")
            assert status == 500 and "out of memory" in out["error"]["message"]
            assert call(srv, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
        assert call(srv, "POST", "/wake_up")[0] == 200


def test_faults_wake_fails_wake_corrupt_and_vram_leak(sim_host):
    with SimServer(sim_host, [str(model(sim_host)), *ARGV, "--enable-sleep-mode"], env=DEV) as srv:
        srv.wait_ready()
        good = answer(srv)
        add_fault(sim_host.dir, "vram-leak", "tiny", mib=1000)
        add_fault(sim_host.dir, "wake-fails", "tiny")
        assert call(srv, "POST", "/sleep?level=1")[0] == 200
        assert used(sim_host)[0] == RESIDENT + 1000
        assert call(srv, "POST", "/wake_up")[0] == 500
        assert call(srv, "POST", "/wake_up")[0] == 200        # the fault fired once
        assert call(srv, "POST", "/sleep?level=1")[0] == 200
        assert used(sim_host)[0] == RESIDENT + 2000   # grows per cycle
        add_fault(sim_host.dir, "wake-corrupt", "tiny")
        assert call(srv, "POST", "/wake_up")[0] == 200
        assert answer(srv) != good


def test_the_health_check_leaves_a_sleeping_server_alone(sim_host, tmp_path, monkeypatch):
    """The health timer's check sends a one-token completion, which a sleeping vLLM holds until a
    wake: it counted as a hang and restarted the service cold. It asks /is_sleeping first."""
    import importlib.util

    from orchestrator.paths import package_file
    spec = importlib.util.spec_from_file_location("unit_probe_sleep", package_file("host", "remote", "unit_probe.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "unit_show", lambda unit, prop: "active")
    monkeypatch.setattr(mod, "api_key", lambda: None)
    with SimServer(sim_host, [str(model(sim_host)), *ARGV, "--enable-sleep-mode"],
                   env={"VLLM_SERVER_DEV_MODE": "1"}) as srv:
        srv.wait_ready()
        args = ["check", "--unit", "vllm-tiny.service", "--port", str(srv.port), "--served-name", "tiny",
                "--model", "tiny", "--failures", "1", "--timeout", "2", "--state-dir", str(tmp_path)]
        assert mod.main(args) == 0
        assert call(srv, "POST", "/sleep?level=1")[0] == 200
        assert mod.main(args) == 0
        state = json.loads((tmp_path / "health" / "tiny.json").read_text())
        assert state["last"]["note"] == "asleep (sleep mode): not probed" and state["failures"] == 0


def test_sleep_aborts_the_requests_in_flight_unless_asked_to_wait(sim_host):
    # /sleep's mode defaults to "abort" in vLLM 0.33 (serve/dev/sleep/api_router.py): the requests in
    # flight end at once with finish_reason "abort". The simulator let them run on after their memory
    # was freed. "wait" lets them finish first (new ones queue until the wake).
    import threading
    import time

    with SimServer(sim_host, [str(model(sim_host)), *ARGV, "--enable-sleep-mode"], env=DEV) as srv:
        srv.wait_ready()

        def long_request(out: list) -> threading.Thread:
            body = {"model": "tiny", "prompt": "Count slowly.", "max_tokens": 300, "min_tokens": 300}
            t = threading.Thread(target=lambda: out.append(call(srv, "POST", "/v1/completions", body, KEY)))
            t.start()
            return t

        cut: list = []
        t = long_request(cut)
        time.sleep(1.0)
        assert call(srv, "POST", "/sleep?level=1") == (200, {"status": "sleeping", "level": 1})
        t.join(60)
        assert cut[0][0] == 200 and cut[0][1]["choices"][0]["finish_reason"] == "abort", cut
        assert call(srv, "POST", "/wake_up")[0] == 200
        kept: list = []
        t = long_request(kept)
        time.sleep(1.0)
        assert call(srv, "POST", "/sleep?level=1&mode=wait") == (200, {"status": "sleeping", "level": 1})
        assert not t.is_alive(), "the sleep answers once the request in flight has finished"
        t.join(60)
        assert kept[0][1]["choices"][0]["finish_reason"] in ("stop", "length"), kept     # not "abort"
        assert "Waiting for in-flight requests to complete before sleeping..." in srv.log


def test_offloaded_cuda_graphs_leave_the_gpu_with_the_rest(sim_host):
    """--sleep-mode-offload-cudagraph (vllm/config/model.py sleep_mode_offload_cudagraph): the graph
    pool goes to the cumem pool that sleep unmaps; the context and NCCL's buffers stay."""
    argv = [str(model(sim_host)), *ARGV, "--enable-sleep-mode", "--sleep-mode-offload-cudagraph"]
    with SimServer(sim_host, argv, env=DEV) as srv:
        srv.wait_ready()
        assert call(srv, "POST", "/sleep?level=1")[0] == 200
        kept = used(sim_host)
        assert kept[0] == kept[1] == vllm_server.CUDA_CONTEXT_MIB + vllm_server.NCCL_BUFFERS_MIB
