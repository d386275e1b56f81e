"""The contract probe suite: what vllm-orch relies on from a vLLM server, observed as plain data.

`observe(port, key, served, log_text, titles)` runs the same probes against any server - the real one
(vLLM's CPU build) or the simulated one - and returns a dict of shapes: endpoints, status codes,
error bodies (wrong model name, missing key), SSE chunk shapes with the usage block, metric names,
types and label names, process titles and start-up log lines. Values that legitimately differ
(ids, timestamps, version numbers, generated text) are reduced to their shape. `diff(real, sim)`
lists every place the simulator differs: the contract test fails on any.

Deliberately outside the contract (documented differences of the CPU build, not of the simulator):
the CPU build runs a separate `VLLM::Worker` even at TP=1 and logs "CPU KV cache size"; the sim
plays the GPU build (no worker process at TP=1, "GPU KV cache size"). Both are checked against
vLLM's own naming instead (TITLE, the KV-cache line pattern).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import time

KEY_HEADER = "Authorization"
# vLLM's process titles (setproctitle "VLLM::..."), any parallel layout.
TITLE = re.compile(r"^VLLM::(EngineCore(_DP\d+)?|Worker(_DP\d+)?(_PP\d+)?(_TP\d+)?(_DCP\d+)?(_EP\d+)?"
                   r"|DPCoordinator|APIServer(_\d+)?)$")
# Start-up lines the orchestrator reads (readiness phases, logsig) or shows; the whole line.
STARTUP_LINES = {
    "non-default args": r"^\(APIServer pid=\d+\) INFO \d\d-\d\d [\d:]+ \[[\w.]+:\d+\] non-default args: \{",
    "architecture": r"^\(APIServer pid=\d+\) INFO .*\] Resolved architecture: LlamaForCausalLM$",
    "max model len": r"^\(APIServer pid=\d+\) INFO .*\] Using max model len 1024$",
    "engine config": r"^\(EngineCore pid=\d+\) INFO .*\] Initializing a V1 LLM engine \(v[\w.+]+\) with config: model=",
    "shards loaded": r"Loading safetensors checkpoint shards: 100% Completed \| 1/1 ",
    "weights took": r"\) INFO .*\] Loading weights took [\d.]+ seconds$",
    "kv cache size": r"^\(EngineCore pid=\d+\) INFO .*\] [GC]PU KV cache size: [\d,]+ tokens, Maximum concurrency "
                     r"for 1,024 tokens per request: [\d.]+x$",
    "init engine": r"^\(EngineCore pid=\d+\) INFO .*\] init engine \(profile, create kv cache, warmup model\) "
                   r"took [\d.]+ s",
    "starting server": r"^\(APIServer pid=\d+\) INFO .*\] Starting vLLM server on http://127\.0\.0\.1:\d+$",
    "route chat": r"^\(APIServer pid=\d+\) INFO .*\] Route: /v1/chat/completions, Methods: POST$",
    "uvicorn started": r"^INFO:     Started server process \[\d+\]$",
    "uvicorn waiting": r"^INFO:     Waiting for application startup\.$",
    "uvicorn complete": r"^INFO:     Application startup complete\.$",
}
# Metric families vllm-orch reads (bench/promscrape.py, ops/status.py, bench reports): name, type
# and label names must be exactly the real ones. Any other family the simulator serves must exist
# in the real server with the same type and a subset of its labels (extra_metric_problems).
METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
           "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
           "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
           "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
           "vllm:e2e_request_latency_seconds")


def request(port: int, method: str, path: str, body: dict | None = None, key: str | None = None,
            timeout: float = 60.0) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if key:
            headers[KEY_HEADER] = f"Bearer {key}"
        conn.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                     headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def shape(obj):
    """The structure of a JSON value: dict keys (recursively), list shapes, type names of scalars."""
    if isinstance(obj, dict):
        return {k: shape(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [shape(v) for v in obj[:1]]
    return type(obj).__name__


def chat(served: str, max_tokens: int, stream: bool) -> dict:
    body = {"model": served, "messages": [{"role": "user", "content": "Tell me about the river."}],
            "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def observe_http(port: int, key: str, served: str) -> dict:
    out: dict = {}
    status, _h, body = request(port, "GET", "/health")
    out["health"] = (status, body)
    status, _h, body = request(port, "GET", "/v1/models")
    out["models without key"] = (status, json.loads(body))
    status, _h, body = request(port, "GET", "/v1/models", key=key)
    models = json.loads(body)
    card = models["data"][0]
    out["models"] = {"status": status, "shape": shape(models), "id": card["id"], "object": card["object"],
                     "owned_by": card["owned_by"], "max_model_len": card["max_model_len"],
                     "parent": card["parent"]}
    status, _h, body = request(port, "GET", "/version")
    out["version"] = (status, shape(json.loads(body)))
    status, _h, body = request(port, "POST", "/v1/chat/completions", chat(served, 4, False))
    out["chat without key"] = (status, json.loads(body))
    status, _h, body = request(port, "POST", "/v1/chat/completions", {**chat(served, 4, False),
                                                                       "model": "no-such-model"}, key=key)
    err = json.loads(body)
    message = err["error"]["message"]
    err["error"]["message"] = re.sub(re.escape(served), "<served>", message)
    out["wrong model"] = (status, err)
    status, headers, body = request(port, "POST", "/v1/chat/completions", chat(served, 4, False), key=key)
    reply = json.loads(body)
    out["chat"] = {"status": status, "content-type": headers.get("content-type"), "shape": shape(reply),
                   "object": reply["object"], "finish_reason": reply["choices"][0]["finish_reason"],
                   "completion_tokens": reply["usage"]["completion_tokens"]}
    out["stream"] = observe_stream(port, key, served)
    # The real server publishes its gauges with the engine's periodic stats: on a busy machine
    # that can lag the requests above by seconds, so wait for them (up to 30 s) before comparing.
    deadline = time.monotonic() + 30
    while True:
        status, headers, body = request(port, "GET", "/metrics")
        if b"vllm:kv_cache_usage_perc{" in body or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    out["metrics"] = {"status": status, "content-type": headers.get("content-type", "").split(";")[0],
                      **metric_shapes(body.decode())}
    out["_metrics_text"] = body.decode()        # for extra_metric_problems; not compared by diff
    return out


def observe_stream(port: int, key: str, served: str) -> dict:
    status, headers, body = request(port, "POST", "/v1/chat/completions", chat(served, 4, True), key=key)
    events = [line[len("data: "):] for line in body.decode().split("\n\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", body[-500:]
    chunks = [json.loads(e) for e in events[:-1]]
    first, usage_chunk = chunks[0], chunks[-1]
    content = [c for c in chunks[1:-1]]
    return {"status": status, "content-type": headers.get("content-type"),
            "raw framing": body.startswith(b"data: {") and body.endswith(b"data: [DONE]\n\n"),
            "first chunk": shape(first), "first delta": first["choices"][0]["delta"],
            # Not the chunk count: a busy server coalesces tokens that are ready together into one
            # chunk (seen on the real one under load); the text and the usage are the invariants.
            "content chunk": shape(content[0]),
            "content words": len("".join(c["choices"][0]["delta"].get("content") or "" for c in content).split()),
            "chunks <= tokens": len(content) <= usage_chunk["usage"]["completion_tokens"],
            "last finish_reason": content[-1]["choices"][0]["finish_reason"],
            "other finish_reasons": {c["choices"][0]["finish_reason"] for c in content[:-1]},
            "last content chunk": shape(content[-1]),
            "usage chunk": shape(usage_chunk), "usage choices": usage_chunk["choices"],
            "usage completion_tokens": usage_chunk["usage"]["completion_tokens"],
            "objects": sorted({c["object"] for c in chunks})}


def metric_families(text: str) -> dict:
    """{family: (name on its TYPE line, type, sorted label-name sets of its samples)} (a counter's
    family is its name without `_total`; histograms add _bucket/_sum/_count)."""
    families: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            families[name.removesuffix("_total") if kind == "counter" else name] = (name, kind)
    labels: dict[str, set] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)\{([^}]*)\}\s", line)
        if not m:
            continue
        name = m.group(1)
        family = next((f for f in families if name == f or name in (
            f + "_total", f + "_bucket", f + "_sum", f + "_count", f + "_created")), None)
        if family is not None:
            labels.setdefault(family, set()).add(tuple(sorted(re.findall(r'(\w+)="', m.group(2)))))
    return {f: (*families[f], sorted(labels.get(f, ()))) for f in families}


def metric_shapes(text: str) -> dict:
    fams = metric_families(text)
    return {f: fams.get(f, (None, None, [])) for f in METRICS}


def extra_metric_problems(real_text: str, sim_text: str) -> list[str]:
    """Families the simulator serves beyond METRICS that the real server lacks, or types it, or
    labels it, differently (a subset of the real labels is fine: the sim models fewer settings)."""
    real, sim = metric_families(real_text), metric_families(sim_text)
    out = []
    for f, (name, kind, sets) in sorted(sim.items()):
        if f in METRICS:
            continue
        if f not in real:
            out.append(f"metrics.{f}: only in the simulator")
            continue
        r_name, r_kind, r_sets = real[f]
        r_labels = {label for s in r_sets for label in s}
        if (name, kind) != (r_name, r_kind) or not {label for s in sets for label in s} <= r_labels:
            out.append(f"metrics.{f}: real={real[f]!r:.300} sim={sim[f]!r:.300}")
    return out


def observe_log(log_text: str) -> dict:
    lines = log_text.splitlines()
    return {name: any(re.search(rx, line) for line in lines) for name, rx in STARTUP_LINES.items()}


def descendant_titles(pid: int) -> list[str]:
    """Process titles (argv[0]) of every descendant of `pid`: the engine, workers and helpers a
    server started (real or simulated; both may be in the caller's process group)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            out.append(open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace"))
        except OSError:
            pass
    return sorted(out)


def observe_dp(port: int, key: str, served: str, log_text: str, titles: list[str]) -> dict:
    """What a data-parallel (DP=2) server shows: its process titles (CPU-only workers aside),
    the engine label of per-engine series after one request, and who logs the key lines."""
    request(port, "POST", "/v1/chat/completions", chat(served, 4, False), key=key)
    text = request(port, "GET", "/metrics")[2].decode()
    engines = {}
    # Counters exist for every engine from the start; the real server's gauges appear per engine
    # only once that engine has reported stats, so they are not compared.
    for family in ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:request_success_total"):
        engines[family] = sorted({m for m in re.findall(rf'^{family}{{[^}}]*engine="(\d+)"', text, re.M)})

    def who(message: str) -> list[str]:
        return sorted({m.group(1) for line in log_text.splitlines()
                       if message in line and (m := re.match(r"^\((\w+) pid=\d+\)", line))})
    return {"titles": sorted(t for t in titles if re.match(r"^VLLM::(DPCoordinator|EngineCore_DP\d+|"
                                                           r"APIServer_\d+)$", t)),
            "engines": engines,
            "engine config logged by": who("Initializing a V1 LLM engine"),
            "kv cache logged by": who("KV cache size:"),
            "server start logged by": who("Starting vLLM server on"),
            "args logged by": who("non-default args:")}


def observe_titles(titles: list[str]) -> dict:
    """Every vLLM-titled process (others: multiprocessing's resource tracker...) has a title of
    vLLM's grammar, and there is an engine core."""
    named = [t for t in titles if t.startswith("VLLM::")]
    return {"all vLLM titles": [t for t in named if not TITLE.match(t)] == [],
            "engine core": "VLLM::EngineCore" in named}


def diff(real: dict, sim: dict, path: str = "") -> list[str]:
    """Every place where sim differs from real: 'path: real=... sim=...'."""
    out = []
    if isinstance(real, dict) and isinstance(sim, dict):
        for k in sorted(set(real) | set(sim), key=str):
            if k not in sim:
                out.append(f"{path}{k}: missing in the simulator (real: {real[k]!r:.200})")
            elif k not in real:
                out.append(f"{path}{k}: only in the simulator ({sim[k]!r:.200})")
            else:
                out += diff(real[k], sim[k], f"{path}{k}.")
    elif real != sim:
        out.append(f"{path.rstrip('.')}: real={real!r:.400} sim={sim!r:.400}")
    return out


# -- multi-node lines: pinned to the real source files ------------------------------------------
# A real multi-node rendezvous needs several machines; what can be checked on one is that every
# line the simulator prints for it (orchestrator/sim/vllm_server.py MULTINODE_LINES) stands in vLLM
# 0.33's source at the line it names, or among torch's C++ messages (libtorch_cpu.so's strings).

_LOCATE = ("import importlib.util as u, json; print(json.dumps({n: list(u.find_spec(n).submodule_search_locations)[0] "
           "for n in ('vllm', 'torch')}))")


def multinode_source_problems(python) -> list[str]:
    """Every MULTINODE_LINES piece missing from its source (or, for vLLM files, from the lines
    around the one it names), as 'key: ...'. `python`: an interpreter with vLLM 0.33 and torch."""
    import importlib.util
    import mmap
    import subprocess
    from pathlib import Path

    from orchestrator.paths import package_file

    spec = importlib.util.spec_from_file_location("_sim_vllm_lines", package_file("sim", "vllm_server.py"))
    assert spec is not None and spec.loader is not None
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    where = json.loads(subprocess.run([str(python), "-c", _LOCATE], capture_output=True, text=True,
                                      check=True, timeout=120).stdout)
    problems = []
    for key, (_who, source, pieces) in sim.MULTINODE_LINES.items():
        pkg, _, rest = source.partition("/")
        path, _, line = rest.partition(":")
        file = Path(where[pkg]) / path
        if not file.is_file():
            problems.append(f"{key}: {file} does not exist")
            continue
        if file.suffix == ".so":
            with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                problems += [f"{key}: {p!r} not in {source}" for p in pieces if data.find(p.encode()) < 0]
            continue
        lines = file.read_text().splitlines()
        text = "\n".join(lines)
        problems += [f"{key}: {p!r} not in {source}" for p in pieces if p not in text]
        n = int(line)
        near = "\n".join(lines[max(0, n - 3):n + 4])
        if pieces[0] not in near:
            problems.append(f"{key}: {pieces[0]!r} not within 3 lines of {source}")
    return problems
