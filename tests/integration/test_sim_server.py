"""The simulated vLLM server, started by hand with a manifest-like argv, passes the probes vLLM
would, fails the way vLLM fails, and holds GPU memory the way vLLM's workers do."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from orchestrator.host.nvidia_smi import parse_compute_apps, parse_gpus
from orchestrator.sim import manager, pagecache
from tests.plugins.sim_hosts import SimServer, make_model, wait_until

KIMI_ARGV = ["--served-model-name", "kimi-k25", "--trust-remote-code", "--tensor-parallel-size",
             "8", "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2",
             "--reasoning-parser", "kimi_k2", "--kv-cache-dtype", "fp8",
             "--gpu-memory-utilization", "0.93", "--max-model-len", "65536",
             "--mm-encoder-tp-mode", "data", "--compilation-config.pass_config.fuse_allreduce_rms",
             "true", "--enable-prefix-caching", "--async-scheduling"]
SMOKE = "What is 2+2? Answer with one number."


def get(url, headers=None):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post(url, body, headers=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.read()


def stream_chat(port, body, timeout=60.0):
    """POST a streaming chat request; returns [(arrival time, chunk dict or '[DONE]')]."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                 {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("content-type").startswith("text/event-stream")
    events = []
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[6:]
            events.append((time.monotonic(), data if data == "[DONE]" else json.loads(data)))
    conn.close()
    return events


def kimi(sim_host, name="kimi-k25-int4", repo="moonshotai/Kimi-K2.5", **kw):
    return make_model(sim_host.dir, name, repo, shards=kw.pop("shards", 64),
                      total_size=kw.pop("total_size", 547e9), **kw)


