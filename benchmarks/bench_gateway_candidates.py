"""Which existing proxy should carry vllm-orch's gateway (issue 41)? Measured, not assumed. Prints, does
not assert.

    .venv/bin/python benchmarks/bench_gateway_candidates.py [--requests 40]

Two SIMULATED vLLM servers (tiny-a, tiny-b, each with its own --api-key) behind each candidate, on
this machine's loopback:

  haproxy   HAProxy (Debian's 2.6): `option http-buffer-request`, the OpenAI `model` field read
            with `req.body,json_query('$.model')`, one backend per model that sets the service's
            own key, `retry-on conn-failure` with `retries` to hold a request while its service
            restarts, `http-request return` for 401/404 in OpenAI's error shape and /v1/models
  nginx     nginx (Debian's 1.22, no njs): a `map` on `$request_body` with a regex for the model
            (stock nginx has no JSON parser), `proxy_next_upstream` to retry

For each: is every request routed to the server of its model (incl. a body whose `metadata` holds
another "model" first, and a 100 KB prompt); what an unknown model, a missing gateway key and a
dev-mode path (/sleep) get; whether a request sent while its service restarts is held and answered;
whether SSE chunks arrive as the server sends them (TTFT through the proxy vs direct); whether a
client that disconnects mid-stream makes the server abort the request; and the added latency
(p50 / p99 of a one-token completion, C=1) and throughput at C=16.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.host.local import LocalHost  # noqa: E402
from orchestrator.probe import metrics  # noqa: E402
from orchestrator.sim import manager  # noqa: E402
from tests.integration.deployhelp import free_port  # noqa: E402
from tests.plugins.sim_hosts import SimHost, SimServer, make_model  # noqa: E402

GW_KEY = "gw-client-key"
KEYS = {"tiny-a": "key-a", "tiny-b": "key-b"}
NOT_FOUND = ('{"error": {"message": "The model does not exist.", "type": "NotFoundError", '
             '"param": "model", "code": 404}}')
UNAUTHORIZED = '{"error": {"message": "Unauthorized", "type": "AuthenticationError", "code": 401}}'


def haproxy_cfg(port: int, backends: dict, folder: Path) -> list:
    models = {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "vllm"} for m in backends]}
    (folder / "models.json").write_text(json.dumps(models))
    lines = ["global", "  maxconn 4096", "  tune.bufsize 262144",      # the body must fit one buffer
             f"  stats socket {folder}/admin.sock mode 600 level admin",
             "defaults", "  mode http", "  timeout connect 1s", "  timeout client 600s",
             "  timeout server 600s", "  timeout queue 60s", "  option http-buffer-request",
             "  retries 20", "  retry-on conn-failure empty-response",
             "  option http-no-delay",       # else the first SSE chunk waited ~200 ms (measured)
             "frontend gw", f"  bind 127.0.0.1:{port}",
             f"  http-request return status 401 content-type application/json string '{UNAUTHORIZED}' "
             f"unless {{ req.hdr(authorization) -m str \"Bearer {GW_KEY}\" }}",
             "  http-request return status 404 content-type application/json string "
             "'{\"detail\": \"Not Found\"}' unless { path_beg /v1/ }",
             f"  http-request return status 200 content-type application/json file {folder}/models.json "
             "if { path /v1/models }",
             "  http-request set-var(txn.model) req.body,json_query('$.model')",
             f"  http-request return status 404 content-type application/json string '{NOT_FOUND}' "
             f"unless {{ var(txn.model) -m str {' '.join(backends)} }}"]
    lines += [f"  use_backend be_{m} if {{ var(txn.model) -m str {m} }}" for m in backends]
    for m, (p, key) in backends.items():
        lines += [f"backend be_{m}", f"  http-request set-header Authorization \"Bearer {key}\"",
                  f"  server s1 127.0.0.1:{p}"]
    return lines


def nginx_cfg(port: int, backends: dict, folder: Path) -> list:
    lines = ["worker_processes 1;", f"pid {folder}/nginx.pid;", f"error_log {folder}/error.log;",
             "events { worker_connections 1024; }", "http {", f"  access_log {folder}/access.log;",
             f"  client_body_temp_path {folder}/body;", f"  proxy_temp_path {folder}/proxy;",
             "  client_body_buffer_size 1m; client_max_body_size 1m;",
             "  map $request_body $model_be {", '    default "be_none";']
    lines += [f'    "~\\"model\\"\\s*:\\s*\\"{m}\\"" be_{m};' for m in backends]
    lines += ["  }", "  map $model_be $backend_key {", '    default "";']
    lines += [f'    be_{m} "Bearer {key}";' for m, (_p, key) in backends.items()]
    lines += ["  }"]
    lines += [f"  upstream be_{m} {{ server 127.0.0.1:{p} max_fails=0; }}" for m, (p, _k) in backends.items()]
    # $request_body is empty in the rewrite phase (if/return), so the model is looked up only where
    # proxy_pass reads it; an unknown model goes to a local server that answers OpenAI's 404
    none = free_port()
    lines += [f"  upstream be_none {{ server 127.0.0.1:{none}; }}",
              f"  server {{ listen 127.0.0.1:{none}; location / {{ return 404 '{NOT_FOUND}'; }} }}"]
    lines += ["  server {", f"    listen 127.0.0.1:{port};",
              "    proxy_http_version 1.1; proxy_buffering off; proxy_read_timeout 600s;",
              "    proxy_connect_timeout 1s; proxy_next_upstream error timeout; proxy_next_upstream_tries 20;",
              "    location = /v1/models { return 404 '{\"detail\": \"Not Found\"}'; }",
              "    location /v1/ {",
              f"      if ($http_authorization != \"Bearer {GW_KEY}\") {{ return 401 '{UNAUTHORIZED}'; }}",
              "      proxy_set_header Authorization $backend_key;",
              "      proxy_pass http://$model_be;", "    }",
              "    location / { return 404 '{\"detail\": \"Not Found\"}'; }", "  }", "}"]
    return lines


class Proxy:
    def __init__(self, kind: str, backends: dict, folder: Path):
        self.kind, self.port = kind, free_port()
        folder.mkdir(parents=True, exist_ok=True)
        cfg = folder / f"{kind}.cfg"
        if kind == "haproxy":
            cfg.write_text("\n".join(haproxy_cfg(self.port, backends, folder)) + "\n")
            check = subprocess.run(["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True)
            if check.returncode:
                raise SystemExit(f"haproxy -c: {check.stdout}{check.stderr}")
            self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                                         stderr=open(folder / "haproxy.err", "wb"))
        else:
            (folder / "body").mkdir(exist_ok=True)
            (folder / "proxy").mkdir(exist_ok=True)
            cfg.write_text("\n".join(nginx_cfg(self.port, backends, folder)) + "\n")
            check = subprocess.run(["nginx", "-t", "-c", str(cfg), "-p", str(folder)], capture_output=True, text=True)
            if check.returncode:
                raise SystemExit(f"nginx -t: {check.stderr}")
            self.proc = subprocess.Popen(["nginx", "-g", "daemon off;", "-c", str(cfg), "-p", str(folder)],
                                         stdout=subprocess.DEVNULL, stderr=open(folder / "nginx.err", "wb"))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise SystemExit(f"{kind} did not listen")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def post(port: int, path: str, body: dict | None, key: str | None, timeout: float = 60.0):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    c.request("POST" if body is not None else "GET", path, body=json.dumps(body) if body is not None else None,
              headers=headers)
    r = c.getresponse()
    data = r.read()
    c.close()
    try:
        return r.status, json.loads(data or b"null")
    except ValueError:
        return r.status, data[:200]


def completion(model: str, prompt: str = "What is 2+2?", n: int = 1, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, **extra}


def ttft(port: int, model: str, key: str, n: int = 32) -> tuple[float, float, int]:
    """A streamed completion: seconds to the first chunk, to the last, and the chunks seen."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    t0 = time.monotonic()
    c.request("POST", "/v1/completions", body=json.dumps(completion(model, n=n, stream=True, ignore_eos=True)),
              headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
    r = c.getresponse()
    first, chunks = None, 0
    while True:
        line = r.readline()
        if not line:
            break
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            chunks += 1
            if first is None:
                first = time.monotonic() - t0
    c.close()
    return first or 0.0, time.monotonic() - t0, chunks


def aborted_after_disconnect(port: int, model: str, key: str, server_port: int) -> float | None:
    """Open a long stream, read one chunk, hang up; the server's aborted-request count 2 s later."""
    host = LocalHost("bench")
    before = metrics.aborted(_metrics(server_port, host))
    s = socket.create_connection(("127.0.0.1", port), 10)
    body = json.dumps(completion(model, n=4000, stream=True, ignore_eos=True)).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
              + f"authorization: Bearer {key}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
    s.recv(4096)
    s.close()
    time.sleep(2.0)
    return metrics.aborted(_metrics(server_port, host)) - before


def _metrics(port: int, _host) -> str:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    return text


def pct(xs: list, p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40)
    a = ap.parse_args()
    for tool in ("haproxy", "nginx"):
        if not shutil.which(tool):
            raise SystemExit(f"needs {tool} (apt-get install haproxy nginx-light)")
    tmp = Path(tempfile.mkdtemp(prefix="bench-gw-"))
    os.environ["VLLM_ORCH_STATE_HOME"] = str(tmp / "state")
    home = manager.sim_home()
    manager.up(1, speed=2000.0, home=home)
    entry = manager.inventory_hosts(home)["sim"]
    sim = SimHost("sim", manager.host_dir("sim", home), entry, LocalHost("sim", env=entry["env"]), home)
    servers: dict = {}
    results: dict = {}

    def serve(m: str, port: int | None = None) -> SimServer:
        d = make_model(sim.dir, m, "meta-llama/Llama-3.1-8B-Instruct", shards=2, total_size=16e9, custom_code=False)
        srv = SimServer(sim, [str(d), "--served-model-name", m, "--max-model-len", "65536"],
                        env={"VLLM_API_KEY": KEYS[m], "CUDA_VISIBLE_DEVICES": str(list(KEYS).index(m))}, port=port)
        srv.wait_ready(60)
        return srv
    try:
        for m in KEYS:
            servers[m] = serve(m)
        backends = {m: (servers[m].port, KEYS[m]) for m in KEYS}
        # the baseline: straight to the server
        base = [ttft(servers["tiny-a"].port, "tiny-a", KEYS["tiny-a"]) for _ in range(a.requests)]
        lat_direct = []
        for _ in range(a.requests):
            t0 = time.monotonic()
            post(servers["tiny-a"].port, "/v1/completions", completion("tiny-a"), KEYS["tiny-a"])
            lat_direct.append(time.monotonic() - t0)
        results["direct"] = {"lat": lat_direct, "ttft": [b[0] for b in base], "chunks": base[0][2],
                             "c16": throughput(servers["tiny-a"].port, KEYS["tiny-a"], a.requests)}
        for kind in ("haproxy", "nginx"):
            px = Proxy(kind, backends, tmp / kind)
            r: dict = {}
            try:
                got = [post(px.port, "/v1/completions", completion(m), GW_KEY)
                       for m in ("tiny-a", "tiny-b") * (a.requests // 2)]
                r["routed"] = sum(1 for (st, out), m in zip(got, ("tiny-a", "tiny-b") * (a.requests // 2))
                                  if st == 200 and isinstance(out, dict) and out.get("model") == m)
                r["routed_of"] = len(got)
                tricky = completion("tiny-b", metadata={"model": "tiny-a"})
                tricky = {"metadata": tricky.pop("metadata"), **tricky}          # "model" inside first
                st, out = post(px.port, "/v1/completions", tricky, GW_KEY)
                r["metadata_first"] = out.get("model") if st == 200 and isinstance(out, dict) else f"HTTP {st}"
                st, out = post(px.port, "/v1/completions", completion("tiny-b", "x " * 50000), GW_KEY)
                r["prompt_100k"] = out.get("model") if st == 200 and isinstance(out, dict) else f"HTTP {st} {out}"
                r["unknown"] = post(px.port, "/v1/completions", completion("nope"), GW_KEY)
                r["no_key"] = post(px.port, "/v1/completions", completion("tiny-a"), None)[0]
                r["dev_path"] = post(px.port, "/sleep?level=1", {}, GW_KEY)[0]
                r["models"] = post(px.port, "/v1/models", None, GW_KEY)
                # held through a restart: stop tiny-b, ask for it, start it again 3 s later
                port_b = servers["tiny-b"].port
                servers["tiny-b"].proc.terminate()
                servers["tiny-b"].proc.wait(30)
                box: dict = {}

                def ask():
                    t0 = time.monotonic()
                    box["answer"] = post(px.port, "/v1/completions", completion("tiny-b"), GW_KEY, timeout=120)
                    box["s"] = time.monotonic() - t0
                t = threading.Thread(target=ask)
                t.start()
                time.sleep(3.0)
                servers["tiny-b"] = serve("tiny-b", port=port_b)
                t.join(120)
                r["held"] = (box["answer"][0], round(box["s"], 2))
                tt = [ttft(px.port, "tiny-a", GW_KEY) for _ in range(a.requests)]
                r["ttft"], r["chunks"] = [x[0] for x in tt], tt[0][2]
                lat = []
                for _ in range(a.requests):
                    t0 = time.monotonic()
                    post(px.port, "/v1/completions", completion("tiny-a"), GW_KEY)
                    lat.append(time.monotonic() - t0)
                r["lat"] = lat
                r["c16"] = throughput(px.port, GW_KEY, a.requests)
                r["aborted"] = aborted_after_disconnect(px.port, "tiny-a", GW_KEY, servers["tiny-a"].port)
            finally:
                px.stop()
            results[kind] = r
    finally:
        for s in servers.values():
            s.proc.terminate()
        manager.down(home)
    report(results, a.requests)


def throughput(port: int, key: str, n: int) -> float:
    """Completions per second at 16 concurrent clients (16 tokens each)."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda _: post(port, "/v1/completions", completion("tiny-a", n=16), key), range(n * 4)))
    return n * 4 / (time.monotonic() - t0)


def report(results: dict, n: int) -> None:
    d = results["direct"]
    print(f"SIMULATED vLLM servers tiny-a, tiny-b on loopback; {n} requests per figure; 2-core machine")
    print(f"direct: one-token completion p50 {statistics.median(d['lat']) * 1e3:.1f} ms p99 "
          f"{pct(d['lat'], .99) * 1e3:.1f} ms; stream TTFT p50 {statistics.median(d['ttft']) * 1e3:.1f} ms, "
          f"{d['chunks']} chunks; C=16 {d['c16']:.1f} req/s")
    for kind in ("haproxy", "nginx"):
        r = results[kind]
        print(f"{kind}:")
        print(f"  routed by model: {r['routed']}/{r['routed_of']}; `metadata.model` before `model` -> "
              f"{r['metadata_first']} (want tiny-b); 100 KB prompt -> {r['prompt_100k']}")
        print(f"  unknown model: HTTP {r['unknown'][0]} {json.dumps(r['unknown'][1])[:90]}")
        print(f"  no gateway key: HTTP {r['no_key']}; dev path /sleep: HTTP {r['dev_path']}; "
              f"/v1/models: HTTP {r['models'][0]} {json.dumps(r['models'][1])[:80]}")
        print(f"  request during a 3 s restart of its service: HTTP {r['held'][0]} after {r['held'][1]} s")
        added = (statistics.median(r["lat"]) - statistics.median(d["lat"])) * 1e3
        print(f"  one-token p50 {statistics.median(r['lat']) * 1e3:.1f} ms (+{added:.1f}) "
              f"p99 {pct(r['lat'], .99) * 1e3:.1f} ms; stream TTFT p50 {statistics.median(r['ttft']) * 1e3:.1f} ms "
              f"(+{(statistics.median(r['ttft']) - statistics.median(d['ttft'])) * 1e3:.1f}), {r['chunks']} chunks; "
              f"C=16 {r['c16']:.1f} req/s; client hung up mid-stream -> server aborted {r['aborted']}")


if __name__ == "__main__":
    main()
