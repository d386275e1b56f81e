"""A REAL Prometheus (Debian's `prometheus` package, run here as a child on a free port with its
storage in tmp) loading what `vllm-orch monitor` writes and scraping a SIMULATED host through the
generated file_sd files (a DP8 service: eight series of each vLLM metric, one per engine): the
targets are up, every recording rule produces one series per service, every panel of the Grafana
dashboard returns data through the query API, and the `hang-after-ready` fault (the engine stops;
/metrics stays as the last step left it, requests in flight), triggered once Prometheus has seen
tokens flow and no hang alert, makes VllmServiceHung fire after its `for:` - with the short
interval and `for:` of `monitor --interval 1 --for 3`. The service is keyed, and by default
scraped like any other, without a key (vLLM 0.33, and the simulator, leave /metrics unguarded): a
listener added to the targets records that the scrape sends no Authorization header. vllm-orch's
own series come from `vllm-orch status --prometheus`, served as a file over HTTP as a node
exporter's textfile collector would serve it.
Nothing waits a fixed time: it polls."""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from orchestrator.host.local import LocalHost
from orchestrator.ops import monitor_rules
from orchestrator.probe import api as probes
from orchestrator.secret import Secret
from orchestrator.sim import manager

from .deployhelp import cli_env, deploy, entry, free_port, tuned, write_models

KEY = "sk-prometheus-test-41c9"
FOR_S = 3


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing: install Debian's `prometheus` package (`./dev test` installs it)")
    return path


def get(port: int, path: str, **params: str) -> dict:
    url = f"http://127.0.0.1:{port}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def poll(what: str, probe, budget: float = 90.0):
    """probe() until it returns something truthy; its last answer in the failure message."""
    deadline = time.monotonic() + budget
    last = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except (OSError, ValueError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.25)
    pytest.fail(f"timed out waiting for {what}; last answer: {last!r:.2000}")


