"""The vLLM endpoint as vllm-orch probes it, through the host: health, served models, /metrics,
the smoke test and the garbage detector, all over the one HTTP client (orchestrator/host/http.py).

An `Endpoint` is (host, port, API key): host.connect_tcp reaches the server on the host's loopback
(an SSH direct-tcpip channel for a remote host), so probes work when vLLM listens on 127.0.0.1
only. An Endpoint with a key is made only by probe/keyed.endpoint (the listener proven the
service's own) and sends the key only under vLLM's guarded prefixes (GUARDED: vLLM answers 401 there
without it); /health, /metrics and /version are open and get no key
(vllm/entrypoints/serve/middleware/authenticate.py).

Readiness is graded: port accepting -> /health 200 -> /v1/models lists the served name -> a real
streamed chat completion whose answer passes the manifest's check and is not garbage.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from orchestrator.host import http
from orchestrator.host.base import Host
from orchestrator.probe import metrics
from orchestrator.secret import Secret

HttpError = http.HttpError      # what every probe raises when there is no usable HTTP answer
HttpTimeout = http.HttpTimeout  # no answer within the time given
GUARDED = ("/v1", "/v2", "/inference", "/cohere")   # vLLM 0.33's GUARDED_PREFIX: the only paths given the key


class Unauthorized(http.HttpError):
    """HTTP 401: the server wants an API key and got none, or a wrong one."""


@dataclass(frozen=True)
class Endpoint:
    """A vLLM server as seen from its host: loopback `address`:`port`, and the key it wants
    (a Secret: str() is ***, so an Endpoint can be printed), sent only to GUARDED paths. Build one
    with a key through probe/keyed.endpoint, which proves the listener first."""

    host: Host
    port: int
    api_key: Secret | None = None
    address: str = "127.0.0.1"

    def key_for(self, path: str) -> Secret | None:
        """The key for a request to `path`: none outside vLLM's guarded prefixes."""
        return self.api_key if path.startswith(GUARDED) else None

    def request(self, method: str, path: str, *, json: Any = None, timeout: float = 5.0) -> http.Response:
        return http.request(self.host, self.port, method, path, json=json, api_key=self.key_for(path),
                            timeout=timeout, address=self.address)

    def stream(self, method: str, path: str, *, json: Any = None, timeout: float = 5.0):
        return http.stream(self.host, self.port, method, path, json=json, api_key=self.key_for(path),
                           timeout=timeout, address=self.address)


def port_open(ep: Endpoint, timeout: float = 2.0) -> bool:
    """Something accepts TCP connections on the port (vLLM listens only once it is loaded)."""
    try:
        sock = ep.host.connect_tcp(ep.port, ep.address, timeout=timeout)
    except OSError:
        return False
    try:
        sock.close()
    except Exception:   # closing a just-opened channel may fail in any way; it was open
        pass
    return True


def health(ep: Endpoint, path: str = "/health", timeout: float = 5.0) -> int | None:
    """HTTP status of the health path, None when nothing answers."""
    try:
        return ep.request("GET", path, timeout=timeout).status
    except http.HttpError:
        return None


def model_ids(payload: Any) -> list[str]:
    """The served names in a /v1/models answer (`{"data": [{"id": ...}, ...]}`); [] if it has
    none. Shared with bench, which fetches the list with its own client."""
    data = payload.get("data") if isinstance(payload, dict) else None
    return [str(card["id"]) for card in data or [] if isinstance(card, dict) and "id" in card]


def served_models(ep: Endpoint, timeout: float = 5.0) -> list[str]:
    """The served model names; Unauthorized on 401, HttpError on any other failure."""
    r = ep.request("GET", "/v1/models", timeout=timeout)
    if r.status == 401:
        raise Unauthorized(f"/v1/models answered HTTP 401: the server wants an API key and "
                           f"{'got a wrong one' if ep.api_key else 'got none'}")
    if r.status != 200:
        raise http.BadResponse(f"/v1/models answered HTTP {r.status}: {r.text()[:200]}")
    return model_ids(r.json())


def fetch_metrics(ep: Endpoint, timeout: float = 5.0) -> dict[str, float | None]:
    """/metrics aggregated across vLLM's engines (see probe/metrics.py for how: KV usage is the
    per-engine mean and max, requests and counters are sums). HttpError or MetricsError."""
    r = ep.request("GET", "/metrics", timeout=timeout)
    if r.status != 200:
        raise http.BadResponse(f"/metrics answered HTTP {r.status}")
    return metrics.snapshot(r.text())


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
_WORDLIKE = re.compile(r"[\"'(]*([A-Za-z]+(['-][A-Za-z]+)*|\d+([.,:]\d+)*%?)[\"').,;:!?]*")


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
        wordlike = sum(1 for t in tokens if _WORDLIKE.fullmatch(t))
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


