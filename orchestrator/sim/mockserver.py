"""Mock OpenAI-compatible streaming server with zero or known latency, for tests and the ceiling run.

    python -m orchestrator.sim.mockserver --port 0 [--ttft-ms 200 --itl-ms 10] [--reasoning-tokens N]
        [--tokens-per-chunk K] [--http-error-every N] [--stream-error-every N --stream-error-at T]
        [--drop-every N --drop-at T] [--slow-every N --slow-ttft-ms A --slow-itl-ms B]
        [--tokenizer false] [--cpu CORE] [--model NAME]

It prints `MOCK_PORT=<port>` once listening. Chunks are pre-serialised byte templates in vLLM's
format (uvicorn framing: `transfer-encoding: chunked`, one HTTP chunk per SSE event, `data: [DONE]`),
so the server costs little per token. Tokens follow an absolute schedule: token j of a request is
written at t_request + TTFT + j*ITL, so the mean TPOT a client should measure is exactly ITL.
Like old vLLM versions, the role-only chunk is sent *before* generation: a client that starts TTFT on
it is visibly wrong. /metrics serves the vLLM gauge and counter names the bench scrapes.
/tokenize and /detokenize are the simulated vLLM server's (same shapes, same counts as the
usage.prompt_tokens reported here); `--tokenizer false` answers them 404 like a server without them.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import sys
import threading
import time
from dataclasses import dataclass

from orchestrator.sim.vllm_server import detokenize_endpoint, encode_chat, tokenize_endpoint

MAX_MODEL_LEN = 32768


@dataclass
class MockConfig:
    model: str = "mock-model"
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    reasoning_tokens: int = 0          # the first N tokens are reasoning_content
    tokens_per_chunk: int = 1
    default_max_tokens: int = 16
    http_error_every: int = 0          # every Nth request gets HTTP 500
    stream_error_every: int = 0        # every Nth request streams an error event ...
    stream_error_at: int = 3           # ... after this many tokens
    drop_every: int = 0                # every Nth request has its connection dropped ...
    drop_at: int = 3                   # ... after this many tokens
    send_usage: bool = True            # False: a server that never sends usage
    slow_every: int = 0                # every Nth request uses the slow latencies below
    slow_ttft_ms: float = 0.0
    slow_itl_ms: float = 0.0
    tokenizer: bool = True             # serve /tokenize and /detokenize


class _Ticker:
    """Precise wake-ups for the known-latency mode.

    asyncio sleeps wake up to 1 ms late (epoll timeouts are whole milliseconds), which would be the
    same size as the error we want to detect. A thread with a deadline heap sleeps with sub-0.1 ms
    precision and hands due wake-ups to the loop in one call_soon_threadsafe batch.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.heap: list[tuple[float, int, asyncio.Future]] = []
        self.cond = threading.Condition()
        self.seq = 0
        threading.Thread(target=self._run, name="mock-ticker", daemon=True).start()

    def wait_until(self, due: float) -> asyncio.Future:
        fut = self.loop.create_future()
        with self.cond:
            self.seq += 1
            heapq.heappush(self.heap, (due, self.seq, fut))
            if self.heap[0][2] is fut:
                self.cond.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.heap:
                    self.cond.wait()
                delay = self.heap[0][0] - time.perf_counter()
                if delay > 0:
                    self.cond.wait(delay)
                    continue
                now = time.perf_counter() + 0.00005
                due = []
                while self.heap and self.heap[0][0] <= now:
                    due.append(heapq.heappop(self.heap)[2])
            self.loop.call_soon_threadsafe(_wake, due)


def _wake(futs: list) -> None:
    for f in futs:
        if not f.done():
            f.set_result(None)


