"""The simulated vLLM behaves like vLLM 0.33 where issue #12 found it kinder than the real thing:
the API key is enforced on /v1/* exactly as vLLM's AuthenticationMiddleware does, and a
data-parallel service runs one engine per DP rank with vLLM's process titles and per-engine
metric series (checked against /metrics text recorded from vLLM 0.33.0's own metrics code)."""

from __future__ import annotations

import gzip
import json
import os
import re
import threading
from pathlib import Path

import pytest

from orchestrator.host import http
from orchestrator.host.local import LocalHost
from orchestrator.host.nvidia_smi import parse_compute_apps
from orchestrator.probe import api as probes
from orchestrator.probe import metrics
from orchestrator.secret import Secret
from tests.plugins.sim_hosts import SimServer, make_model

LOCAL = LocalHost("local")
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-metrics"
CHAT = {"model": "small", "messages": [{"role": "user", "content": "What is 2+2?"}],
        "max_tokens": 20}


def small(sim_host):
    return make_model(sim_host.dir, "small", "org/small-model", total_size=2e9, custom_code=False)


def minimax_dp8(sim_host):
    return make_model(sim_host.dir, "minimax-m25-ep", "MiniMaxAI/MiniMax-M2.5", total_size=230e9)


DP8_ARGV = ["--served-model-name", "minimax-m2.5", "--trust-remote-code", "--max-model-len",
            "65536", "--tensor-parallel-size", "1", "--data-parallel-size", "8",
            "--enable-expert-parallel"]


# -- auth -------------------------------------------------------------------------------------------
def test_api_key_guards_v1_exactly_like_vllm(sim_host):
    with SimServer(sim_host, [str(small(sim_host)), "--served-model-name", "small",
                              "--api-key", "s3cret"]) as srv:
        srv.wait_ready()
        for method, path, body in (("GET", "/v1/models", None),
                                   ("POST", "/v1/chat/completions", CHAT),
                                   ("POST", "/v1/completions", {"model": "small", "prompt": "hi"})):
            r = http.request(LOCAL, srv.port, method, path, json=body)
            assert (r.status, r.body) == (401, b'{"error":"Unauthorized"}')
            assert r.headers["content-type"] == "application/json"
            wrong = http.request(LOCAL, srv.port, method, path, json=body, api_key=Secret("nope"))
            assert wrong.status == 401
            ok = http.request(LOCAL, srv.port, method, path, json=body, api_key=Secret("s3cret"))
            assert ok.status == 200, ok.text()
        # the scheme is matched in any case; anything but "Bearer <key>" is refused
        assert http.request(LOCAL, srv.port, "GET", "/v1/models",
                            headers={"Authorization": "bearer s3cret"}).status == 200
        assert http.request(LOCAL, srv.port, "GET", "/v1/models",
                            headers={"Authorization": "Basic s3cret"}).status == 401
        # unguarded paths stay open
        for path in ("/health", "/metrics", "/version", "/ping", "/load"):
            assert http.request(LOCAL, srv.port, "GET", path).status == 200, path


def test_api_key_flag_takes_precedence_over_the_environment(sim_host):
    with SimServer(sim_host, [str(small(sim_host)), "--served-model-name", "small",
                              "--api-key", "from-flag"], env={"VLLM_API_KEY": "from-env"}) as srv:
        srv.wait_ready()
        assert probes.served_models(probes.Endpoint(LOCAL, srv.port, Secret("from-flag"))) == ["small"]
        with pytest.raises(probes.Unauthorized):
            probes.served_models(probes.Endpoint(LOCAL, srv.port, Secret("from-env")))
    with SimServer(sim_host, [str(small(sim_host)), "--served-model-name", "small"],
                   env={"VLLM_API_KEY": "from-env"}) as srv:
        srv.wait_ready()
        assert probes.served_models(probes.Endpoint(LOCAL, srv.port, Secret("from-env"))) == ["small"]
        with pytest.raises(probes.Unauthorized, match="got none"):
            probes.served_models(probes.Endpoint(LOCAL, srv.port))


def test_probes_pass_a_keyed_server_only_with_the_key(sim_host):
    with SimServer(sim_host, [str(small(sim_host)), "--served-model-name", "small"],
                   env={"VLLM_API_KEY": "k1"}) as srv:
        srv.wait_ready()
        keyed, bare = probes.Endpoint(LOCAL, srv.port, Secret("k1")), probes.Endpoint(LOCAL, srv.port)
        assert probes.port_open(bare) and probes.health(bare) == 200
        assert probes.fetch_metrics(bare)["engines"] == 1           # /metrics is not guarded
        smoke = probes.smoke_test(keyed, "small", "What is 2+2? Answer with one number.", r"\b4\b",
                                  64, 30)
        assert smoke.ok, smoke.problem
        refused = probes.smoke_test(bare, "small", "What is 2+2?", r"\b4\b", 64, 30)
        assert not refused.ok and refused.problem.startswith("HTTP 401")


