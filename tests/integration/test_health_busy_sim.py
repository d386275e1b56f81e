"""Issue 26, finding 1: the health check against a simulated vLLM whose long prefills occupy the
engine as vLLM V1's do (running requests first, chunked prefill at max_num_batched_tokens: a
request behind a long prompt waits in the queue). A busy server that makes progress is never
restarted, and history says the check saw it busy; a hung engine (fault hang-after-ready) still
is restarted. The check is the installed probe (unit_probe.py check) with a stand-in systemctl
(probehelp), run as the unit runs it: `python -I`, then its root part with $EXIT_STATUS."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request

from orchestrator.paths import package_file
from orchestrator.probe.metrics import parse
from orchestrator.sim import vllm_server
from tests.integration.probehelp import root_restart, stand_in_env, stand_in_systemctl
from tests.plugins.sim_hosts import SimServer, make_model

SCRIPT = package_file("host", "remote", "unit_probe.py")
PREFILL = vllm_server.PROFILES["kimi-k25-int4"]["prefill"]      # tokens/s of the layout


def argv(model) -> list[str]:
    return [str(model), "--served-model-name", "x", "--trust-remote-code", "-tp", "8",
            "--max-model-len", "131072", "--max-num-batched-tokens", "4096"]


def long_prompt(tokens: int) -> str:
    return " ".join(["word"] * tokens)


def post(port: int, prompt: str, timeout: float = 120) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                 data=json.dumps({"model": "x", "prompt": prompt, "max_tokens": 1}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def gauge(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return sum(parse(resp.read().decode()).values(name))


def wait_until(cond, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out: " + what
        time.sleep(0.05)


def check(tmp_path, port: int, timeout: float = 2, failures: int = 1) -> subprocess.CompletedProcess:
    stand_in_systemctl(tmp_path)                       # vllm-x.service is active
    env = {k: v for k, v in stand_in_env(tmp_path).items() if k not in ("VLLM_API_KEY", "CREDENTIALS_DIRECTORY")}
    return subprocess.run([sys.executable, "-I", str(SCRIPT), "check", "--unit", "vllm-x.service", "--port", str(port),
                           "--served-name", "x", "--model", "x", "--failures", str(failures), "--timeout", str(timeout),
                           "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, timeout=120, env=env)


def history(tmp_path) -> list[dict]:
    path = tmp_path / "state" / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_long_prefill_holds_up_the_probe_as_in_vllm(sim_host):
    """The stand-in is as harsh as vLLM: a one-token request behind a long prompt waits for its
    prefill (it is counted waiting meanwhile), and the prompt counter moves only when it ends."""
    model = make_model(sim_host.dir, "kimi-k25-int4", "moonshotai/Kimi-K2.5", total_size=547e9)
    tokens = int(PREFILL * 4)                          # ~4 s of prefill
    with SimServer(sim_host, argv(model)) as srv:
        srv.wait_ready(60)
        long = threading.Thread(target=post, args=(srv.port, long_prompt(tokens)), daemon=True)
        long.start()
        wait_until(lambda: gauge(srv.port, "vllm:num_requests_running") >= 1, what="the long prompt to run")
        t0 = time.monotonic()
        post(srv.port, "Hello")
        waited = time.monotonic() - t0
        long.join(60)
        assert waited > 1.0, f"the short request did not wait for the long prefill ({waited:.2f}s)"
        assert gauge(srv.port, "vllm:prompt_tokens_total") >= tokens


def test_a_long_prefill_is_busy_not_hung_and_history_says_so(sim_host, tmp_path):
    model = make_model(sim_host.dir, "kimi-k25-int4", "moonshotai/Kimi-K2.5", total_size=547e9)
    with SimServer(sim_host, argv(model)) as srv:
        srv.wait_ready(60)
        long = threading.Thread(target=post, args=(srv.port, long_prompt(int(PREFILL * 8))), daemon=True)
        long.start()
        wait_until(lambda: gauge(srv.port, "vllm:num_requests_running") >= 1, what="the long prompt to run")
        done = check(tmp_path, srv.port)
        state = json.loads((tmp_path / "state" / "health" / "x.json").read_text())
        assert done.returncode not in (1, 75), done.stdout + done.stderr + json.dumps(state)
        assert state["failures"] == 0 and state["last"]["ok"] is True
        assert "busy" in state["last"]["note"], state
        part = root_restart(tmp_path, done.returncode, "health-restart", "x")
        assert part.returncode == 0, part.stdout + part.stderr
        assert not (tmp_path / "systemctl.log").exists()                 # nothing restarted
        [record] = history(tmp_path)
        assert record["operation"] == "health-busy" and record["model"] == "x", record
        assert "busy" in record["reason"] and "kv_cache_usage" in record["reason"], record
        long.join(60)


def test_a_hung_engine_is_still_restarted(sim_host, tmp_path):
    from orchestrator.sim import manager

    model = make_model(sim_host.dir, "kimi-k25-int4", "moonshotai/Kimi-K2.5", total_size=547e9)
    manager.add_fault("sim", "hang-after-ready", "kimi-k25-int4", home=sim_host.home, after=1)
    with SimServer(sim_host, argv(model)) as srv:
        srv.wait_ready(60)
        fired = sim_host.dir / "logs" / "faults-fired.jsonl"
        wait_until(lambda: fired.exists() and '"phase": "hung"' in fired.read_text(), what="the hang")
        # a long prompt in flight when the engine hung: its gauges stay as the last step left them
        threading.Thread(target=post, args=(srv.port, long_prompt(int(PREFILL * 2)), 30), daemon=True).start()
        done = check(tmp_path, srv.port)
        assert done.returncode == 75, done.stdout + done.stderr
        part = root_restart(tmp_path, done.returncode, "health-restart", "x")
        assert part.returncode == 0, part.stdout + part.stderr
        assert (tmp_path / "systemctl.log").read_text().splitlines()[-1] == "restart --no-block vllm-x.service"
        [record] = history(tmp_path)
        assert record["operation"] == "health-restart" and "did not answer within" in record["reason"]