@dataclass
class Streamed:
    """One streamed chat completion as it arrived: what was said, the usage, and when the first and
    last token-bearing chunks came (perf_counter seconds; arrival times from the HTTP client)."""

    t0: float                                   # when the request was sent
    end: float
    content: str = ""
    reasoning: str = ""
    usage: dict | None = None
    first: float | None = None
    last: float | None = None
    problem: str | None = None                  # no usable stream: HTTP status, error event, timeout

    @property
    def tokens(self) -> int | None:
        return (self.usage or {}).get("completion_tokens")

    @property
    def decode_rate(self) -> float | None:
        """Tokens after the first / time from the first to the last token: bench's tok_s_user."""
        n = self.tokens
        if n and n > 1 and self.first is not None and self.last is not None and self.last > self.first:
            return (n - 1) / (self.last - self.first)
        return None


def stream_chat(ep: Endpoint, body: dict, timeout: float) -> Streamed:
    """POST a streamed chat completion (`stream_options.include_usage` added) and read it to the
    end. `timeout` bounds the connect and each wait for the next bytes of the stream."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    out = Streamed(t0=time.perf_counter(), end=0.0)
    content: list[str] = []
    reasoning: list[str] = []

    def done(problem: str | None = None, at: float | None = None) -> Streamed:
        out.content, out.reasoning = "".join(content), "".join(reasoning)
        out.problem, out.end = problem, at or time.perf_counter()
        return out

    try:
        with ep.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as s:
            if s.status != 200:
                return done(f"HTTP {s.status}: {s.read()[:300].decode('utf-8', 'replace')}")
            for when, line in s.lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return done(f"stream error: {event['error']}", when)
                if event.get("usage"):
                    out.usage = event["usage"]
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    piece_c = delta.get("content") or ""
                    piece_r = delta.get("reasoning_content") or delta.get("reasoning") or ""
                    if piece_c or piece_r:
                        out.first = out.first if out.first is not None else when
                        out.last = when
                    content.append(piece_c)
                    reasoning.append(piece_r)
    except (http.HttpError, ValueError, AttributeError, TypeError) as exc:  # refused, reset, timeout, bad JSON
        return done(f"{type(exc).__name__}: {exc}")
    return done()


def smoke_test(ep: Endpoint, served_name: str, prompt: str, expect: str, max_tokens: int,
               timeout: float) -> SmokeResult:
    """A real streamed chat completion; rate = (completion_tokens - 1) / (last - first token).
    `timeout` bounds the connect and each wait for the next bytes of the stream."""
    body = {"model": served_name, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0}
    st = stream_chat(ep, body, timeout)
    if st.problem is not None:
        return SmokeResult(False, st.content, 0, None, None, st.end - st.t0, None, st.problem)
    answer = st.content
    result = SmokeResult(True, answer, len(st.reasoning), st.tokens,
                         st.first - st.t0 if st.first is not None else None, st.end - st.t0, st.decode_rate)
    garbage = looks_like_garbage(answer)
    if garbage:
        result.ok, result.problem = False, f"the answer is garbage ({garbage}): {answer[:80]!r}"
    elif not re.search(expect, answer, re.I):
        result.ok, result.problem = False, f"the answer {answer.strip()[:80]!r} does not match {expect!r}"
    elif st.usage is None:
        result.ok, result.problem = False, "the stream carried no usage (stream_options.include_usage ignored)"
    return result


# -- sleep mode (vLLM 0.33: entrypoints/serve/dev/sleep/api_router.py; VLLM_SERVER_DEV_MODE=1) -----
# Outside the API key's guarded prefixes: sent without it.
CANARY_PROMPT = "The quick brown fox jumps over the lazy dog. Repeat the sentence once more:"
CANARY_TOKENS = 16


def _dev(ep: Endpoint) -> Endpoint:
    return Endpoint(ep.host, ep.port, None, ep.address)


def sleep(ep: Endpoint, level: int, mode: str = "wait", timeout: float = 600.0) -> dict:
    """POST /sleep?level=N&mode=M: {"status": "sleeping", "level": N} once the engine sleeps.
    vLLM's default mode is "abort" (the requests in flight end at once, finish_reason abort);
    "wait" lets them finish first while new ones queue (vllm/v1/engine/core.py pause_scheduler).
    HttpTimeout when it has not answered within `timeout` (the engine goes on with it)."""
    path = f"/sleep?level={int(level)}&mode={mode}"
    r = _dev(ep).request("POST", path, timeout=timeout)
    if r.status != 200:
        raise http.HttpError(f"POST {path}: HTTP {r.status} {r.body[:200]!r}")
    return r.json()


def aborted_requests(ep: Endpoint, timeout: float = 5.0) -> float | None:
    """How many requests have ended aborted so far (metrics.aborted), None when unreadable."""
    try:
        r = ep.request("GET", "/metrics", timeout=timeout)
        return metrics.aborted(r.text()) if r.status == 200 else None
    except (http.HttpError, metrics.MetricsError):
        return None


def wake_up(ep: Endpoint, tags: tuple[str, ...] = (), timeout: float = 600.0) -> bool:
    """POST /wake_up?tags=T&...: map the named tags back (none named: every tag asleep). True when
    the engine is fully awake again (vLLM resumes scheduling only then: v1/engine/core.py wake_up),
    False after a partial wake ({"status": "sleeping"}); HTTP 500 when the remap fails."""
    path = "/wake_up" + ("?" + "&".join(f"tags={t}" for t in tags) if tags else "")
    r = _dev(ep).request("POST", path, timeout=timeout)
    if r.status != 200:
        raise http.HttpError(f"POST {path}: HTTP {r.status} {r.body[:200]!r}")
    out = r.json()
    if not isinstance(out, dict) or out.get("status") not in ("awake", "sleeping"):
        raise http.HttpError(f"POST {path}: not vLLM's answer: {out!r}")
    return out["status"] == "awake"


def reload_weights(ep: Endpoint, timeout: float) -> None:
    """POST /collective_rpc {"method": "reload_weights"}: every worker reads the checkpoint again into
    its (mapped) weights (vllm/model_executor/model_loader/reload/inplace.py); answers when all did.
    HTTP 500 when a worker failed (the engine is then dead)."""
    r = _dev(ep).request("POST", "/collective_rpc", json={"method": "reload_weights"}, timeout=timeout)
    if r.status != 200:
        raise http.HttpError(f"POST /collective_rpc reload_weights: HTTP {r.status} {r.body[:200]!r}")


def wake(ep: Endpoint, level: int | None, reload_timeout: float, on_reload=None) -> float:
    """Wake a sleeping engine as vLLM 0.33 restores each level; the seconds the weights' reload took
    (0 for level 1). Level 1 kept the weights in pinned host RAM: one /wake_up copies them back.
    Level 2 (or a level not known) kept nothing, and a wake maps the weights' memory back EMPTY
    (device_allocator/cumem.py restores only what it backed up): the weights' tag alone, then
    reload_weights from the checkpoint, then the KV cache's tag, as vLLM's own restore does
    (vllm/snapshot/server.py _restore_reloadable_state). `on_reload()` is called before the reload."""
    if level == 1:
        if not wake_up(ep):
            raise http.HttpError("POST /wake_up: the engine is not fully awake")
        return 0.0
    if wake_up(ep, ("weights",)):
        return 0.0                      # it was not asleep: nothing to read again
    if on_reload is not None:
        on_reload()
    t0 = time.monotonic()
    reload_weights(ep, reload_timeout)
    seconds = time.monotonic() - t0
    if not wake_up(ep, ("kv_cache",)):
        raise http.HttpError("POST /wake_up?tags=kv_cache: the engine is not fully awake")
    return seconds


def is_sleeping(ep: Endpoint, timeout: float = 5.0) -> bool | None:
    """GET /is_sleeping; None when the endpoint does not answer (no dev mode, not serving)."""
    try:
        r = _dev(ep).request("GET", "/is_sleeping", timeout=timeout)
    except http.HttpError:
        return None
    if r.status != 200:
        return None
    out = r.json()
    return bool(out.get("is_sleeping")) if isinstance(out, dict) else None


def canary(ep: Endpoint, served_name: str, timeout: float = 120.0) -> tuple[str, list[int] | None, float]:
    """A greedy completion of CANARY_PROMPT: (its text, its token ids, seconds). The same weights give
    the same tokens; corrupted ones (a bad wake) do not."""
    t0 = time.monotonic()
    r = ep.request("POST", "/v1/completions", json={
        "model": served_name, "prompt": CANARY_PROMPT, "max_tokens": CANARY_TOKENS, "temperature": 0,
        "seed": 0, "return_token_ids": True}, timeout=timeout)
    if r.status == 401:
        raise Unauthorized("HTTP 401 from /v1/completions: the API key is missing or wrong")
    if r.status != 200:
        raise http.HttpError(f"POST /v1/completions: HTTP {r.status} {r.body[:200]!r}")
    choice = (r.json().get("choices") or [{}])[0]
    ids = choice.get("token_ids")
    return str(choice.get("text") or ""), [int(i) for i in ids] if isinstance(ids, list) else None, \
        time.monotonic() - t0
