"""Metric formulas on hand-made streams, fed through the real HTTP/SSE parser in awkward splits."""

from __future__ import annotations

import json

import pytest

from orchestrator.bench.stream import RequestRecord, gap_samples, request_metrics
from orchestrator.bench.wire import ResponseParser

MS = 1_000_000
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\n\r\n")


def chunk(payload) -> bytes:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    ev = b"data: " + data + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(ev), ev)


def delta(**d) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d, "finish_reason": None}]}


def usage(ct, pt=10, reasoning=None, **extra) -> dict:
    u = {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}
    if reasoning is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return {"object": "chat.completion.chunk", "choices": [], "usage": u, **extra}


def run(events: list[tuple[int, object]], t_send_ms: int = 0, split: int | None = None) -> tuple[RequestRecord, dict]:
    """events: (arrival ms, payload). Each event's bytes arrive at its time (optionally cut in pieces)."""
    rec = RequestRecord()
    rec.t_ready = rec.t_send = t_send_ms * MS
    p = ResponseParser(rec.add_event)
    p.feed(HEAD, t_send_ms * MS + 1)
    for t, payload in events:
        raw = payload if isinstance(payload, bytes) and payload.startswith(b"0\r\n") else chunk(payload)
        pieces = [raw] if split is None else [raw[i:i + split] for i in range(0, len(raw), split)]
        for piece in pieces:
            p.feed(piece, t * MS)
    p.feed(b"0\r\n\r\n", events[-1][0] * MS if events else 0)
    rec.status = p.status
    rec.t_first_byte = p.t_first_byte
    assert p.complete
    return rec, request_metrics(rec)