def listen_for_headers() -> tuple[list[str], http.server.ThreadingHTTPServer]:
    """An empty /metrics on a free port that keeps every Authorization header it is sent."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization") or "")
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return seen, server


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=180)


@pytest.mark.long
def test_a_real_prometheus_scrapes_the_fleet_and_the_hang_alert_fires(sim_host, tmp_path, monkeypatch):
    t0 = time.monotonic()
    promtool, prometheus = binary("promtool"), binary("prometheus")
    monkeypatch.setenv("VLLM_API_KEY", KEY)        # a keyed service: scraped without its key all the same
    m = tuned("minimax-m25-ep", serving={"secret_env": ["VLLM_API_KEY"]})    # DP8: a series per engine
    trigger = tmp_path / "hang-now"        # the engine hangs when the test says: once Prometheus saw it work
    manager.add_fault("sim", "hang-after-ready", m.name, home=sim_host.home, trigger=str(trigger))
    e = entry(sim_host)
    assert deploy(e, m).ok
    ep = probes.Endpoint(LocalHost("sim"), m.serving.port, Secret(KEY))
    body = {"model": m.served_name, "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 60000, "ignore_eos": True}

    def stream() -> None:           # in flight when the engine hangs, and long after
        try:
            ep.request("POST", "/v1/chat/completions", json=body, timeout=600)
        except probes.HttpError:
            pass

    for _ in range(2):
        threading.Thread(target=stream, daemon=True).start()

    env = cli_env(sim_host, write_models(tmp_path / "models", [m]))
    state_dir, state_port = tmp_path / "state-exporter", free_port()
    state_dir.mkdir()
    out = tmp_path / "monitoring"
    made = cli(env, "monitor", "--host", "sim", "--out", str(out), "--interval", "1", "--for", str(FOR_S),
               "--state-target", f"127.0.0.1:{state_port}")
    assert made.returncode == 0, made.stdout + made.stderr
    state = cli(env, "status", "--host", "sim", "--prometheus")
    assert state.returncode == 0, state.stdout + state.stderr
    (state_dir / "metrics").write_text(state.stdout)
    checked = subprocess.run([promtool, "check", "config", str(out / "prometheus.yml")], capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # vLLM 0.33 does not guard /metrics with its key (nor does the sim): a listener that records what the
    # service's job sends shows no Authorization header
    seen, listener = listen_for_headers()
    assert json.loads((out / "targets" / "vllm-keyed.json").read_text()) == []
    plain_file = out / "targets" / "vllm.json"
    plain_file.write_text(json.dumps([*json.loads(plain_file.read_text()), {
        "targets": [f"127.0.0.1:{listener.server_address[1]}"], "labels": {"host": "probe", "service": "probe"}}]))

    port = free_port()
    children = [
        subprocess.Popen([sys.executable, "-m", "http.server", str(state_port), "--bind", "127.0.0.1",
                          "--directory", str(state_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        subprocess.Popen([prometheus, f"--config.file={out / 'prometheus.yml'}",
                          f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                          "--web.enable-lifecycle"], stdout=subprocess.DEVNULL,
                         stderr=open(tmp_path / "prometheus.log", "w")),
    ]
    try:
        poll("prometheus to be ready", lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{port}/-/ready", timeout=5).status == 200)

        def targets_up():
            active = get(port, "/api/v1/targets")["data"]["activeTargets"]
            jobs = {(t["labels"]["job"], t["health"]) for t in active}
            return active if jobs == {("vllm", "up"), ("vllm-orch", "up")} and len(active) == 3 else None
        active = poll("the service's and vllm-orch's targets up", targets_up)
        assert seen and set(seen) == {""}, seen
        [svc] = [t for t in active if t["labels"]["job"] == "vllm" and t["labels"]["host"] == "sim"]
        assert svc["labels"]["service"] == m.name and svc["labels"]["host"] == "sim"
        assert svc["labels"]["served_name"] == m.served_name and svc["labels"]["gpus"] == "0,1,2,3,4,5,6,7"
        assert svc["labels"]["vllm_version"] == "0.33.0" and svc["labels"]["node_role"] == "single"

        def query(expr: str) -> list:
            return get(port, "/api/v1/query", query=expr)["data"]["result"]

        def hung_firing() -> list:
            alerts = get(port, "/api/v1/alerts")["data"]["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "VllmServiceHung" and a["state"] == "firing"]
        engines = poll("the engines' series", lambda: query(f'count(vllm:kv_cache_usage_perc{{service="{m.name}"}})'))
        assert engines[0]["value"][1] == "8", engines
        for name in monitor_rules.recorded(monitor_rules.Timing(interval_s=1)):      # one series per service
            rows = poll(f"recording rule {name}", lambda name=name: query(name))
            assert [(r["metric"]["host"], r["metric"]["service"]) for r in rows] == [("sim", m.name)], rows

        board = json.loads((out / "grafana" / "vllm-orch-fleet.json").read_text())
        for title, expr in monitor_rules.panel_expressions(board):
            poll(f"panel {title!r}: {expr}", lambda expr=expr: query(expr))

        def flowing():
            rows = query("vllm_orch:generation_tokens:rate")
            return rows if rows and float(rows[0]["value"][1]) > 0 else None
        poll("output tokens/s above 0 while the engine works", flowing)
        assert not hung_firing() and not [a for a in get(port, "/api/v1/alerts")["data"]["alerts"]
                                          if a["labels"]["alertname"] == "VllmServiceHung"]
        trigger.touch()

        [alert] = poll("VllmServiceHung to fire", hung_firing)
        assert alert["labels"]["service"] == m.name and alert["labels"]["host"] == "sim"
        fired = [json.loads(line) for line in (sim_host.dir / "logs" / "faults-fired.jsonl").read_text().splitlines()]
        hung_at = next(f["at"] for f in fired if f["fault"] == "hang-after-ready" and f.get("phase") == "hung")
        active_at = alert["activeAt"]
        from datetime import datetime
        pending_from = datetime.fromisoformat(active_at.replace("Z", "+00:00")).timestamp()
        assert pending_from >= hung_at - 1.0, (active_at, hung_at)      # only once the engine hung
    finally:
        listener.shutdown()
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    print(f"\nreal Prometheus test: {time.monotonic() - t0:.1f} s, the hang alert active "
          f"{pending_from - hung_at:.1f} s after the hang")
    assert Path(tmp_path / "tsdb").is_dir()