class _State:
    def __init__(self, cfg: MockConfig):
        self.cfg = cfg
        self.requests = 0
        self.running = 0
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.success = 0
        self.ticker: _Ticker | None = None
        self.late_sum = 0.0      # known-latency mode: how late token writes were vs the schedule
        self.late_max = 0.0
        self.late_n = 0
        self.first_late_sum = 0.0
        self.first_late_n = 0
        cid = b'{"id":"chatcmpl-mock","object":"chat.completion.chunk","created":0,"model":' + \
            json.dumps(cfg.model).encode() + b',"choices":[{"index":0,"delta":'
        self.role = _frame(cid + b'{"role":"assistant","content":""},"logprobs":null,'
                                 b'"finish_reason":null}]}')
        self._cid = cid
        self._plain: dict[tuple, bytes] = {}

    def token_frame(self, kind: str, k: int, last: bool, usage: tuple | None) -> bytes:
        """Pre-serialised frame for k tokens of `kind`; usage=(prompt, cumulative) for per-chunk usage."""
        if usage is None:
            key = (kind, k, last)
            f = self._plain.get(key)
            if f is None:
                f = self._plain[key] = _frame(self._chunk(kind, k, last) + b"}")
            return f
        p, c = usage
        return _frame(self._chunk(kind, k, last) +
                      b',"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}}'
                      % (p, p + c, c))

    def _chunk(self, kind: str, k: int, last: bool) -> bytes:
        text = json.dumps(" tok" * k).encode()
        field = b'"reasoning_content"' if kind == "reasoning" else b'"content"'
        fin = b'"length"' if last else b"null"
        return self._cid + b"{" + field + b":" + text + b'},"logprobs":null,"finish_reason":' + fin + b"}]"


def _frame(payload: bytes) -> bytes:
    """One SSE event in one HTTP chunk."""
    ev = b"data: " + payload + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(ev), ev)


SSE_HEAD = (b"HTTP/1.1 200 OK\r\ndate: Thu, 01 Jan 2026 00:00:00 GMT\r\nserver: uvicorn\r\n"
            b"content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n")
DONE = _frame(b"[DONE]")
LAST_CHUNK = b"0\r\n\r\n"


def _response(status: int, body: bytes, ctype: str = "application/json") -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}[status]
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n"
            f"\r\n").encode() + body


def _error_body(status: int, message: str, etype: str, param: str | None = None) -> bytes:
    """vLLM 0.33's ErrorResponse: {"error": {message, type, param, code}}."""
    return json.dumps({"error": {"message": message, "type": etype, "param": param,
                                 "code": status}}).encode()


