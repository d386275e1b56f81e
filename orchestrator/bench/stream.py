"""One streamed chat completion: what arrived when, and the per-request metrics derived from it.

The hot path is `RequestRecord.add_event`, called once per SSE event with the timestamp of the read
that completed it (taken before any parsing). It keeps only compact facts: the arrival time and the
token count of every token-bearing chunk, the first-content time, character counts and the usage
numbers. `request_metrics` turns a finished record into the per-request row (pure; see FORMULAS in
formulas.py for the definitions it implements).

Token-bearing chunk: a chunk whose delta has non-empty `content`, `reasoning_content`/`reasoning`,
or `tool_calls`, or whose per-chunk usage (vLLM `continuous_usage_stats`) grew. Role-only frames
(`{"role": "assistant", "content": ""}`), empty deltas, the usage-only chunk and `[DONE]` are not.
"""

from __future__ import annotations

import json
from array import array

NS = 1_000_000.0   # ns per ms


class RequestRecord:
    __slots__ = ("idx", "worker", "phase", "t_ready", "t_send", "t_first_byte", "t_done", "status",
                 "chunk_ts", "chunk_tok", "n_events", "t_first_content", "content_chars",
                 "reasoning_chars", "reasoning_chunk_tokens", "tool_call_chunks", "finish_reason",
                 "completion_tokens", "prompt_tokens", "reasoning_tokens", "cached_tokens",
                 "error_kind", "error_msg", "done_marker", "_cont", "_cum", "body_excerpt",
                 "max_tokens")

    def __init__(self, idx: int = 0, worker: int = 0, phase: str = "measure"):
        self.idx, self.worker, self.phase = idx, worker, phase
        self.t_ready = self.t_send = self.t_first_byte = self.t_done = 0
        self.status = 0
        self.chunk_ts = array("q")       # arrival ns of each token-bearing chunk
        self.chunk_tok = array("l")      # tokens in it (per-chunk usage delta, else 1)
        self.n_events = 0
        self.t_first_content = 0
        self.content_chars = self.reasoning_chars = 0
        self.reasoning_chunk_tokens = 0
        self.tool_call_chunks = 0
        self.finish_reason: str | None = None
        self.completion_tokens: int | None = None   # server usage: the truth
        self.prompt_tokens: int | None = None
        self.reasoning_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.error_kind: str | None = None
        self.error_msg = ""
        self.done_marker = False
        self._cont: bool | None = None   # does the server send usage on every chunk?
        self._cum = 0
        self.body_excerpt = ""
        self.max_tokens = 0              # what the request asked for (output lengths may vary)

    # -- hot path --------------------------------------------------------------------------------
    def add_event(self, ts: int, name: str | None, data: bytes) -> None:
        self.n_events += 1
        if data == b"[DONE]":
            self.done_marker = True
            return
        try:
            obj = json.loads(data)
        except ValueError:
            self.fail("stream_error", f"unparseable event: {data[:120]!r}")
            return
        if not isinstance(obj, dict):
            return
        if name == "error" or "error" in obj or obj.get("object") == "error":
            err = obj.get("error", obj)
            msg = err.get("message", err) if isinstance(err, dict) else err
            self.fail("stream_error", str(msg)[:300])
            return
        usage = obj.get("usage")
        choices = obj.get("choices")
        if not choices:
            if usage:
                self._final_usage(usage)
            return
        content = reasoning = False
        for ch in choices:
            d = ch.get("delta")
            if d:
                c = d.get("content")
                if c:
                    content = True
                    self.content_chars += len(c)
                r = d.get("reasoning_content") or d.get("reasoning")
                if r:
                    reasoning = True
                    self.reasoning_chars += len(r)
                if d.get("tool_calls"):
                    content = True
                    self.tool_call_chunks += 1
            fr = ch.get("finish_reason")
            if fr:
                self.finish_reason = fr
        has_text = content or reasoning
        if self._cont is None and (has_text or usage):
            self._cont = bool(usage)
        k = 1 if has_text else 0
        if self._cont and usage:
            ct = usage.get("completion_tokens") or 0
            k, self._cum = ct - self._cum, ct
            if usage.get("prompt_tokens") is not None:
                self.prompt_tokens = usage["prompt_tokens"]
        elif usage:
            self._final_usage(usage)
        if not has_text and k <= 0:
            return
        self.chunk_ts.append(ts)
        self.chunk_tok.append(k)
        if content and not self.t_first_content:
            self.t_first_content = ts
        if reasoning and not content:
            self.reasoning_chunk_tokens += k

    def _final_usage(self, usage: dict) -> None:
        self.completion_tokens = usage.get("completion_tokens")
        self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
        det = usage.get("completion_tokens_details") or {}
        if det.get("reasoning_tokens") is not None:
            self.reasoning_tokens = det["reasoning_tokens"]
        pdet = usage.get("prompt_tokens_details") or {}
        if pdet.get("cached_tokens") is not None:
            self.cached_tokens = pdet["cached_tokens"]

    def fail(self, kind: str, msg: str) -> None:
        if self.error_kind is None:      # the first cause wins
            self.error_kind, self.error_msg = kind, msg