def test_start_probes_and_serving(sim_host):
    model = kimi(sim_host)
    with SimServer(sim_host, [str(model), *KIMI_ARGV]) as srv:
        srv.wait_for("Loading safetensors checkpoint shards")
        with pytest.raises(ConnectionRefusedError):      # bound, not listening, while loading
            socket.create_connection(("127.0.0.1", srv.port), timeout=1).close()
        srv.wait_ready()
        log = srv.log
        order = ["vLLM server version 0.33.0", "non-default args:", "Starting to load model",
                 "Loading safetensors checkpoint shards: 100% Completed | 64/64",
                 "Loading weights took", "Model loading took", "Available KV cache memory:",
                 "GPU KV cache size:", "Maximum concurrency for 65,536 tokens per request",
                 "Graph capturing finished in", "init engine (profile, create kv cache, warmup",
                 "Starting vLLM server on http://127.0.0.1:", "Available routes are:",
                 "Route: /health, Methods: GET", "INFO:     Started server process",
                 "INFO:     Waiting for application startup.",
                 "INFO:     Application startup complete."]
        positions = [log.index(s) for s in order]
        assert positions == sorted(positions)
        assert "Uvicorn running on" not in log
        assert re.search(r"^\(APIServer pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[entry\.py:139\] ",
                         log, re.M)
        assert re.search(r"^\(Worker_TP7 pid=\d+\) INFO ", log, re.M)
        assert re.search(r"^\(EngineCore pid=\d+\) INFO .*GPU KV cache size: [\d,]+ tokens",
                         log, re.M)

        status, body = get(srv.url("/health"))
        assert (status, body) == (200, b"")
        status, body = get(srv.url("/v1/models"))
        card = json.loads(body)["data"][0]
        assert (card["id"], card["owned_by"], card["max_model_len"]) == ("kimi-k25", "vllm", 65536)
        assert card["root"] == str(model)
        assert json.loads(get(srv.url("/version"))[1]) == {"version": "0.33.0"}

        # non-streaming smoke: a sensible answer, reasoning split out, usage counts it
        _, body = post(srv.url("/v1/chat/completions"),
                       {"model": "kimi-k25", "messages": [{"role": "user", "content": SMOKE}],
                        "max_tokens": 200})
        out = json.loads(body)
        msg = out["choices"][0]["message"]
        assert msg["content"] == "4" and msg["reasoning"]
        assert out["choices"][0]["finish_reason"] == "stop"
        details = out["usage"]["completion_tokens_details"]["reasoning_tokens"]
        assert out["usage"]["completion_tokens"] == details + 1

        # streaming: role chunk, reasoning deltas, then content, finish_reason, usage, [DONE]
        events = stream_chat(srv.port, {"model": "kimi-k25", "max_tokens": 200,
                                        "messages": [{"role": "user", "content": SMOKE}],
                                        "stream_options": {"include_usage": True}})
        chunks = [e for _, e in events]
        assert chunks[-1] == "[DONE]"
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        kinds = [next(iter(c["choices"][0]["delta"])) for c in chunks[1:-2]]
        assert kinds[0] == "reasoning" and kinds[-1] == "content"
        assert kinds == sorted(kinds, key=lambda k: k != "reasoning")
        assert chunks[-3]["choices"][0]["finish_reason"] == "stop"
        usage = chunks[-2]["usage"]
        assert chunks[-2]["choices"] == []
        assert usage["completion_tokens"] == len(kinds)
        assert usage["completion_tokens_details"]["reasoning_tokens"] == kinds.count(
            "reasoning")

        # max_tokens / min_tokens / ignore_eos
        _, body = post(srv.url("/v1/chat/completions"),
                       {"model": "kimi-k25", "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 30, "ignore_eos": True})
        out = json.loads(body)
        assert out["usage"]["completion_tokens"] == 30
        assert out["choices"][0]["finish_reason"] == "length"

        metrics = get(srv.url("/metrics"))[1].decode()
        for name in ("vllm:num_requests_running{", "vllm:num_requests_waiting{",
                     "vllm:kv_cache_usage_perc{", "vllm:num_preemptions_total{",
                     "vllm:prompt_tokens_total{", "vllm:generation_tokens_total{",
                     'vllm:request_success_total{engine="0",finished_reason="stop",'
                     'model_name="kimi-k25"} 2.0',
                     "vllm:time_to_first_token_seconds_bucket{",
                     "vllm:e2e_request_latency_seconds_count{"):
            assert name in metrics
        assert "# TYPE vllm:kv_cache_usage_perc gauge" in metrics


@pytest.mark.parametrize("flags,shown", [
    (["--swap-space", "4"], "--swap-space 4"),
    (["--enable-reasoning"], "--enable-reasoning"),
    (["--guided-decoding-backend", "xgrammar"], "--guided-decoding-backend xgrammar"),
])
def test_removed_flags_are_rejected_like_argparse(sim_host, flags, shown):
    srv = SimServer(sim_host, ["/nonexistent/model", *flags])
    assert srv.wait_exit() == 2
    err = srv.stderr
    assert err.startswith("usage: vllm [-h] [-v]")
    assert err.rstrip().endswith(f"vllm: error: unrecognized arguments: {shown}")


def test_missing_model_folder_fails(sim_host):
    srv = SimServer(sim_host, ["/nonexistent/model"])
    assert srv.wait_exit() == 1
    assert "Repo id must be in the form 'repo_name' or 'namespace/repo_name'" in srv.log


def run_with_fault(sim_host, fault, argv_extra=(), model_name="kimi-k25-int4", **model_kw):
    model = kimi(sim_host, name=model_name, **model_kw)
    manager.add_fault("sim", fault, model_name, home=sim_host.home)
    return SimServer(sim_host, [str(model), "--served-model-name", "kimi-k25",
                                "--trust-remote-code", "--max-model-len", "65536", "-tp", "8", *argv_extra])


def test_fault_crash_flashinfer(sim_host):
    with run_with_fault(sim_host, "crash-flashinfer") as srv:
        assert srv.wait_exit() != 0
        log = srv.log
        assert "Loading safetensors checkpoint shards" in log    # fails after some loading
        assert ("RuntimeError: flashinfer-cubin version (0.7.2) does not match flashinfer "
                "version (0.7.2.post1). Please install the same version of both packages. Set "
                "FLASHINFER_DISABLE_VERSION_CHECK=1 to bypass this check.") in log
        assert log.index("flashinfer-cubin version") < log.index("EngineCore failed to start.")
        assert ("RuntimeError: Engine core initialization failed. See root cause above. "
                "Failed core proc(s): {'EngineCore_DP0': 1}") in log
        assert not srv.holders() or not sim_host.nvidia_smi(
            "--query-compute-apps=pid", "--format=csv,noheader").strip()
    # the cubin package stays mismatched (a real cause) until the fault is cleared
    with SimServer(sim_host, [str(sim_host.dir / "models" / "kimi-k25-int4"),
                              "--trust-remote-code", "--max-model-len", "65536", "-tp", "8"]) as srv:
        assert srv.wait_exit() != 0 and "does not match flashinfer version" in srv.log
    manager.clear_faults("sim", home=sim_host.home)
    with SimServer(sim_host, [str(sim_host.dir / "models" / "kimi-k25-int4"),
                              "--trust-remote-code", "--max-model-len", "65536", "-tp", "8"]) as srv:
        srv.wait_ready()


def test_fault_crash_gpu_memory(sim_host):
    with run_with_fault(sim_host, "crash-gpu-memory") as srv:
        assert srv.wait_exit() != 0
        assert re.search(r"ValueError: Free memory on device cuda:0 \([\d.]+/95\.59 GiB\) on "
                         r"startup is less than desired GPU memory utilization \(0\.9, 86\.03 "
                         r"GiB\)\. Decrease GPU memory utilization or reduce GPU memory used by "
                         r"other processes\.", srv.log)
        assert "EngineCore failed to start." in srv.log


def test_fault_crash_unrecognized_args(sim_host):
    with run_with_fault(sim_host, "crash-unrecognized-args") as srv:
        assert srv.wait_exit() == 2
        assert "vllm: error: unrecognized arguments:" in srv.stderr


def test_fault_crash_trust_remote_code(sim_host):
    with run_with_fault(sim_host, "crash-trust-remote-code") as srv:
        assert srv.wait_exit() == 1
        assert "contains custom code which must be executed to correctly load the model" in srv.log
        assert "trust_remote_code=True" in srv.log
    # and for real: a custom-code model without --trust-remote-code
    model = sim_host.dir / "models" / "kimi-k25-int4"
    with SimServer(sim_host, [str(model)]) as srv:
        assert srv.wait_exit() == 1 and "contains custom code" in srv.log


def test_fault_hang(sim_host):
    with run_with_fault(sim_host, "hang", total_size=2e12) as srv:   # ~4 s load at speed 2000
        srv.wait_for("Loading safetensors checkpoint shards")
        # hung: the log stops growing for good (1 s without a line, then still nothing 1 s later),
        # the process lives on and never finishes loading
        quiet = {"log": srv.log, "since": time.monotonic()}

        def silent_for_a_second() -> bool:
            if srv.log != quiet["log"]:
                quiet.update(log=srv.log, since=time.monotonic())
            return time.monotonic() - quiet["since"] >= 1.0
        wait_until(silent_for_a_second, budget=20, what="the log going quiet")
        before = srv.log
        time.sleep(1.0)
        assert srv.log == before and srv.proc.poll() is None
        assert "Loading weights took" not in before
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", srv.port), timeout=1).close()


def test_fault_die_after_ready(sim_host):
    with run_with_fault(sim_host, "die-after-ready") as srv:
        srv.wait_ready()
        assert get(srv.url("/health"))[0] == 200
        assert srv.wait_exit(timeout=10) == 1
        assert "EngineCore encountered a fatal error." in srv.log
        assert "EngineDeadError" in srv.log


def test_fault_garbage(sim_host):
    with run_with_fault(sim_host, "garbage") as srv:
        srv.wait_ready()
        _, body = post(srv.url("/v1/chat/completions"),
                       {"model": "kimi-k25", "messages": [{"role": "user", "content": SMOKE}],
                        "max_tokens": 100})
        content = json.loads(body)["choices"][0]["message"]["content"]
        assert content.strip() != "4" and len(content.split()) > 3


def test_fault_slow_start(sim_host):
    took = {}
    for fault in (None, "slow-start"):
        model = kimi(sim_host)
        pagecache.evict_model(model)                       # from the simulated disk: ~0.9 s at speed 2000
        if fault:
            manager.add_fault("sim", fault, None, home=sim_host.home)
        with SimServer(sim_host, [str(model), *KIMI_ARGV]) as srv:
            srv.wait_ready(timeout=60)
            took[fault] = float(re.search(r"Loading weights took ([\d.]+) seconds",
                                          srv.log).group(1))
    # 5x on the simulated schedule; a busy machine adds the same CPU time to both (a bound, not a figure)
    assert took["slow-start"] > 3 * took[None]


def test_workers_outlive_sigkill_and_block_the_next_start(sim_host):
    model = make_model(sim_host.dir, "minimax-m25", "MiniMaxAI/MiniMax-M2.5", total_size=230e9)
    srv = SimServer(sim_host, [str(model), "--trust-remote-code", "--max-model-len", "65536", "-tp", "4"],
                    env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    try:
        srv.wait_ready()
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
        apps = parse_compute_apps(sim_host.nvidia_smi(
            "--query-compute-apps=pid,process_name,used_memory,gpu_uuid",
            "--format=csv,noheader,nounits"), ["pid", "process_name", "used_memory", "gpu_uuid"])
        assert sorted(a.process_name for a in apps) == [f"VLLM::Worker_TP{i}" for i in range(4)]
        # the engine core (no GPU memory) notices its parent is gone and exits
        wait_until(lambda: not [p for p in os.listdir("/proc") if p.isdigit() and _comm(p) ==
                                "VLLM::EngineCor" and str(sim_host.dir) in _cmdline(p)],
                   what="the engine core exiting")
        assert all(a.used_memory_mib > 80000 for a in apps)
        for a in apps:   # the real process name and comm, as `ps`/pkill see them
            assert open(f"/proc/{a.pid}/comm").read().strip() == "VLLM::Worker_TP"
            assert open(f"/proc/{a.pid}/cmdline").read().startswith(a.process_name)
        gpus = parse_gpus(sim_host.nvidia_smi("--query-gpu=index,memory.used",
                                              "--format=csv,noheader,nounits"),
                          ["index", "memory.used"])
        assert [g.memory_used_mib > 80000 for g in gpus] == [True] * 4 + [False] * 4
        # the zombies make the next start on those GPUs fail like real vLLM
        with SimServer(sim_host, [str(model), "--trust-remote-code", "--max-model-len", "65536", "-tp", "2"],
                       env={"CUDA_VISIBLE_DEVICES": "2,3"}) as again:
            assert again.wait_exit() == 1
            assert re.search(r"Free memory on device cuda:0 \([\d.]+/95\.59 GiB\) on startup is "
                             r"less than desired GPU memory utilization", again.log)
        for a in apps:
            os.kill(a.pid, signal.SIGKILL)
        wait_until(lambda: sim_host.nvidia_smi("--query-compute-apps=pid", "--format=csv,noheader").strip() == "",
                   what="nvidia-smi showing the killed workers gone")
    finally:
        srv.stop()


def test_kimi_does_not_fit_on_two_gpus(sim_host):
    with SimServer(sim_host, [str(kimi(sim_host)), "--trust-remote-code", "--max-model-len", "65536", "-tp", "2"]) as srv:
        assert srv.wait_exit() == 1
        assert "torch.OutOfMemoryError: CUDA out of memory." in srv.log


def _comm(pid):
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""


def _cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline").read()
    except OSError:
        return ""


def test_sigterm_stops_workers(sim_host):
    model = kimi(sim_host)
    srv = SimServer(sim_host, [str(model), "--trust-remote-code", "--max-model-len", "65536", "-tp", "8"])
    srv.wait_ready()
    assert len(srv.holders()) == 8
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.wait_exit() == 0
    assert "INFO:     Application shutdown complete." in srv.log
    assert sim_host.nvidia_smi("--query-compute-apps=pid", "--format=csv,noheader") == ""
    assert not list((sim_host.dir / "run").glob("*.json"))


def _stream_rate(port, n_tokens, results, i):
    events = stream_chat(port, {"model": "kimi", "max_tokens": n_tokens, "ignore_eos": True,
                                "messages": [{"role": "user", "content": "Tell me a story."}]})
    times = [t for t, c in events if c != "[DONE]" and c["choices"]
             and c["choices"][0]["delta"].get("content", c["choices"][0]["delta"].get(
                 "reasoning")) is not None and "role" not in c["choices"][0]["delta"]]
    results[i] = (len(times), times[0], times[-1])


def test_token_rates_follow_the_nvfp4_profile(sim_host):
    model = make_model(sim_host.dir, "kimi-k25-nvfp4", "nvidia/Kimi-K2.5-NVFP4",
                       total_size=540e9)
    with SimServer(sim_host, [str(model), "--trust-remote-code", "--max-model-len", "65536", "-tp", "8",
                              "--served-model-name", "kimi"]) as srv:
        srv.wait_ready()
        one = {}
        _stream_rate(srv.port, 62, one, 0)
        n, t0, t1 = one[0]
        single = (n - 1) / (t1 - t0)
        # Margins a busy machine keeps, still apart from the INT4 profile (79) and from C=16/64;
        # the tight figures: benchmarks/bench_sim_profile.py, docs/figures.md.
        assert single == pytest.approx(61.3, rel=0.15)

        results = {}
        threads = [threading.Thread(target=_stream_rate, args=(srv.port, 40, results, i))
                   for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        per_stream = [(n - 1) / (t1 - t0) for n, t0, t1 in results.values()]
        assert len(per_stream) == 32
        print(f"\nNVFP4 single stream {single:.1f} tok/s; C=32 aggregate {sum(per_stream):.0f} tok/s")
        assert sum(per_stream) == pytest.approx(800, rel=0.15)


def test_the_perf_measurement_follows_the_layout_profile(sim_host):
    """probe/perf.py through the host against the DCP 8 layout (62 tok/s single stream; 335 tok/s
    at 8 streams, the aggregate including each request's prefill): the figures a deploy checks
    against the manifest's floor: both are measured, through the host, with no failed stream. How close
    they come to the layout is a timing (a busy machine slows the simulator and its client alike),
    printed by benchmarks/bench_sim_profile.py (its perf-step section) and kept in docs/figures.md."""
    from orchestrator.probe.api import Endpoint
    from orchestrator.probe.perf import measure

    model = kimi(sim_host)
    with SimServer(sim_host, [str(model), "--trust-remote-code", "--max-model-len", "65536", "-tp", "8",
                              "--decode-context-parallel-size", "8", "--kv-cache-dtype", "fp8",
                              "--served-model-name", "kimi"]) as srv:
        srv.wait_ready()
        got = measure(Endpoint(sim_host.host, srv.port), "kimi", max_tokens=64, single=True, concurrency=8,
                      timeout=60)
        print(f"\nDCP8 single stream {got.single_stream_tok_s:.1f} tok/s; C=8 {got.concurrency_tok_s:.0f} tok/s "
              f"in {got.seconds:.1f}s")
        assert got.problems == []
        assert got.single_stream_tok_s is not None and got.single_stream_tok_s > 0
        assert got.concurrency == 8 and got.concurrency_tok_s is not None and got.concurrency_tok_s > 0


def test_disable_log_stats_removes_every_vllm_series(sim_host):
    # vLLM 0.33 with --disable-log-stats makes no stat loggers (vllm/v1/engine/async_llm.py): /metrics
    # answers, without one vllm:* family. The simulator served them all anyway.
    model = kimi(sim_host)
    with SimServer(sim_host, [str(model), *KIMI_ARGV, "--disable-log-stats"]) as srv:
        srv.wait_ready()
        status, body = get(srv.url("/metrics"))
        assert status == 200 and b"vllm:" not in body and b"python_info" in body, body[:500]
    with SimServer(sim_host, [str(model), *KIMI_ARGV]) as srv:
        srv.wait_ready()
        status, body = get(srv.url("/metrics"))
        assert status == 200 and b"vllm:kv_cache_usage_perc" in body
