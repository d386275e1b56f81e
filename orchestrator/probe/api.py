"""Talking HTTP to the vLLM server *through the host*: host.connect_tcp gives a socket on the host's
loopback (a direct-tcpip channel over SSH), so probes work when vLLM listens on 127.0.0.1 only.

Readiness is graded: port accepting -> /health 200 -> /v1/models lists the served name -> a real
streamed chat completion whose answer passes the manifest's check and is not garbage.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from dataclasses import dataclass, field

from orchestrator.host.base import Host


class Refused(Exception):
    """Nothing listens on the port yet (vLLM binds early but listens only when loaded)."""


@dataclass
class HttpResponse:
    status: int
    body: bytes
    headers: dict


class _HostConnection(http.client.HTTPConnection):
    def __init__(self, host: Host, port: int, timeout: float):
        super().__init__("127.0.0.1", port, timeout=timeout)
        self._host = host

    def connect(self):
        try:
            self.sock = self._host.connect_tcp(self.port, "127.0.0.1", timeout=self.timeout)
        except ConnectionRefusedError as exc:
            raise Refused(str(exc)) from None
        except OSError as exc:
            raise Refused(str(exc)) from None
        except Exception as exc:  # paramiko ChannelException: "Connect failed"
            if type(exc).__name__ in ("ChannelException", "SSHException"):
                raise Refused(str(exc)) from None
            raise
        try:
            self.sock.settimeout(self.timeout)
        except Exception:
            pass


def request(host: Host, port: int, method: str, path: str, body: dict | None = None,
            timeout: float = 5.0, headers: dict | None = None) -> HttpResponse:
    conn = _HostConnection(host, port, timeout)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        hdrs = {"Content-Type": "application/json"} if payload else {}
        hdrs.update(headers or {})
        conn.request(method, path, body=payload, headers=hdrs)
        resp = conn.getresponse()
        return HttpResponse(resp.status, resp.read(), dict(resp.getheaders()))
    finally:
        conn.close()


def port_open(host: Host, port: int, timeout: float = 2.0) -> bool:
    try:
        sock = host.connect_tcp(port, "127.0.0.1", timeout=timeout)
    except Exception:
        return False
    try:
        sock.close()
    except Exception:
        pass
    return True


def health(host: Host, port: int, path: str = "/health", timeout: float = 5.0) -> int | None:
    """HTTP status of the health path, None when nothing answers."""
    try:
        return request(host, port, "GET", path, timeout=timeout).status
    except (Refused, OSError, http.client.HTTPException):
        return None


def served_models(host: Host, port: int, timeout: float = 5.0) -> list[dict]:
    r = request(host, port, "GET", "/v1/models", timeout=timeout)
    if r.status != 200:
        raise RuntimeError(f"/v1/models answered HTTP {r.status}")
    return json.loads(r.body).get("data", [])


def metrics(host: Host, port: int, timeout: float = 5.0) -> dict[str, float]:
    """Prometheus samples of /metrics summed over labels: {'vllm:num_requests_running': 0.0, ...}."""
    r = request(host, port, "GET", "/metrics", timeout=timeout)
    out: dict[str, float] = {}
    for line in r.body.decode(errors="replace").splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m:
            try:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                pass
    return out


@dataclass
class SmokeResult:
    ok: bool
    answer: str
    reasoning_chars: int
    completion_tokens: int | None
    ttft_s: float | None
    seconds: float
    tokens_per_s: float | None
    problem: str | None = None
    extra: dict = field(default_factory=dict)

    def summary(self) -> str:
        rate = f", {self.tokens_per_s:.1f} tok/s" if self.tokens_per_s else ""
        ttft = f", TTFT {self.ttft_s * 1000:.0f} ms" if self.ttft_s is not None else ""
        toks = f"{self.completion_tokens} tokens" if self.completion_tokens is not None else "? tokens"
        return f"answer {self.answer.strip()[:60]!r} ({toks}{ttft}{rate})"


_WORD = re.compile(r"[A-Za-z]+")


def looks_like_garbage(text: str) -> str | None:
    """A reason when text is not language: junk characters, vowel-less words, or a repeated loop."""
    stripped = text.strip()
    if not stripped:
        return "empty answer"
    printable = sum(ch.isprintable() or ch.isspace() for ch in stripped) / len(stripped)
    if printable < 0.95:
        return "non-printable characters"
    odd = sum(not (ch.isalnum() or ch.isspace() or ch in ".,;:!?'\"()-*/+=%$#@&[]{}<>_`") for ch in stripped)
    if len(stripped) >= 8 and odd / len(stripped) > 0.3:
        return "mostly symbols"
    tokens = stripped.split()
    if len(tokens) >= 5:
        wordlike = sum(1 for t in tokens if re.fullmatch(r"[\"'(]*([A-Za-z]+(['-][A-Za-z]+)*|\d+([.,:]\d+)*%?)[\"').,;:!?]*", t))
        if wordlike / len(tokens) < 0.5:
            return "tokens that are neither words nor numbers"
    words = _WORD.findall(stripped)
    if len(words) >= 4:
        vowelless = sum(1 for w in words if len(w) > 3 and not re.search(r"[aeiouyAEIOUY]", w))
        if vowelless / len(words) > 0.4:
            return "words without vowels"
    if len(words) >= 12:
        grams = [" ".join(words[i:i + 3]) for i in range(len(words) - 2)]
        if len(set(grams)) / len(grams) < 0.3:
            return "a repeated loop"
    return None


def stream_lines(host: Host, port: int, path: str, body: dict, headers: dict, timeout: float):
    """POST and yield (arrival time, line) of the response body as bytes arrive.

    A minimal HTTP/1.1 client on host.connect_tcp (only sendall/recv, so a paramiko channel works
    as well as a socket): Connection: close, chunked or plain bodies. Yields ("status", code) first.
    """
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nConnection: close\r\nContent-Length: {len(payload)}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()
    try:
        sock = host.connect_tcp(port, "127.0.0.1", timeout=timeout)
    except Exception as exc:
        raise Refused(str(exc)) from None
    try:
        sock.settimeout(timeout)
        sock.sendall(head + payload)
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("connection closed before the response headers")
            buf += data
        header_blob, buf = buf.split(b"\r\n\r\n", 1)
        lines = header_blob.decode(errors="replace").split("\r\n")
        yield "status", int(lines[0].split()[1])
        chunked = any(l.lower().replace(" ", "") == "transfer-encoding:chunked" for l in lines[1:])
        body_buf, raw, eof = b"", buf, False
        while True:
            if chunked:
                while True:                       # move every complete chunk from raw to body_buf
                    if b"\r\n" not in raw:
                        break
                    size_line, rest = raw.split(b"\r\n", 1)
                    size = int(size_line.split(b";")[0] or b"0", 16)
                    if size == 0:
                        eof = True
                        break
                    if len(rest) < size + 2:
                        break
                    body_buf += rest[:size]
                    raw = rest[size + 2:]
            else:
                body_buf, raw = body_buf + raw, b""
            now = time.perf_counter()
            while b"\n" in body_buf:
                line, body_buf = body_buf.split(b"\n", 1)
                yield now, line.decode(errors="replace").rstrip("\r")
            if eof:
                return
            data = sock.recv(65536)
            if not data:
                if body_buf:
                    yield time.perf_counter(), body_buf.decode(errors="replace")
                return
            raw += data
    finally:
        try:
            sock.close()
        except Exception:
            pass


def smoke_test(host: Host, port: int, served_name: str, prompt: str, expect: str, max_tokens: int,
               timeout: float, api_key: str | None = None) -> SmokeResult:
    """A real streamed chat completion; rate = (completion_tokens - 1) / (last - first token)."""
    body = {"model": served_name, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.perf_counter()
    first = last = None
    content, reasoning, usage = [], [], None
    status = None
    try:
        for when, line in stream_lines(host, port, "/v1/chat/completions", body, headers, timeout):
            if when == "status":
                status = line
                continue
            if status != 200:
                return SmokeResult(False, "", 0, None, None, time.perf_counter() - t0, None,
                                   f"HTTP {status}: {line[:300]}")
            line = line.strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                return SmokeResult(False, "".join(content), 0, None, None, when - t0, None,
                                   f"stream error: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                piece_c = delta.get("content") or ""
                piece_r = delta.get("reasoning_content") or delta.get("reasoning") or ""
                if piece_c or piece_r:
                    first = first if first is not None else when
                    last = when
                content.append(piece_c)
                reasoning.append(piece_r)
        if status is not None and status != 200:
            return SmokeResult(False, "", 0, None, None, time.perf_counter() - t0, None, f"HTTP {status}")
    except Exception as exc:  # refused, reset, timeout, bad JSON: all mean "not serving"
        return SmokeResult(False, "".join(content), 0, None, None, time.perf_counter() - t0, None,
                           f"{type(exc).__name__}: {exc}")
    answer = "".join(content)
    tokens = (usage or {}).get("completion_tokens")
    rate = None
    if tokens and tokens > 1 and first is not None and last is not None and last > first:
        rate = (tokens - 1) / (last - first)
    result = SmokeResult(True, answer, len("".join(reasoning)), tokens,
                         first - t0 if first is not None else None, time.perf_counter() - t0, rate)
    garbage = looks_like_garbage(answer)
    if garbage:
        result.ok, result.problem = False, f"the answer is garbage ({garbage}): {answer[:80]!r}"
    elif not re.search(expect, answer, re.I):
        result.ok, result.problem = False, f"the answer {answer.strip()[:80]!r} does not match {expect!r}"
    elif usage is None:
        result.ok, result.problem = False, "the stream carried no usage (stream_options.include_usage ignored)"
    return result
