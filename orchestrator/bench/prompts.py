"""Request bodies: varied built-in prompts with input-length control, pre-serialised once.

Every request gets a unique numeric prefix so the server's prefix cache cannot serve a repeated
prompt (that would flatter TTFT). Length is controlled approximately (about 4 characters per token,
no tokenizer needed here); the server's usage.prompt_tokens records the real count per request.
Bodies are built from a byte template in which only the 8-digit nonce changes, so producing the next
request costs one bytes.replace on the hot path.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from orchestrator.bench.client import Endpoint, build_post
from orchestrator.bench.options import BenchOptions

TASKS = [
    "Explain how a {a} works to a new engineer, step by step.",
    "Write a short story about a {a} that learns about {b}.",
    "Compare {a} and {b}: list the trade-offs in a table.",
    "Summarise the following notes about {a} and suggest next steps.",
    "Write Python code that simulates a {a} and tests it against {b}.",
    "What are the failure modes of a {a}, and how would you detect them with {b}?",
    "Draft an email to a customer explaining a delay caused by {a}.",
    "Translate the key ideas of {a} into plain language for a child.",
    "Design a benchmark for {a}; say what you would measure and why.",
    "Give a critical review of a proposal to replace {b} with {a}.",
    "Plan a one-week course on {a} with exercises about {b}.",
    "Debug this situation: the {a} is slow only when {b} is enabled.",
]
TOPICS = ["distributed cache", "garbage collector", "GPU scheduler", "tokenizer", "load balancer",
          "compiler pass", "key-value store", "rate limiter", "mixture-of-experts router",
          "speculative decoder", "network switch", "file system journal", "vector database",
          "TCP congestion control", "solar inverter", "hospital triage queue", "chess engine",
          "weather model", "payment ledger", "video encoder"]
WORDS = ("the system records each event with a timestamp and a counter so that operators can see "
         "latency throughput queue depth memory pressure retries errors and the order in which "
         "requests arrived while the cluster rebalanced shards across racks during maintenance").split()


def builtin_prompts(n: int, input_tokens: int, seed: int) -> list[str]:
    """n varied prompts of roughly input_tokens tokens each (deterministic for a seed)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        task = rng.choice(TASKS).format(a=rng.choice(TOPICS), b=rng.choice(TOPICS))
        words = [task, "Notes:"]
        chars = len(task)
        while chars < input_tokens * 4:
            w = rng.choice(WORDS)
            words.append(w)
            chars += len(w) + 1
        out.append(" ".join(words))
    return out


def load_prompts(opts: BenchOptions) -> list[str]:
    if opts.prompts_file:
        lines = [ln.strip() for ln in Path(opts.prompts_file).read_text().splitlines()]
        prompts = [ln for ln in lines if ln]
        if not prompts:
            raise ValueError(f"{opts.prompts_file}: no prompts")
        return prompts
    return builtin_prompts(64, opts.input_tokens, opts.seed)


NONCE = b"@@NONCE0"   # 8 bytes, replaced by an 8-digit request number


def request_payload(model: str, prompt: str, opts: BenchOptions) -> dict:
    body: dict = {
        "model": model,
        "messages": [{"role": "user", "content": f"{NONCE.decode()} {prompt}"}],
        "max_tokens": opts.max_tokens,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.continuous_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.min_tokens is not None:
        body["min_tokens"] = opts.min_tokens
    body.update(opts.extra_body)
    return body


class RequestFactory:
    """Request bytes for request number i (cycles through the prompts; unique nonce each)."""

    def __init__(self, ep: Endpoint, model: str, opts: BenchOptions):
        self.templates = [build_post(ep, ep.chat_path,
                                     json.dumps(request_payload(model, p, opts)).encode(), opts.api_key)
                          for p in load_prompts(opts)]

    def __call__(self, i: int) -> bytes:
        t = self.templates[i % len(self.templates)]
        return t.replace(NONCE, b"%08d" % (i % 100_000_000), 1)
