"""A short throughput measurement after the smoke test: is the service as fast as its manifest says?

Seconds, not minutes: one stream of `max_tokens` tokens (vLLM's `ignore_eos`, so exactly that
many), and optionally `concurrency` such streams at once. Through the host like every probe
(probe/api.py on the one HTTP client), so it works over SSH to a server bound to 127.0.0.1; the
concurrent streams run on threads, one connection each (a few dozen streams at tens of tokens/s
are far below what blocking reads keep up with; bench's asyncio client is for hundreds).

Figures, as bench defines them (docs/benchmarking.md):
  single stream    decode rate of one request: (completion_tokens - 1) / (last token - first token),
                   bench's tok_s_user
  concurrency      aggregate output throughput: all completion tokens / (last token of any request -
                   the moment the requests were sent); includes their prefill, like a burst of users
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from orchestrator.probe.api import Endpoint, Streamed, stream_chat

# A prompt any model answers at length; with ignore_eos the answer's length is max_tokens anyway.
PROMPT = "Write a long, detailed story about a lighthouse keeper and the ships she guides home."


@dataclass
class Measured:
    single_stream_tok_s: float | None = None
    concurrency: int | None = None
    concurrency_tok_s: float | None = None
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)     # requests that gave no usable figure

    def as_dict(self) -> dict:
        return {"single_stream_tok_s": _round(self.single_stream_tok_s), "concurrency": self.concurrency,
                "concurrency_tok_s": _round(self.concurrency_tok_s), "seconds": round(self.seconds, 2),
                "problems": list(self.problems)}

    def summary(self) -> str:
        parts = []
        if self.single_stream_tok_s is not None:
            parts.append(f"{self.single_stream_tok_s:.1f} tok/s single stream")
        if self.concurrency_tok_s is not None:
            parts.append(f"{self.concurrency_tok_s:.0f} tok/s at {self.concurrency} streams")
        return ", ".join(parts) or "no figure"


def _round(v: float | None) -> float | None:
    return round(v, 1) if v is not None else None


def _body(served_name: str, max_tokens: int) -> dict:
    return {"model": served_name, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}


def measure(ep: Endpoint, served_name: str, *, max_tokens: int, single: bool, concurrency: int | None,
            timeout: float) -> Measured:
    """The figures the manifest expects: `single` stream rate, and the aggregate at `concurrency`."""
    t_start = time.perf_counter()
    out = Measured(concurrency=concurrency)
    body = _body(served_name, max_tokens)
    if single:
        st = stream_chat(ep, body, timeout)
        out.single_stream_tok_s = st.decode_rate
        if st.decode_rate is None:
            out.problems.append(f"single stream: {st.problem or 'no usage or fewer than 2 tokens'}")
    if concurrency:
        results: list[Streamed | None] = [None] * concurrency
        sent = time.perf_counter()

        def one(i: int) -> None:
            results[i] = stream_chat(ep, body, timeout)

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 5)
        good = [r for r in results if r is not None and r.problem is None and r.tokens and r.last]
        bad = [r for r in results if r is None or r not in good]
        if bad:
            out.problems.append(f"{len(bad)} of {concurrency} concurrent streams failed"
                                + (f": {bad[0].problem}" if bad[0] is not None and bad[0].problem else ""))
        if good and not bad:
            last = max(r.last for r in good if r.last is not None)
            out.concurrency_tok_s = sum(r.tokens or 0 for r in good) / max(last - sent, 1e-9)
    out.seconds = time.perf_counter() - t_start
    return out
