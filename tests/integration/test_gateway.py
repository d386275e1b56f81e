"""The gateway (issue 41) on a SIMULATED process host running the real HAProxy, driven by the real
OpenAI client: one URL and one key for every model of the host, OpenAI's error shapes for bad
input, and the endpoint kept through the host's operations (a stop drains its requests in flight,
a swap holds requests for the model that is loading)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import openai
import pytest
import yaml

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.host import http

from .deployhelp import cli_env, deploy, free_port, swap, tuned, write_models

REPO = Path(__file__).resolve().parents[2]
GW_KEY = "gw-client-key-0123456789"
SERVICE_KEY = "service-key-abcdef0123"


@pytest.fixture
def gw(sim_host, tmp_path, monkeypatch):
    """The sim host with a keyed kimi-k25-int4 (and its dcp8 variant, same served name, on its port)
    deployed, a gateway on a free port, and the CLI's environment."""
    monkeypatch.setenv("VLLM_API_KEY", SERVICE_KEY)
    keyed = {"secret_env": ["VLLM_API_KEY"]}
    a = tuned("kimi-k25-int4", serving=keyed)
    b = tuned("kimi-k25-int4-dcp8", a.serving.port, serving=keyed)          # the same served name, kimi-k2.5
    c = tuned("minimax-m25", serving=keyed)
    d = c.model_dump()                                # a second service beside c, on GPUs 4-7
    d.update(name="minimax-b")
    d["serving"].update(gpu_ids=[4, 5, 6, 7], port=free_port(), served_model_name="minimax-b")
    d = Manifest.model_validate(d)
    models = write_models(tmp_path / "models", [a, b, c, d])
    port = free_port()
    # the sim host's state_dir is too deep for a Unix socket's path: the sockets go to a short folder
    run_dir = tempfile.mkdtemp(prefix="gw-", dir="/tmp")
    settings = {"port": port, "hold_seconds": 20, "drain_seconds": 20, "run_dir": run_dir, "metrics_port": free_port()}
    entry = HostEntry.model_validate({**sim_host.entry, "name": sim_host.name, "gateway": settings})
    inventory = Path(os.environ["VLLM_ORCH_STATE_HOME"]) / "hosts.d" / "sim.yaml"     # what `sim up` wrote
    data = yaml.safe_load(inventory.read_text())
    data["hosts"]["sim"]["gateway"] = settings
    inventory.write_text(yaml.safe_dump(data))
    env = dict(cli_env(sim_host, models), VLLM_ORCH_GATEWAY_KEYS=GW_KEY, VLLM_API_KEY=SERVICE_KEY)
    try:
        yield entry, {"a": a, "b": b, "c": c, "d": d}, env, port
    finally:
        cli(env, "gateway", "down", "--host", "sim")
        shutil.rmtree(run_dir, ignore_errors=True)


def cli(env, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=str(REPO))


def client(port: int, key: str = GW_KEY, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, timeout=60, **kw)


