"""deploy, status, logs, bench, swap with rollback, leftover cleanup and data parallel against a REAL
vLLM: vLLM's CPU build on a simulated process host (`vllm-orch sim up --real-vllm`), serving the tiny
random-weight models the simulated Hub mirror publishes (downloaded by the real huggingface_hub).

The tests share one host and run in file order: each starts from what the previous one left (a
real start is ~30 s on two idle cores) but establishes what it needs itself. The host's inventory
entry skips preflight's torch-cuda check: the CPU build's torch really is a CPU build.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from orchestrator.config.manifest import Manifest
from orchestrator.host.facts import gather
from orchestrator.host.services import ProcessService, Service
from orchestrator.host.state import read_history
from orchestrator.ops.status import host_status
from orchestrator.probe import logsig
from orchestrator.probe.readiness import GATES
from orchestrator.sim.tinymodel import MODELS, train_vocab
from tests.plugins.real_vllm import START_BUDGET_S

from .deployhelp import SHIPPED, cli_env, deploy, entry, free_port, swap, write_models
from .vllm_contract import request

pytestmark = pytest.mark.real_vllm

RUN = dict(budget_s=START_BUDGET_S, poll_s=0.5)
PORT_A, PORT_B, PORT_DP = free_port(), free_port(), free_port()


def tiny(base: str, port: int, **changes) -> Manifest:
    """A shipped tiny manifest on its own port, with nested changes ({"vllm": {...}} merged)."""
    data = SHIPPED[base].model_dump()
    data["serving"]["port"] = port
    for section, values in changes.items():
        if isinstance(values, dict):
            data[section].update(values)
        else:
            data[section] = values
    return Manifest.model_validate(data)


A = tiny("tiny-llama-a", PORT_A)
B = tiny("tiny-llama-b", PORT_B)
# The real parser accepts it; the engine refuses at start (4 KV blocks < one 1024-token request).
A_BROKEN = tiny("tiny-llama-a", PORT_A, vllm={"extra_args": ["--enforce-eager", "--num-gpu-blocks-override", "4"]})
DP = tiny("tiny-llama-a", PORT_DP, name="tiny-dp2",
          serving={"gpus": 2, "gpu_ids": [0, 1], "served_model_name": "tiny-dp2"},
          vllm={"data_parallel_size": 2, "gpu_memory_utilization": 0.05, "max_model_len": 4096,
                "extra_args": ["--enforce-eager", "--num-gpu-blocks-override", "64"]})


def running(host, e, name: str) -> bool:
    return Service.for_host(host.host, e, name).state().active


def ensure_deployed(host, m: Manifest) -> None:
    e = entry(host)
    if not running(host, e, m.name):
        for other in ("tiny-llama-a", "tiny-llama-b", "tiny-dp2"):
            if other != m.name and running(host, e, other):
                cli(host, "stop", other)
        r = deploy(e, m, **RUN)
        assert r.ok, r.error


def cli(host, *args: str, models: list[Manifest] = (A, B, DP), timeout: float = 300) -> subprocess.CompletedProcess:
    folder = write_models(host.home / "models", list(models))
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args, "--host", "sim"],
                          env=cli_env(host, folder), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def bench(host, m: Manifest, out, concurrency: str, seconds: float) -> dict:
    cli(host, "bench", "--model", m.name, "-c", concurrency, "--max-tokens", "24", "--ignore-eos",
        "--duration", str(seconds), "--warmup", "0", "--min-requests", "2", "--out", str(out),
        models=[m])
    return json.loads((out / "result.json").read_text())


def log_lines(host, m: Manifest) -> list[str]:
    return Service.for_host(host.host, entry(host), m.name).tail(400)


# -- deploy, status, logs ---------------------------------------------------------------------------
def test_deploy_passes_every_gate_then_status_and_logs_tell_the_truth(real_vllm_host):
    e = entry(real_vllm_host)
    r = deploy(e, A, **RUN)
    assert r.ok, r.error
    gates = r.extra["history"]["gates"]
    assert list(gates) == list(GATES), gates
    print(f"\nFIGURE real vLLM deploy of tiny-llama-a: ready {gates['smoke test']:.1f} s after start")
    smoke = r.extra["history"]["smoke"]
    words = smoke.split("'")[1].split()
    assert len(words) == A.probes.smoke_max_tokens and set(words) <= set(train_vocab(MODELS[A.source.repo].sentences))

    st = host_status(e)
    assert (st.state, st.active_model, st.served_name, st.port) == ("ready", "tiny-llama-a", "tiny-llama-a", PORT_A)
    assert st.kv_cache_usage == 0.0 and st.requests_running == 0.0     # read from the real /metrics
    assert st.vllm_version == "0.32.0+cpu"
    titles = sorted(p["name"] for p in st.gpu_processes)
    assert titles == ["VLLM::EngineCore", "VLLM::Worker"], st.gpu_processes
    assert all(p["owner"] == "tiny-llama-a" and p["gpu"] == 0 for p in st.gpu_processes)

    lines = log_lines(real_vllm_host, A)
    assert any("Application startup complete." in line for line in lines)
    assert any("Loading weights took" in line for line in lines)
    assert not [line for line in lines if logsig.fatal_in(line)]
    out = cli(real_vllm_host, "logs", "tiny-llama-a").stdout
    assert "Starting vLLM server on http://127.0.0.1:" in out and "POST /v1/chat/completions" in out


def test_bench_host_counts_real_usage_and_real_metric_deltas(real_vllm_host, tmp_path):
    ensure_deployed(real_vllm_host, A)
    result = bench(real_vllm_host, A, tmp_path / "bench", "1,2", 3)
    assert result["metadata"]["server_version"] == "0.32.0"
    for level in result["levels"]:
        tokens, server = level["tokens"], level["server_metrics"]
        assert set(tokens["tokens_source"]) == {"usage"}, tokens     # every count from a usage block
        assert tokens["completion"]["max"] == tokens["completion"]["min"] == 24     # --ignore-eos
        assert server["available"], server
        # Only this client talks to the server: its counter moved by exactly what usage reported.
        assert server["generation_tokens_delta"] == server["client_completion_tokens"] > 0, server
        assert server["prompt_tokens_delta"] > 0 and server["request_success_delta"] > 0
        assert level["throughput"]["output_tok_s"] > 0


# -- leftovers of a killed server ---------------------------------------------------------------------
def test_sigkill_of_the_api_server_then_deploy_kills_the_orphans_and_starts(real_vllm_host):
    ensure_deployed(real_vllm_host, A)
    e = entry(real_vllm_host)
    api = Service.for_host(real_vllm_host.host, e, A.name).state().main_pid
    before = {p["pid"]: p["name"] for p in host_status(e).gpu_processes}
    assert sorted(before.values()) == ["VLLM::EngineCore", "VLLM::Worker"]
    os.kill(api, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while Service.for_host(real_vllm_host.host, e, A.name).state().active and time.monotonic() < deadline:
        time.sleep(0.2)
    st = host_status(e)
    assert st.state == "failed"
    left = {p["pid"]: (p["name"], p["kind"], p["left_by"]) for p in st.gpu_processes}
    # vLLM itself leaves them: SIGKILL of the API server does not reach the engine and worker.
    assert left == {pid: (name, "left behind", "tiny-llama-a") for pid, name in before.items()}, left

    r = deploy(e, A, **RUN)
    assert r.ok, r.error
    gpus = [x for x in r.outcome.results if x.step == "gpus"][0]
    assert "killed 2 processes" in gpus.result, gpus
    for pid in before:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    after = host_status(e)
    assert after.state == "ready" and not set(before) & {p["pid"] for p in after.gpu_processes}


# -- swap ------------------------------------------------------------------------------------------
def test_swap_between_the_tiny_models_then_rollback_when_the_new_one_fails(real_vllm_host):
    ensure_deployed(real_vllm_host, A)
    e = entry(real_vllm_host)
    r = swap(e, B, {"tiny-llama-a": A, "tiny-llama-b": B}, **RUN)
    assert r.ok, r.error
    st = host_status(e)
    assert (st.state, st.active_model, st.port) == ("ready", "tiny-llama-b", PORT_B)
    status, _h, body = request(PORT_B, "POST", "/v1/chat/completions",
                               {"model": "tiny-llama-b", "messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 6, "temperature": 0})
    answer = json.loads(body)["choices"][0]["message"]["content"].split()
    assert status == 200 and len(answer) == 6
    assert set(answer) <= set(train_vocab(MODELS[B.source.repo].sentences))   # B's own vocabulary

    r = swap(e, A_BROKEN, {"tiny-llama-a": A_BROKEN, "tiny-llama-b": B}, **RUN)
    assert not r.ok
    st = host_status(e)
    assert (st.state, st.active_model, st.port) == ("ready", "tiny-llama-b", PORT_B), st
    assert not running(real_vllm_host, e, "tiny-llama-a")
    history = [h.shown() for h in read_history(real_vllm_host.host, e)]
    failed = [h for h in history if h["operation"] == "swap"][-1]
    # The engine's own refusal, read from the real log as the root cause (probe/logsig.py).
    assert failed["ok"] is False and failed.get("failure_kind") == "fatal-log", failed
    assert "To serve at least one request with the model's max seq len (1024)" in failed["root_cause"]
    assert history[-1]["operation"] == "rollback" and history[-1]["ok"] is True, history[-1]
    # Real vLLM's API server, SIGTERMed while it handles its engine's start-up failure, hangs: the
    # rollback's stop of a model that never served does not wait out the drain window for it.
    stop = r.outcome.recovery.as_dict()["steps"][0]
    assert stop["step"] == "stop" and stop["seconds"] < ProcessService.STOP_WAIT_S / 2, stop


# -- data parallel ---------------------------------------------------------------------------------------
def _engine_series(port: int, name: str) -> dict[str, float]:
    text = request(port, "GET", "/metrics")[2].decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            engine = line.split('engine="')[1].split('"')[0]
            out[engine] = float(line.rsplit(" ", 1)[1])
    return out


def _long_requests(port: int, served: str, n: int, tokens: int, prompt_words: int = 0) -> list[threading.Thread]:
    """N requests (not streamed) in threads; each thread's `outcome` says how its request ended (a failed
    test names it: an error answer, a timeout, or a whole answer sooner than expected)."""
    body = {"model": served, "messages": [{"role": "user", "content": "talk " + "river " * prompt_words}],
            "max_tokens": tokens, "ignore_eos": True, "stream": False}

    def run(t: threading.Thread) -> None:
        t0 = time.monotonic()
        try:
            status, _, data = request(port, "POST", "/v1/chat/completions", body, timeout=120)
            t.outcome = f"HTTP {status} after {time.monotonic() - t0:.1f}s, {len(data)} bytes" + (  # type: ignore[attr-defined]
                f": {data[:300]!r}" if status != 200 else "")
        except Exception as exc:                        # noqa: BLE001 - reported by the test that waits
            t.outcome = f"{exc!r} after {time.monotonic() - t0:.1f}s"   # type: ignore[attr-defined]

    threads = []
    for _ in range(n):
        t = threading.Thread(daemon=True)
        t.outcome = "still running"                     # type: ignore[attr-defined]
        t.run = lambda t=t: run(t)                      # type: ignore[method-assign]
        threads.append(t)
    for t in threads:
        t.start()
    return threads


def test_data_parallel_service_two_engines_every_process_is_the_services(real_vllm_host, tmp_path):
    ensure_deployed(real_vllm_host, DP)
    e = entry(real_vllm_host)
    st = host_status(e)
    assert (st.state, st.active_model) == ("ready", "tiny-dp2"), st
    procs = {p["name"]: p for p in st.gpu_processes}
    assert {"VLLM::EngineCore_DP0", "VLLM::EngineCore_DP1"} <= set(procs), st.gpu_processes
    assert procs["VLLM::EngineCore_DP0"]["gpu"] == 0 and procs["VLLM::EngineCore_DP1"]["gpu"] == 1
    assert all(p["owner"] == "tiny-dp2" for p in st.gpu_processes), st.gpu_processes
    # The GPU-ownership rule: every process of the service - GPU holders and the API servers bound
    # to its port - is the service's; DPCoordinator runs in the same process group.
    facts = gather(real_vllm_host.host, e, ["tiny-dp2"], ports=[PORT_DP])
    assert facts.procs and all(p.owner == "tiny-dp2" for p in facts.procs)
    assert facts.ports[PORT_DP] and all(p.owner == "tiny-dp2" for p in facts.ports[PORT_DP])
    leader = facts.services["tiny-dp2"].main_pid
    group = [_cmd(int(d)) for d in os.listdir("/proc") if d.isdigit() and _pgid(int(d)) == leader]
    assert "VLLM::DPCoordinator" in group and "VLLM::APIServer_0" in group, group

    result = bench(real_vllm_host, DP, tmp_path / "bench", "2", 3)
    level = result["levels"][0]
    server = level["server_metrics"]
    # Counters are summed over the two engines: the sum is what the client received.
    assert server["generation_tokens_delta"] == server["client_completion_tokens"] > 0, server
    per_engine = _engine_series(PORT_DP, "vllm:generation_tokens_total")
    assert set(per_engine) == {"0", "1"} and all(v > 0 for v in per_engine.values()), per_engine
    kv = server["kv_cache_usage_perc"]
    assert kv["max_during"] is None or 0 <= kv["max_during"] <= 1


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, OSError):
        return None


def test_status_of_a_data_parallel_service_averages_kv_usage_over_engines(real_vllm_host, monkeypatch):
    """Status's own /metrics scrape happens while requests run on each engine, and the engines are
    frozen (SIGSTOP) for the length of it: when status asks for /metrics, the test freezes the two
    EngineCore processes, sends four requests (a 2000-word prompt each), thaws the engines for a
    moment and freezes them again, waits until the API server has taken in all they sent, and lets
    status scrape if each engine runs requests with their KV allocated (else it tries again with a
    longer moment). The API server still answers /metrics with the last
    figures the engines sent, so the per-engine series scraped just before and just after status's
    scrape are equal, and status must report their mean, not their sum. (Timing real requests against
    the scrape did not hold: on CI's faster machine 1800 tokens ended inside the scrape; on a busy one
    status outlived them.)"""
    from orchestrator.probe import api as probe_api

    ensure_deployed(real_vllm_host, DP)
    e = entry(real_vllm_host)
    leader = gather(real_vllm_host.host, e, ["tiny-dp2"], ports=[PORT_DP]).services["tiny-dp2"].main_pid
    real_fetch, seen = probe_api.fetch_metrics, {}

    def processes(title: str) -> list[int]:
        return [int(d) for d in os.listdir("/proc") if d.isdigit() and _pgid(int(d)) == leader
                and _cmd(int(d)).startswith(title)]

    def engine_cores() -> list[int]:
        return processes("VLLM::EngineCore_DP")

    def settled(read):
        # read every 0.5 s until two reads agree (at most 60 s): the last read
        last, give_up = None, time.monotonic() + 60
        while True:
            now = read()
            if now == last or time.monotonic() > give_up:
                return now
            last = now
            time.sleep(0.5)

    def api_servers_cpu() -> float:
        total = 0.0
        for pid in processes("VLLM::APIServer"):
            try:
                total += sum(psutil.Process(pid).cpu_times()[:2])      # user + system
            except psutil.Error:
                pass
        return total

    def running() -> list[float]:
        return sorted(_engine_series(PORT_DP, "vllm:num_requests_running").values())

    def wait_for(what: str, done) -> bool:
        deadline = time.monotonic() + 120
        while not done():
            if time.monotonic() > deadline:
                log = real_vllm_host.dir / "logs" / "vllm-tiny-dp2.log"
                tail = log.read_text(errors="replace").splitlines()[-25:] if log.exists() else ["(no log)"]
                t0 = time.monotonic()        # what a scrape reads, raw, and how long it takes
                try:
                    raw = [ln for ln in request(PORT_DP, "GET", "/metrics")[2].decode().splitlines()
                           if ln.startswith(("vllm:num_requests_running", "vllm:kv_cache_usage_perc"))]
                except Exception as exc:     # noqa: BLE001 - this is only the failure's message
                    raw = [repr(exc)]
                seen["timeout"] = (f"{what} within 120 s: tries (thawed s, running, KV) {seen.get('attempts')}; "
                                   f"running {running()}, requests "
                                   f"{[t.outcome for t in seen['threads']]}; a scrape took "
                                   f"{time.monotonic() - t0:.1f} s and read:\n" + "\n".join(raw)
                                   + "\nthe service's log ends:\n" + "\n".join(tail))
                return False
            time.sleep(0.05)
        return True

    def drained() -> tuple[dict, dict]:
        # The engines are frozen, but the API server may still be behind them: what it has (tokens
        # counted, running, KV) once it holds still for half a second.
        names = ("vllm:generation_tokens_total", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
        now = settled(lambda: [_engine_series(PORT_DP, n) for n in names])
        return now[1], now[2]

    def freeze(stop: bool) -> None:
        for pid in seen["frozen"]:
            os.kill(pid, signal.SIGSTOP if stop else signal.SIGCONT)

    def fetch_while_both_run(ep, **kw):
        # Catching both engines mid-request by looking did not hold on a loaded machine (three of four
        # full runs; reproduced alone with both cores kept busy): the tiny model ends 1800 tokens in a
        # second or two of engine time, while the starved API servers took 4-20 s per request to take
        # it in and hand it back, so the engines idled between requests and every look read running
        # 0. So the test sets the moment itself: with the engines frozen, four requests go in (not
        # streamed) and the API servers queue them for the engines (the load balancer spreads what it
        # sends while the engines are frozen: it counts what it sent), and once the API servers are
        # idle (their CPU time holds still: a starved one took over 20 s to take four in) the engines are thawed for
        # a moment (`step`: long enough for a step of each, far shorter than 1800 tokens), frozen
        # again, and once the API server has taken in all they sent, each engine runs requests with
        # their KV allocated. If not (an engine not scheduled in that moment, requests not yet queued),
        # the moment grows and it tries again.
        seen["threads"], seen["attempts"] = [], []
        seen["frozen"] = engine_cores()
        freeze(True)
        step = [0.3]

        def frozen_with_both_running() -> bool:
            alive = [t for t in seen["threads"] if t.is_alive()]
            if len(alive) < 4:
                seen["threads"] += _long_requests(PORT_DP, "tiny-dp2", 4 - len(alive), 1800, prompt_words=2000)
            # the API servers take them in and queue them (engines frozen): their CPU time holds still
            settled(api_servers_cpu)
            freeze(False)
            time.sleep(step[0])
            freeze(True)
            seen["running"], seen["before"] = drained()
            seen["attempts"].append((step[0], seen["running"], seen["before"]))
            if len(seen["running"]) == 2 and min(seen["running"].values()) >= 1 and min(seen["before"].values()) > 0:
                return True
            step[0] = min(2.0, step[0] * 1.5)
            return False
        try:
            if not wait_for("requests were not running on both engines with their KV allocated",
                            frozen_with_both_running):
                return real_fetch(ep, **kw)
            snap = real_fetch(ep, **kw)
            seen["after"] = _engine_series(PORT_DP, "vllm:kv_cache_usage_perc")
        finally:
            freeze(False)
        return snap

    monkeypatch.setattr(probe_api, "fetch_metrics", fetch_while_both_run)
    try:
        st = host_status(e)
    finally:
        for t in seen.get("threads", []):
            t.join(120)
    assert "timeout" not in seen, seen["timeout"]
    print(f"DP status: {len(seen['attempts'])} tries (thawed s, running, KV): {seen['attempts']}")
    assert len(seen["frozen"]) == 2, seen
    before, after = seen["before"], seen["after"]
    assert len(seen["running"]) == 2 and min(seen["running"].values()) >= 1, seen     # each engine runs one
    assert min(before.values()) > 0 and before == after, seen
    mean = sum(before.values()) / 2
    assert st.engines == 2 and abs(st.kv_cache_usage - mean) < 1e-9, (st.kv_cache_usage, before)


def _cmd(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


# -- a keyed model ----------------------------------------------------------------------------------
def test_keyed_model_passes_every_gate_and_refuses_requests_without_the_key(real_vllm_host, monkeypatch):
    keyed = tiny("tiny-llama-a", PORT_A, serving={"secret_env": ["VLLM_API_KEY"], "port": PORT_A})
    monkeypatch.setenv("VLLM_API_KEY", "real-vllm-test-key")
    e = entry(real_vllm_host)
    for other in ("tiny-llama-a", "tiny-llama-b", "tiny-dp2"):
        if running(real_vllm_host, e, other):
            cli(real_vllm_host, "stop", other)
    r = deploy(e, keyed, **RUN)
    assert r.ok, r.error
    assert list(r.extra["history"]["gates"]) == list(GATES)
    assert request(PORT_A, "GET", "/v1/models")[0] == 401
    assert request(PORT_A, "GET", "/v1/models", key="real-vllm-test-key")[0] == 200
    st = host_status(e)
    assert st.state == "ready", st