def test_reasoning_then_content_ttft_ttfc_tpot():
    events = [(5, delta(role="assistant", content="")),              # role-only: not a token
              (100, delta(reasoning_content="Let")), (110, delta(reasoning_content=" me")),
              (120, delta(content="Hi")), (130, delta(content="!")),
              (131, {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
              (135, usage(4)), (136, b"[DONE]")]
    rec, m = run(events, split=7)
    assert m["ok"] and m["ttft_ms"] == 100 and m["ttfc_ms"] == 120 and m["e2e_ms"] == 130
    assert m["completion_tokens"] == 4 and m["tokens_source"] == "usage"
    assert m["tpot_ms"] == pytest.approx(10.0)             # (130 - 100) / (4 - 1)
    assert m["reasoning_tokens"] == 2 and m["reasoning_source"] == "chunks"
    assert m["finish_reason"] == "stop" and m["done_marker"] and m["token_chunks"] == 4
    assert m["ttfb_ms"] == pytest.approx(1e-6)


def test_usage_reasoning_tokens_are_not_added_on_top():
    events = [(50, delta(reasoning_content="a")), (60, delta(content="b")), (61, usage(2, reasoning=1))]
    _, m = run(events)
    assert m["completion_tokens"] == 2 and m["reasoning_tokens"] == 1 and m["reasoning_source"] == "usage"


def test_tool_calls_count_as_tokens():
    tc = [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get", "arguments": ""}}]
    events = [(40, delta(role="assistant", content=None, tool_calls=tc)),
              (50, delta(tool_calls=[{"index": 0, "function": {"arguments": "{\"a\":1}"}}])), (52, usage(2))]
    _, m = run(events)
    assert m["ttft_ms"] == 40 and m["ttfc_ms"] == 40 and m["tool_call_chunks"] == 2 and m["ok"]


def test_empty_chunks_do_not_move_ttft_or_e2e():
    events = [(10, delta(content="")), (20, delta()), (30, delta(content="x")), (40, delta(content="")),
              (50, delta(content="y")), (60, delta(content="")), (61, usage(2))]
    _, m = run(events)
    assert (m["ttft_ms"], m["e2e_ms"], m["token_chunks"]) == (30, 50, 2)


def test_empty_answer_is_an_error():
    _, m = run([(10, delta(role="assistant", content="")), (11, usage(0))])
    assert not m["ok"] and m["error_kind"] == "empty" and m["ttft_ms"] is None


def test_error_event_mid_stream_fails_the_request():
    events = [(10, delta(content="a")), (20, {"error": {"message": "boom", "type": "InternalServerError"}}),
              (21, b"[DONE]")]
    _, m = run(events)
    assert not m["ok"] and m["error_kind"] == "stream_error" and "boom" in m["error"]


def test_named_error_event_with_comment_lines():
    rec = RequestRecord()
    p = ResponseParser(rec.add_event)
    p.feed(HEAD, 1)
    body = b": ping\n\nevent: error\ndata: {\"message\": \"overloaded\"}\n\n"
    p.feed(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body), 2)
    assert p.complete and rec.error_kind == "stream_error" and rec.n_events == 1


def test_connection_drop_keeps_partial_record_incomplete():
    rec = RequestRecord()
    p = ResponseParser(rec.add_event)
    p.feed(HEAD + chunk(delta(content="a"))[:-9], 5)          # cut mid-event
    p.eof(6)
    assert not p.complete and len(rec.chunk_ts) == 0 and not p.keep_alive


def test_no_usage_counts_chunks_and_says_so():
    events = [(10, delta(content="a")), (20, delta(content="b")), (30, delta(content="c"))]
    _, m = run(events)
    assert m["completion_tokens"] == 3 and m["tokens_source"] == "chunks"


def test_multi_token_chunks_with_continuous_usage_give_token_itl():
    def cu(text, ct):
        d = delta(content=text)
        d["usage"] = {"prompt_tokens": 5, "completion_tokens": ct, "total_tokens": 5 + ct}
        return d
    role = delta(role="assistant", content="")
    role["usage"] = {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    events = [(0, role), (100, cu("ab", 2)), (130, cu("cde", 5)), (150, cu("f", 6)), (151, usage(6, pt=5))]
    rec, m = run(events, split=3)
    assert list(rec.chunk_tok) == [2, 3, 1]
    assert m["completion_tokens"] == 6 and m["token_chunks"] == 3
    assert m["tpot_ms"] == pytest.approx(50 / 5)
    assert m["discrepancy_flag"] and m["chunk_count_discrepancy_pct"] == pytest.approx(-50.0)
    itl, w, icl = gap_samples(rec)
    assert icl == [30.0, 20.0]                    # raw chunk gaps
    assert itl == [10.0, 20.0] and w == [3.0, 1.0]  # per token: 30 ms / 3 tokens, 20 ms / 1


def test_multi_token_chunks_without_per_chunk_usage_are_scaled_to_usage():
    events = [(10, delta(content="ab")), (30, delta(content="cd")), (31, usage(4))]
    rec, m = run(events)
    assert m["completion_tokens"] == 4 and m["discrepancy_flag"]
    itl, w, _ = gap_samples(rec)
    assert w == [2.0] and itl == [10.0]


def test_http_error_body_is_kept_not_parsed_as_sse():
    p = ResponseParser(lambda *a: pytest.fail("no events expected"))
    body = b'{"object":"error","message":"The model `x` does not exist."}'
    p.feed(b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body), 1)
    p.feed(body[:10], 2)
    assert not p.complete
    p.feed(body[10:], 3)
    assert p.complete and p.status == 404 and bytes(p.body) == body and p.keep_alive


def test_crlf_framing_multiline_data_and_chunk_size_split_across_reads():
    got = []
    p = ResponseParser(lambda ts, name, data: got.append((ts, name, data)))
    body = b"data: {\"a\":\r\ndata: 1}\r\n\r\nevent: x\r\ndata: [DONE]\r\n\r\n"
    raw = HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    for i, b in enumerate(raw):
        p.feed(bytes([b]), i)
    assert p.complete
    assert [(n, d) for _, n, d in got] == [(None, b'{"a":\n1}'), ("x", b"[DONE]")]


def test_timestamp_is_the_read_that_completed_the_event():
    rec = RequestRecord()
    p = ResponseParser(rec.add_event)
    p.feed(HEAD, 1)
    raw = chunk(delta(content="a"))
    p.feed(raw[:20], 7 * MS)
    p.feed(raw[20:], 9 * MS)
    assert list(rec.chunk_ts) == [9 * MS]