def raw(port: int, data: bytes, headers: str = "") -> tuple[int, dict]:
    """POST data to /v1/chat/completions by hand (what no client library sends)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {GW_KEY}\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n{headers}Connection: close\r\n\r\n"
              .encode() + data)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    s.close()
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body or b"{}")


def test_one_url_routes_by_model_with_openai_errors_for_bad_input(gw):
    entry, m, env, port = gw
    assert deploy(entry, m["c"]).ok
    r = cli(env, "gateway", "up", "--host", "sim", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["url"] == f"http://127.0.0.1:{port}/v1"
    folder = Path(entry.state_dir) / "gateway"
    for name in ("clients.lst", "keys.map", "haproxy.cfg"):           # the keys: the user's only, from the first byte
        assert (folder / name).stat().st_mode & 0o777 == 0o600
    assert SERVICE_KEY not in (folder / "haproxy.cfg").read_text() and GW_KEY not in r.stdout + r.stderr
    # a second service of the host, deployed after the gateway: routed by its deploy's gateway steps
    assert deploy(entry, m["d"]).ok
    c = client(port, max_retries=0)
    assert sorted(x.id for x in c.models.list()) == ["minimax-b", "minimax-m2.5"]
    for model in ("minimax-b", "minimax-m2.5"):       # each reached with its own key (vLLM refuses another)
        chunks = list(c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
        assert chunks[-2].choices[0].finish_reason == "length" and len(chunks) >= 9     # streamed, chunk by chunk
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="kimi-k2.5", prompt="x", max_tokens=1)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.AuthenticationError):
        client(port, "wrong-key", max_retries=0).models.list()
    with pytest.raises(openai.AuthenticationError):            # the service's key is not the gateway's
        client(port, SERVICE_KEY, max_retries=0).models.list()
    assert raw(port, b"not json")[0] == 400
    assert raw(port, b'{"prompt": "no model"}')[0] == 400
    assert raw(port, b'{"model": "minimax-b", "prompt": "' + b"x" * (2 << 20) + b'"}')[0] == 413
    for path in ("/sleep", "/collective_rpc", "/metrics"):         # never forwarded
        assert http.request(entry_host(entry), port, "POST", path, api_key=None, json={}).status == 404
    status = json.loads(cli(env, "gateway", "status", "--host", "sim", "--json").stdout)
    backends = status["counters"]["backends"]
    assert backends["svc_minimax-b"]["requests"] >= 1 and backends["svc_minimax-m25"]["requests"] >= 1
    r = cli(env, "status", "--host", "sim", "--json")                 # status's gateway line
    assert r.returncode == 0, r.stdout + r.stderr
    line = json.loads(r.stdout)[0]["gateway"]
    assert (line["state"], line["url"], sorted(line["models"])) == ("serving", f"http://127.0.0.1:{port}/v1",
                                                                     ["minimax-b", "minimax-m2.5"])
    assert line["requests"] >= 2 and line["waiting"] == 0
    assert "gateway: serving at" in cli(env, "status", "--host", "sim").stdout
    # its own metrics, as `monitor`'s job and dashboard read them: the real HAProxy exporter's names and labels
    from orchestrator.ops import monitor_rules
    from orchestrator.probe import metrics

    got = http.request(entry_host(entry), line["metrics_port"], "GET", "/metrics", api_key=None)
    assert got.status == 200, got
    samples = metrics.parse(got.text())
    assert set(monitor_rules.GATEWAY_SERIES) <= set(samples.by_name), sorted(samples.by_name)[:40]
    requests = {labels["proxy"]: v for labels, v in samples.by_name["haproxy_backend_http_requests_total"]}
    assert requests["svc_minimax-b"] >= 1 and requests["svc_minimax-m25"] >= 1
    assert {labels.get("code") for labels, _ in samples.by_name["haproxy_backend_http_responses_total"]} >= {"5xx"}
    assert "gateway" in {labels["proxy"] for labels, _ in samples.by_name["haproxy_frontend_current_sessions"]}
    assert http.request(entry_host(entry), line["metrics_port"], "GET", "/v1/models", api_key=None).status == 404
    # a stop drains: a stream in flight when the stop starts ends whole; the name is 404 after it
    got: dict = {}
    streaming = threading.Event()
    t = threading.Thread(target=long_stream, args=(c, "minimax-m2.5", 840, got, streaming))
    t.start()
    # in flight when the stop starts: about 10 s of tokens at 84 tok/s, longer than a busy machine takes to
    # start the CLI and reach the drain step (200 tokens were not, on CI), shorter than drain_seconds
    assert streaming.wait(30)
    r = cli(env, "stop", "minimax-m25", "--host", "sim")
    t.join(30)
    assert r.returncode == 0 and "drain minimax-m25 at the gateway" in r.stdout, r.stdout + r.stderr
    assert got["chunks"][-1].choices[0].finish_reason == "length", got["chunks"][-1]
    waited = re.search(r"no request of minimax-m25 in flight \(waited ([0-9.]+) s\)", r.stdout)
    assert waited and float(waited.group(1)) > 0.2, r.stdout          # the stop waited for the stream
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="minimax-m2.5", prompt="x", max_tokens=1)
    r = cli(env, "gateway", "down", "--host", "sim")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (folder / "clients.lst").exists()
    with pytest.raises(openai.APIConnectionError):
        c.models.list()


def long_stream(c: openai.OpenAI, model: str, max_tokens: int, got: dict, streaming: threading.Event) -> None:
    """One stream of MODEL, its chunks into got["chunks"]; `streaming` set at the first one."""
    s = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True})
    got["chunks"] = []
    for ch in s:
        got["chunks"].append(ch)
        streaming.set()


def load(c: openai.OpenAI, model: str, max_tokens: int, stop: threading.Event, outcome: Counter,
         waits: list[float]) -> None:
    """Streams of MODEL until `stop`: each counted whole, cut or by its error; each one's wait
    (send to last chunk) kept."""
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            chunks = list(c.chat.completions.create(model=model, max_tokens=max_tokens, stream=True,
                                                    messages=[{"role": "user", "content": "hi"}],
                                                    extra_body={"ignore_eos": True}))
            outcome["whole" if chunks[-1].choices[0].finish_reason == "length" else "cut"] += 1
            waits.append(time.monotonic() - t0)
        except openai.APIError as exc:
            outcome[f"{type(exc).__name__}: {exc}"[:160]] += 1


def entry_host(entry: HostEntry):
    from orchestrator.host.local import LocalHost

    return LocalHost(entry.name, env=entry.env)


def test_a_swap_keeps_the_endpoint_for_a_load_on_its_model(gw):
    """C=8 streams of `kimi-k2.5` through a swap between its two manifests (one served name, one
    port): each request either streams whole or is told 503 + Retry-After, which the OpenAI client
    retries by itself: the user sees no failure."""
    entry, m, env, port = gw
    assert deploy(entry, m["a"]).ok
    assert cli(env, "gateway", "up", "--host", "sim").returncode == 0
    c = client(port)                                   # the client's defaults: 2 retries, Retry-After honoured
    stop = threading.Event()
    outcome: Counter = Counter()
    waits: list[float] = []
    threads = [threading.Thread(target=load, args=(c, "kimi-k2.5", 16, stop, outcome, waits)) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        time.sleep(1)
        r = swap(entry, m["b"], {x.name: x for x in m.values()})
        time.sleep(1)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert r.ok, r.error
    steps = [(x.step, x.status) for x in r.outcome.results]
    assert ("gateway", "done") in steps and not r.outcome.recovery
    assert set(outcome) == {"whole"}, outcome
    assert max(waits) > 1.0                             # some waited through the load (held), none failed
    assert not [w for w in r.outcome.results if w.step == "gateway" and "could not" in (w.result or "")]


def test_a_regen_restart_holds_new_requests_and_lets_those_in_flight_finish(gw):
    """`regen --restart` of a service behind the gateway: a stream in flight when it starts ends
    whole (the gateway waits for it before vLLM stops), requests that arrive during the restart
    wait at the gateway and stream once its readiness gates passed (none gets vLLM's 503 or a
    refused connection), then the name serves as before."""
    entry, m, env, port = gw
    assert deploy(entry, m["c"]).ok
    # bounds wide enough for a stream of ~20 s in flight, and for the requests held while it ends
    inventory = Path(os.environ["VLLM_ORCH_STATE_HOME"]) / "hosts.d" / "sim.yaml"
    data = yaml.safe_load(inventory.read_text())
    data["hosts"]["sim"]["gateway"].update(hold_seconds=60, drain_seconds=60)
    inventory.write_text(yaml.safe_dump(data))
    assert cli(env, "gateway", "up", "--host", "sim").returncode == 0
    c = client(port, max_retries=0)                    # no retry: every request must succeed on its own
    got: dict = {}
    streaming = threading.Event()
    stop = threading.Event()
    outcome: Counter = Counter()
    waits: list[float] = []

    data = m["c"].model_dump(exclude={"name"})
    data["vllm"]["max_num_seqs"] = 9                   # new files: regen --restart restarts it
    (Path(env["VLLM_ORCH_MODELS"]) / "minimax-m25.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    # about 20 s of tokens at 84 tok/s: still in flight when a loaded machine's CLI reaches the hold step
    # (it takes 2 s alone; 420 tokens, 5 s, had ended before it on CI and in a full run here)
    first = threading.Thread(target=long_stream, args=(c, "minimax-m2.5", 1680, got, streaming))
    first.start()
    assert streaming.wait(30)
    threads = [threading.Thread(target=load, args=(c, "minimax-m2.5", 8, stop, outcome, waits)) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        r = cli(env, "regen", "--host", "sim", "--restart", "--json", timeout=300)
        time.sleep(0.5)
    finally:
        stop.set()
        for t in [first, *threads]:
            t.join(60)
    assert r.returncode == 0, r.stdout + r.stderr
    shown = [(a["step"], a.get("result") or "") for a in json.loads(r.stdout)["steps"]]
    steps = [s for s, _ in shown]
    hold = next((i for i, (s, res) in enumerate(shown) if s == "gateway" and "in flight" in res), None)
    assert hold is not None, shown
    assert steps[hold + 1] == "restart minimax-m25" and steps[hold + 2] == "ready minimax-m25", steps
    assert "held for minimax-m25 go on" in shown[hold + 3][1], shown
    assert got["chunks"][-1].choices[0].finish_reason == "length"     # in flight at the restart: whole
    waited = re.search(r"waited ([0-9.]+) s", shown[hold][1])
    assert waited and float(waited.group(1)) > 0.2, shown[hold]     # the restart waited for it
    assert set(outcome) == {"whole"}, outcome
    assert max(waits) > 1.0, max(waits)                # some were held through the restart, none failed
    waits.sort()
    print(f"\nregen --restart behind the gateway: {sum(outcome.values())} requests, 0 failed; wait p50 "
          f"{waits[len(waits) // 2]:.2f} s, max {waits[-1]:.2f} s; {shown[hold][1]}")


def test_a_failed_swap_and_a_sleep_swap_back_keep_the_endpoint(gw, sim_host):
    """Two sleep-capable manifests of one served name (and a third whose start dies) behind the
    gateway, under a load with the client's default retries: the failed swap's rollback does not
    wait for the requests held for the start that died (nothing listens on its port: they wait for
    the old model's start instead of the drain bound); a sleep swap, and the one back that wakes a
    sleeping manifest of the same name, route without a gateway warning; no request fails."""
    from orchestrator.sim import manager

    entry, m, env, port = gw

    def sleepy(name: str, **serving) -> Manifest:
        data = m["c"].model_dump()
        data.update(name=name)
        data["serving"].update(host="127.0.0.1", port=free_port(), **serving)
        data["sleep"] = {"level": 1}
        return Manifest.model_validate(data)

    a, b, bad = sleepy("minimax-m25"), sleepy("minimax-m25-b"), sleepy("minimax-m25-bad")
    write_models(Path(env["VLLM_ORCH_MODELS"]), [a, b, bad])
    assert cli(env, "deploy", a.name, "--host", "sim").returncode == 0
    assert cli(env, "gateway", "up", "--host", "sim").returncode == 0
    c = client(port)                                   # the client's defaults: 2 retries, Retry-After honoured
    stop = threading.Event()
    outcome: Counter = Counter()
    waits: list[float] = []
    threads = [threading.Thread(target=load, args=(c, "minimax-m2.5", 8, stop, outcome, waits)) for _ in range(3)]
    for t in threads:
        t.start()
    runs = []
    try:
        time.sleep(1)
        manager.add_fault("sim", "crash-gpu-memory", home=sim_host.home)      # the next start dies (bad's)
        runs.append(cli(env, "swap", bad.name, "--host", "sim", "--replace", a.name, "--json", timeout=300))
        runs.append(cli(env, "swap", b.name, "--host", "sim", "--replace", a.name, "--sleep-old",
                        "--port", str(b.serving.port), "--json", timeout=300))
        runs.append(cli(env, "swap", a.name, "--host", "sim", "--replace", b.name, "--sleep-old", "--json",
                        timeout=300))
        time.sleep(1)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    failed, there, back = runs
    assert failed.returncode == 1 and "serves again" in failed.stdout + failed.stderr, failed.stdout + failed.stderr
    shown = json.dumps(json.loads(failed.stdout))
    assert "where nothing listens: not waited for" in shown, shown
    for r in (there, back):
        assert r.returncode == 0, r.stdout + r.stderr
        results = [s.get("result") or "" for s in json.loads(r.stdout)["steps"]]
        assert not [x for x in results if "could not" in x], results
    assert "wake" in [s["step"] for s in json.loads(back.stdout)["steps"]]
    assert set(outcome) == {"whole"}, outcome
