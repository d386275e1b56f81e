"""status, readiness and bench against services the way a real vLLM host runs them (issue #12):
a DP8 service reports eight engines and its KV usage is the per-engine mean in status and in bench
(not their 400%-style sum); a service with an API key passes every gate (deploy, a swap's rollback,
regen --restart) and is read by status and bench --host only with the key."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import threading
import time

import pytest

from orchestrator.bench.client import Endpoint as BenchEndpoint
from orchestrator.bench.loadgen import scrape
from orchestrator.config.manifest import Manifest
from orchestrator.errors import ConnectError
from orchestrator.host.local import LocalHost
from orchestrator.host.services import Service
from orchestrator.ops.execute import Reporter
from orchestrator.ops.regen import run_regen
from orchestrator.ops.status import host_status
from orchestrator.ops.stop import stop_model
from orchestrator.paths import shipped_dir
from orchestrator.probe import api as probes
from orchestrator.probe import metrics
from orchestrator.probe.readiness import NotReady, wait_ready
from orchestrator.secret import Secret
from orchestrator.sim import manager

from .deployhelp import cli_env, deploy, entry, free_port, on_port, opts, swap, write_models

KEY = "sk-test-7c1e"


def with_changes(m: Manifest, vllm: dict | None = None, serving: dict | None = None) -> Manifest:
    data = m.model_dump()
    data["vllm"].update(vllm or {})
    data["serving"].update(serving or {})
    return Manifest.model_validate(data)


def wait_until(predicate, budget: float = 30.0):
    deadline = time.monotonic() + budget
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


@pytest.mark.long
def test_dp8_kv_usage_is_the_per_engine_mean_in_status_and_bench(sim_host):
    # a small KV cache per engine (~7.8k tokens) so that one long prompt per engine fills a third
    m = with_changes(on_port("minimax-m25-ep"), {"gpu_memory_utilization": 0.31, "max_model_len": 6144})
    e = entry(sim_host)
    assert deploy(e, m).ok
    ep = probes.Endpoint(LocalHost("sim"), m.serving.port)
    body = {"model": m.served_name, "messages": [{"role": "user", "content": "alpha " * 2500}],
            "max_tokens": 2000, "ignore_eos": True}

    def one() -> None:
        try:
            ep.request("POST", "/v1/chat/completions", json=body, timeout=120)
        except probes.HttpError:
            pass                        # the service is stopped under it at the end

    threads = [threading.Thread(target=one, daemon=True) for _ in range(8)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: probes.fetch_metrics(ep)["running"] == 8)
        st = host_status(e)
        per_engine = metrics.parse(ep.request("GET", "/metrics").text()).values("vllm:kv_cache_usage_perc")
        bench = asyncio.run(scrape(BenchEndpoint.parse(f"http://127.0.0.1:{m.serving.port}")))
    finally:
        stop_model(LocalHost("sim", env=e.env), e, m.name, release_timeout=10, poll=0.1)
        for t in threads:
            t.join(30)
    assert len(per_engine) == 8 and sum(per_engine) > 2.0       # a sum would read > 200%
    assert st.state == "ready" and st.engines == 8 and st.requests_running == 8
    mean = sum(per_engine) / 8
    assert 0.25 < st.kv_cache_usage < 1.0
    assert st.kv_cache_usage == pytest.approx(mean, abs=0.1)     # scraped a moment apart
    assert st.kv_cache_usage_max >= st.kv_cache_usage
    assert bench["engines"] == 8 and bench["running"] == 8
    assert bench["kv_cache_usage_perc"] == pytest.approx(st.kv_cache_usage, abs=0.1)


@pytest.fixture
def keyed(sim_host, tmp_path, monkeypatch):
    """minimax-m25 deployed with VLLM_API_KEY (serving.secret_env) from the environment."""
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    m = with_changes(on_port("minimax-m25"), serving={"secret_env": ["VLLM_API_KEY"]})
    e = entry(sim_host)
    result = deploy(e, m)               # every readiness gate, smoke test included, needs the key
    assert result.ok, result.as_dict()
    models = write_models(tmp_path / "models", [m])
    return e, m, models


def test_keyed_service_deploys_and_is_guarded(keyed, sim_host):
    e, m, _ = keyed
    host = LocalHost("sim")
    assert probes.served_models(probes.Endpoint(host, m.serving.port, Secret(KEY))) == [m.served_name]
    with pytest.raises(probes.Unauthorized):
        probes.served_models(probes.Endpoint(host, m.serving.port))
    env_file = (sim_host.dir / "units").glob("*.env")
    assert any(KEY in f.read_text() for f in env_file)       # the key reached the service


def test_readiness_with_a_wrong_key_fails_at_once(keyed):
    e, m, _ = keyed
    host = LocalHost("sim", env=e.env)
    svc = Service.for_host(host, e, m.name)
    t0 = time.monotonic()
    with pytest.raises(NotReady) as err:
        wait_ready(host, svc, m, svc.log_cursor(), budget_s=120, poll_s=0.1, api_key=Secret("wrong"))
    assert err.value.kind == "auth" and "got a wrong one" in str(err.value)
    assert time.monotonic() - t0 < 60                 # not the start-up budget
    ready = wait_ready(host, svc, m, svc.log_cursor(), budget_s=60, poll_s=0.1, api_key=Secret(KEY))
    assert ready.smoke.ok


def test_a_reconnect_between_two_polls_ends_the_readiness_wait(keyed):
    """SshHost reconnects without a word when a command finds its connection gone (its `connects`
    rises): the wait must end as a lost connection then, as it does when the cut hits a command, for
    the deploy lock went with the old connection. (The real cut over SSH, which lands either way:
    tests/integration/test_systemd_interrupts.py.)"""
    e, m, _ = keyed
    host = LocalHost("sim", env=e.env)
    svc = Service.for_host(host, e, m.name)
    events: list[str] = []

    def reconnect_after_the_first_gate(kind: str, text: str) -> None:
        events.append(text)
        if kind == "gate":
            host.connects += 1

    with pytest.raises(ConnectError, match="lost the connection to sim during the readiness wait"):
        wait_ready(host, svc, m, svc.log_cursor(), budget_s=60, poll_s=0.1, api_key=Secret(KEY),
                   on_event=reconnect_after_the_first_gate)
    assert events[-1] == "process alive", events


def test_status_of_a_keyed_service(keyed, sim_host):
    e, m, models = keyed
    without = host_status(e)
    assert "401" in without.state_reason and "VLLM_API_KEY" in without.state_reason
    with_key = host_status(e, api_key_of=lambda model: Secret(KEY) if model == m.name else None)
    assert with_key.state == "ready" and "401" not in with_key.state_reason
    assert with_key.engines == 1 and with_key.kv_cache_usage is not None
    # the CLI takes the key from the environment because the manifest names VLLM_API_KEY
    run = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "status", "--host", "sim", "--json"],
                         env=cli_env(sim_host, models), capture_output=True, text=True, timeout=120)
    row = json.loads(run.stdout)[0]
    assert row["state"] == "ready" and "401" not in row["state_reason"], row["state_reason"]


def test_bench_host_of_a_keyed_service(keyed, sim_host, tmp_path):
    e, m, models = keyed
    env = cli_env(sim_host, models)
    argv = [sys.executable, "-m", "orchestrator.cli.main", "bench", "--host", "sim", "-c", "1",
            "--max-tokens", "16", "--duration", "1", "--warmup", "0", "--min-requests", "2"]
    ok = subprocess.run([*argv, "--out", str(tmp_path / "b1")], env=env, capture_output=True,
                        text=True, timeout=180)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    level = json.loads((tmp_path / "b1" / "result.json").read_text())["levels"][0]
    assert level["requests"]["errors"] == 0
    env.pop("VLLM_API_KEY")
    refused = subprocess.run([*argv, "--out", str(tmp_path / "b2")], env=env, capture_output=True,
                             text=True, timeout=180)
    assert refused.returncode == 2
    assert "answered 401" in refused.stdout + refused.stderr


def test_swap_rollback_and_regen_restart_of_keyed_services(sim_host, monkeypatch, tmp_path):
    """The key reaches every readiness wait of a plan: a failed swap's rollback to the old keyed
    model, and regen --restart."""
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    port = free_port()
    old, new = (with_changes(on_port(name, port), serving={"secret_env": ["VLLM_API_KEY"]})
                for name in ("kimi-k25-int4", "kimi-k25-nvfp4"))
    e = entry(sim_host)
    assert deploy(e, old).ok
    manager.add_fault("sim", "garbage", model=new.name, home=sim_host.home)
    failed = swap(e, new, {old.name: old, new.name: new}, no_progress_s=5)
    assert not failed.ok and isinstance(failed.error, NotReady) and failed.error.kind == "smoke"
    assert failed.extra["rollback"]["ok"], failed.extra["rollback"]
    ep = probes.Endpoint(LocalHost("sim"), port, Secret(KEY))
    assert probes.served_models(ep) == [old.served_name]

    templates = tmp_path / "templates"
    shutil.copytree(shipped_dir("templates"), templates)
    script = templates / "vllm-process.sh.j2"
    script.write_text(script.read_text().replace("set -a\n", "# local tuning\nset -a\n"))
    monkeypatch.setenv("VLLM_ORCH_TEMPLATES", str(templates))
    restarted = run_regen(e, {old.name: old}, opts(), Reporter(None, quiet=True), dry_run=False, restart=True)
    assert restarted.ok, restarted.error
    assert probes.served_models(ep) == [old.served_name]