# -- data parallel ----------------------------------------------------------------------------------
def _titles_of_children(pid: int) -> list[str]:
    """cmdline[0] of every process whose parent is pid (the sim titles its processes by argv[0])."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = open(f"/proc/{d}/stat").read()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(open(f"/proc/{d}/cmdline").read().split("\0")[0])
        except (OSError, ValueError, IndexError):
            continue
    return out


def test_dp8_runs_eight_engines_with_vllm_process_titles(sim_host):
    with SimServer(sim_host, [str(minimax_dp8(sim_host)), *DP8_ARGV]) as srv:
        srv.wait_ready(timeout=30)
        apps = parse_compute_apps(sim_host.nvidia_smi(
            "--query-compute-apps=pid,process_name,used_memory,gpu_uuid",
            "--format=csv,noheader,nounits"), ["pid", "process_name", "used_memory", "gpu_uuid"])
        assert sorted(a.process_name for a in apps) == sorted(
            f"VLLM::Worker_DP{d}_EP{d}" for d in range(8))
        children = _titles_of_children(srv.proc.pid)
        for title in ([f"VLLM::EngineCore_DP{d}" for d in range(8)] + ["VLLM::DPCoordinator"]
                      + [f"VLLM::APIServer_{i}" for i in range(8)]):
            assert title in children, (title, children)
        log = srv.log
        for d in range(8):
            assert re.search(rf"^\(EngineCore_DP{d} pid=\d+\) INFO .*GPU KV cache size: ", log, re.M)


def test_dp8_metrics_are_per_engine_like_vllm(sim_host):
    with SimServer(sim_host, [str(minimax_dp8(sim_host)), *DP8_ARGV]) as srv:
        srv.wait_ready(timeout=30)
        ep = probes.Endpoint(LOCAL, srv.port)
        body = {"model": "minimax-m2.5", "messages": [{"role": "user", "content": "hello there"}],
                "max_tokens": 40, "ignore_eos": True}
        results = []
        threads = [threading.Thread(target=lambda: results.append(
            ep.request("POST", "/v1/chat/completions", json=body, timeout=60).status))
            for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [200] * 8
        text = ep.request("GET", "/metrics").text()
        samples = metrics.parse(text)
        assert samples.engines() == [str(i) for i in range(8)]
        series = samples.by_name["vllm:generation_tokens_total"]
        assert {labels["model_name"] for labels, _ in series} == {"minimax-m2.5"}
        # eight requests arriving together went to eight different engines (least loaded first)
        assert sorted(v for _, v in series) == [40.0] * 8
        assert metrics.snapshot(text)["request_success"] == 8
        # several API servers serve the multiprocess registry: no *_created series
        assert "_created{" not in text
        _same_shape_as_recorded_vllm(text, "dp8-multiproc.prom.gz")


def _same_shape_as_recorded_vllm(text: str, fixture: str) -> None:
    """Every vllm: series the simulator serves exists in vLLM 0.33.0's own output, with the same
    TYPE and the same label names (cache_config_info aside: vLLM lists its whole CacheConfig)."""
    real_text = gzip.decompress((FIXTURES / fixture).read_bytes()).decode()
    real, sim = metrics.parse(real_text), metrics.parse(text)

    def types(t: str) -> dict:
        return dict(re.findall(r"^# TYPE (\S+) (\S+)$", t, re.M))

    real_types = types(real_text)
    for name, kind in types(text).items():
        assert real_types.get(name) == kind, (name, kind, real_types.get(name))
    for name, rows in sim.by_name.items():
        if not name.startswith("vllm:") or name == "vllm:cache_config_info":
            continue
        assert name in real.by_name, name
        assert {tuple(sorted(lab)) for lab, _ in rows} <= {tuple(sorted(lab)) for lab, _ in
                                                            real.by_name[name]}, name


def test_single_api_server_metrics_carry_created_series(sim_host):
    with SimServer(sim_host, [str(small(sim_host)), "--served-model-name", "small"]) as srv:
        srv.wait_ready()
        text = http.request(LOCAL, srv.port, "GET", "/metrics").text()
        assert 'vllm:generation_tokens_created{engine="0",model_name="small"}' in text
        _same_shape_as_recorded_vllm(text, "tp8-single.prom.gz")
        assert json.loads(http.request(LOCAL, srv.port, "GET", "/version").body) == {"version": "0.33.0"}