class MockProtocol(asyncio.Protocol):
    transport: asyncio.Transport          # set by connection_made, before any data arrives
    def __init__(self, state: _State):
        self.state = state
        self.t_arrival = 0.0
        self.buf = b""
        self.busy = False
        self._writable = asyncio.Event()
        self._writable.set()

    def connection_made(self, transport):
        self.transport = transport

    def pause_writing(self):
        self._writable.clear()

    def resume_writing(self):
        self._writable.set()

    def connection_lost(self, exc):
        self._writable.set()

    def data_received(self, data: bytes):
        if not self.buf:
            self.t_arrival = time.perf_counter()     # the schedule starts when the request arrives
        self.buf += data
        if self.busy:
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].decode("latin-1").split("\r\n")
        length = 0
        for line in head[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if len(self.buf) < end + 4 + length:
            return
        body = self.buf[end + 4:end + 4 + length]
        self.buf = self.buf[end + 4 + length:]
        method, path = head[0].split(" ")[:2]
        self.busy = True
        asyncio.get_running_loop().create_task(self._serve(method, path, body))

    async def _serve(self, method: str, path: str, body: bytes):
        try:
            await self._route(method, path, body)
        finally:
            self.busy = False
            if self.buf and not self.transport.is_closing():
                self.data_received(b"")

    async def _route(self, method: str, path: str, body: bytes):
        st, t = self.state, self.transport
        if path.endswith("/chat/completions") and method == "POST":
            await self._chat(body)
        elif path == "/metrics":
            t.write(_response(200, self._metrics().encode(), "text/plain; version=0.0.4"))
        elif path == "/health":
            t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        elif path == "/version":
            t.write(_response(200, b'{"version":"mock"}'))
        elif path in ("/tokenize", "/detokenize") and method == "POST" and st.cfg.tokenizer:
            try:
                req = json.loads(body or b"{}")
            except ValueError:
                req = None
            status, obj = (tokenize_endpoint(req, [st.cfg.model], MAX_MODEL_LEN) if path == "/tokenize"
                           else detokenize_endpoint(req, [st.cfg.model]))
            t.write(_response(status, json.dumps(obj).encode()))
        elif path == "/v1/models":
            t.write(_response(200, json.dumps({"object": "list", "data": [
                {"id": st.cfg.model, "object": "model", "owned_by": "vllm"}]}).encode()))
        else:
            t.write(_response(404, b'{"detail":"Not Found"}'))      # FastAPI's unknown route

    async def _chat(self, body: bytes):
        st, cfg, t = self.state, self.state.cfg, self.transport
        t0 = self.t_arrival
        req = json.loads(body)
        st.requests += 1
        n = st.requests
        if req.get("model") != cfg.model:
            t.write(_response(404, _error_body(404, f"The model `{req.get('model')}` does not exist. "
                                                f"Valid aliases: {cfg.model}.", "NotFoundError", "model")))
            return
        if cfg.http_error_every and n % cfg.http_error_every == 0:
            t.write(_response(500, _error_body(500, "mock injected failure", "InternalServerError")))
            return
        max_tokens = req.get("max_completion_tokens") or req.get("max_tokens") or cfg.default_max_tokens
        opts = req.get("stream_options") or {}
        usage_on = cfg.send_usage and opts.get("include_usage")
        cont = usage_on and opts.get("continuous_usage_stats")
        prompt = len(encode_chat(req.get("messages") or []))
        st.prompt_tokens += prompt
        st.running += 1
        try:
            t.write(SSE_HEAD + st.role)
            stream_err = cfg.stream_error_every and n % cfg.stream_error_every == 0
            drop = cfg.drop_every and n % cfg.drop_every == 0
            ttft, itl = cfg.ttft_ms / 1000.0, cfg.itl_ms / 1000.0
            if cfg.slow_every and n % cfg.slow_every == 0:
                ttft, itl = cfg.slow_ttft_ms / 1000.0, cfg.slow_itl_ms / 1000.0
            k_max = max(1, cfg.tokens_per_chunk)
            sent, chunks = 0, 0
            while sent < max_tokens:
                if stream_err and sent >= cfg.stream_error_at:
                    t.write(_frame(json.dumps({"error": {"object": "error", "message": "mock stream error",
                                                         "type": "InternalServerError", "code": 500}}).encode()))
                    t.write(DONE + LAST_CHUNK)
                    return
                if drop and sent >= cfg.drop_at:
                    t.abort()
                    return
                k = min(k_max, max_tokens - sent)
                kind = "reasoning" if sent < cfg.reasoning_tokens else "content"
                if kind == "reasoning":
                    k = min(k, cfg.reasoning_tokens - sent)
                due = t0 + ttft + (sent + k - 1) * itl
                if ttft or itl:
                    if due > time.perf_counter():
                        assert st.ticker is not None       # serve() starts it whenever a latency is set
                        await st.ticker.wait_until(due)
                elif chunks % 16 == 15:
                    await asyncio.sleep(0)        # zero latency: let other streams interleave
                if not self._writable.is_set():
                    await self._writable.wait()
                if t.is_closing():
                    return
                if ttft or itl:
                    late = time.perf_counter() - due
                    st.late_sum += late
                    st.late_n += 1
                    st.late_max = max(st.late_max, late)
                    if sent == 0:
                        st.first_late_sum += late
                        st.first_late_n += 1
                sent += k
                chunks += 1
                st.generation_tokens += k
                t.write(st.token_frame(kind, k, sent >= max_tokens, (prompt, sent) if cont else None))
            if usage_on:
                usage = {"prompt_tokens": prompt, "total_tokens": prompt + sent,
                         "completion_tokens": sent}
                t.write(_frame(json.dumps({"id": "chatcmpl-mock", "object": "chat.completion.chunk",
                                           "created": 0, "model": cfg.model, "choices": [],
                                           "usage": usage}).encode()))
            t.write(DONE + LAST_CHUNK)
            st.success += 1
        finally:
            st.running -= 1

    def _metrics(self) -> str:
        st = self.state
        lbl = f'{{engine="0",model_name="{st.cfg.model}"}}'
        return "".join([
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n",
            "# TYPE vllm:num_requests_running gauge\n",
            f"vllm:num_requests_running{lbl} {float(st.running)}\n",
            "# TYPE vllm:num_requests_waiting gauge\n",
            f"vllm:num_requests_waiting{lbl} 0.0\n",
            "# TYPE vllm:kv_cache_usage_perc gauge\n",
            f"vllm:kv_cache_usage_perc{lbl} {min(1.0, st.running / 256)}\n",
            "# TYPE vllm:num_preemptions_total counter\n",
            f"vllm:num_preemptions_total{lbl} 0.0\n",
            "# TYPE vllm:prompt_tokens_total counter\n",
            f"vllm:prompt_tokens_total{lbl} {float(st.prompt_tokens)}\n",
            "# TYPE vllm:generation_tokens_total counter\n",
            f"vllm:generation_tokens_total{lbl} {float(st.generation_tokens)}\n",
            "# HELP mock:write_lateness_seconds How late the mock wrote tokens.\n",
            "# TYPE mock:write_lateness_seconds summary\n",
            f"mock:write_lateness_seconds_sum {st.late_sum}\n",
            f"mock:write_lateness_seconds_count {st.late_n}\n",
            "# TYPE mock:write_lateness_seconds_max gauge\n",
            f"mock:write_lateness_seconds_max {st.late_max}\n",
            "# TYPE mock:first_token_lateness_seconds summary\n",
            f"mock:first_token_lateness_seconds_sum {st.first_late_sum}\n",
            f"mock:first_token_lateness_seconds_count {st.first_late_n}\n",
            "# TYPE vllm:request_success_total counter\n",
            f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{st.cfg.model}"}} '
            f"{float(st.success)}\n",
        ])


async def serve(cfg: MockConfig, host: str = "127.0.0.1", port: int = 0, ready=None):
    loop = asyncio.get_running_loop()
    state = _State(cfg)
    if cfg.ttft_ms or cfg.itl_ms or cfg.slow_every:
        state.ticker = _Ticker(loop)
        sys.setswitchinterval(0.0005)    # the ticker thread must get the GIL promptly
    server = await loop.create_server(lambda: MockProtocol(state), host, port, backlog=4096)
    bound = server.sockets[0].getsockname()[1]
    if ready is not None:
        ready(bound)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.sim.mockserver", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--cpu", type=int, default=None, help="pin the server to this CPU core")
    for f, default in MockConfig.__dataclass_fields__.items():
        kind = type(default.default)
        if kind is bool:
            ap.add_argument(f"--{f.replace('_', '-')}", type=lambda s: s.lower() in ("1", "true", "yes"),
                            default=default.default)
        else:
            ap.add_argument(f"--{f.replace('_', '-')}", type=kind, default=default.default)
    a = ap.parse_args(argv)
    if a.cpu is not None:
        os.sched_setaffinity(0, {a.cpu})
    cfg = MockConfig(**{f: getattr(a, f) for f in MockConfig.__dataclass_fields__})

    def ready(port):
        print(f"MOCK_PORT={port}", flush=True)

    try:
        asyncio.run(serve(cfg, a.host, a.port, ready))
    except KeyboardInterrupt:
        pass


def start_process(cpu: int | None = None, timeout: float = 10.0, **cfg) -> tuple[object, int]:
    """Start the mock server in a child process; returns (Popen, port). The caller terminates it."""
    import subprocess

    argv = [sys.executable, "-m", "orchestrator.sim.mockserver", "--port", "0"]
    if cpu is not None:
        argv += ["--cpu", str(cpu)]
    for k, v in cfg.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("MOCK_PORT="):
        proc.kill()
        raise RuntimeError(f"mock server did not start: {line!r}")
    return proc, int(line.strip().split("=")[1])


if __name__ == "__main__":
    main()