DISCREPANCY_FLAG_PCT = 10.0


def output_tokens(rec: RequestRecord) -> tuple[int, str]:
    """(completion tokens, source). The server's usage is the truth; never max_tokens."""
    if rec.completion_tokens is not None:
        return rec.completion_tokens, "usage"
    if rec._cont and rec._cum:
        return rec._cum, "usage"           # per-chunk usage without the final usage chunk
    return len(rec.chunk_ts), "chunks"     # flagged: the server sent no usage at all


def request_metrics(rec: RequestRecord) -> dict:
    """The per-request row (times in ms from the request's send). Also settles error kinds."""
    ct, source = output_tokens(rec)
    n_chunks = len(rec.chunk_ts)
    if rec.error_kind is None and rec.status == 200 and (n_chunks == 0 or ct == 0):
        rec.fail("empty", "the stream carried no generated token")
    ok = rec.error_kind is None
    row: dict = {
        "idx": rec.idx, "worker": rec.worker, "phase": rec.phase, "ok": ok,
        "error_kind": rec.error_kind, "error": rec.error_msg or None, "status": rec.status,
        "t_send_ns": rec.t_send, "queue_ms": (rec.t_send - rec.t_ready) / NS,
        "ttfb_ms": (rec.t_first_byte - rec.t_send) / NS if rec.t_first_byte else None,
        "max_tokens": rec.max_tokens or None, "completion_tokens": ct, "tokens_source": source,
        "prompt_tokens": rec.prompt_tokens,
        "cached_tokens": rec.cached_tokens, "token_chunks": n_chunks, "events": rec.n_events,
        "content_chars": rec.content_chars, "reasoning_chars": rec.reasoning_chars,
        "tool_call_chunks": rec.tool_call_chunks, "finish_reason": rec.finish_reason,
        "done_marker": rec.done_marker,
    }
    if rec.reasoning_tokens is not None:
        row["reasoning_tokens"], row["reasoning_source"] = rec.reasoning_tokens, "usage"
    else:
        row["reasoning_tokens"], row["reasoning_source"] = rec.reasoning_chunk_tokens, "chunks"
    row["chunk_count_discrepancy_pct"] = (100.0 * (n_chunks - ct) / ct) if ct else None
    row["discrepancy_flag"] = bool(ct) and abs(n_chunks - ct) * 100.0 > DISCREPANCY_FLAG_PCT * ct
    if n_chunks:
        t0 = rec.t_send
        row["ttft_ms"] = (rec.chunk_ts[0] - t0) / NS
        row["ttfc_ms"] = (rec.t_first_content - t0) / NS if rec.t_first_content else None
        row["e2e_ms"] = (rec.chunk_ts[-1] - t0) / NS
        row["e2e_incl_queue_ms"] = (rec.chunk_ts[-1] - rec.t_ready) / NS
        decode = row["e2e_ms"] - row["ttft_ms"]
        row["tpot_ms"] = decode / (ct - 1) if ct > 1 else None
        row["tok_s_user"] = 1000.0 / row["tpot_ms"] if row["tpot_ms"] else None
        row["tok_s_e2e"] = ct / (row["e2e_ms"] / 1000.0) if row["e2e_ms"] > 0 else None
    else:
        for k in ("ttft_ms", "ttfc_ms", "e2e_ms", "e2e_incl_queue_ms", "tpot_ms", "tok_s_user",
                  "tok_s_e2e"):
            row[k] = None
    return row


def token_weights(rec: RequestRecord) -> list[float]:
    """Tokens carried by each token-bearing chunk, consistent with the server's total.

    With per-chunk usage these are exact. Without it every chunk counts 1 and the counts are scaled
    so they sum to usage.completion_tokens (multi-token chunks then share the total evenly).
    """
    toks = list(rec.chunk_tok)
    ct, source = output_tokens(rec)
    total = sum(toks)
    if source == "usage" and total and total != ct and not rec._cont:
        f = ct / total
        return [t * f for t in toks]
    return [float(t) for t in toks]


def gap_samples(rec: RequestRecord) -> tuple[list[float], list[float], list[float]]:
    """(ITL values, ITL weights, ICL values) in ms for one request.

    ICL: every gap between consecutive token-bearing chunks. ITL: each gap divided by the tokens of
    the chunk that ends it, weighted by those tokens (so a 3-token chunk after 30 ms is 3 x 10 ms).
    """
    ts = rec.chunk_ts
    w = token_weights(rec)
    itl, itl_w, icl = [], [], []
    for j in range(1, len(ts)):
        gap = (ts[j] - ts[j - 1]) / NS
        icl.append(gap)
        if w[j] > 0:
            itl.append(gap / w[j])
            itl_w.append(w[j])
    return itl, itl_w, icl
