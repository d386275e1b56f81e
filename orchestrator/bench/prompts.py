"""Prompts and request bodies: built-in varied prompts or a prompt file, pre-serialised once.

Every request gets a unique numeric prefix (an 8-digit nonce) so the server's prefix cache cannot
serve a repeated prompt (that would flatter TTFT). Prompt lengths are made exact in the server's
tokens by tokenizer.py when the server has /tokenize; otherwise built-in prompts are sized at about
4 characters per token and usage.prompt_tokens records the real count per request.

Prompt files (--prompts FILE): a JSON list of ShareGPT-style conversations
({"conversations": [{"from": "human", "value": ...}, ...]}, or {"messages": [{"role": "user",
"content": ...}]}; the first user turn is the prompt) or of strings; anything else is read as one
prompt per line. A seeded sample of --prompt-pool prompts is used, in a seeded order.

Bodies are built from a byte template in which only the nonce (and, with spread output lengths,
the space-padded max_tokens) change, so producing the next request costs one or two
bytes.replace on the hot path.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from orchestrator.bench.client import Endpoint, build_post
from orchestrator.bench.lengths import parse_lengths
from orchestrator.bench.options import BUILTIN_PROMPTS, FILE_PROMPT_POOL, BenchOptions
from orchestrator.errors import ConfigError

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
CHARS_PER_TOKEN = 4          # the estimate used when the server cannot count for us

NONCE = b"@@NONCE0"          # 8 bytes, replaced by an 8-digit request number
NONCE_SAMPLE = "00000000"    # what the nonce looks like when prompts are measured
MAXTOK = 987654321           # 9 digits, replaced by the request's max_tokens padded to 9 characters
MAXTOK_FIELD = b'"max_tokens": 987654321'


def builtin_prompts(n: int, input_tokens: int, seed: int) -> list[str]:
    """n varied prompts of roughly input_tokens tokens each (deterministic for a seed)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        task = rng.choice(TASKS).format(a=rng.choice(TOPICS), b=rng.choice(TOPICS))
        words = [task, "Notes:"]
        chars = len(task)
        while chars < input_tokens * CHARS_PER_TOKEN:
            w = rng.choice(WORDS)
            words.append(w)
            chars += len(w) + 1
        out.append(" ".join(words))
    return out


def read_prompt_file(path: Path) -> list[str]:
    """All prompts of a file: ShareGPT/messages JSON (first user turn), a JSON list of strings, or
    one prompt per line. ConfigError names the file when nothing usable is in it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the prompt file: {exc}")
    data = None
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            if Path(path).suffix == ".json":
                raise ConfigError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}")
    if isinstance(data, list):
        prompts = [p for p in (_first_user_turn(item) for item in data) if p]
        if not prompts:
            raise ConfigError(f"{path}: no prompt found (expected ShareGPT conversations with a "
                              "human/user turn, messages with a user role, or strings)")
        return prompts
    prompts = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not prompts:
        raise ConfigError(f"{path}: no prompts (the file is empty)")
    return prompts


def _first_user_turn(item) -> str | None:
    if isinstance(item, str):
        return item.strip() or None
    if not isinstance(item, dict):
        return None
    for turn in item.get("conversations") or []:
        if isinstance(turn, dict) and turn.get("from") in ("human", "user") and isinstance(turn.get("value"), str):
            return turn["value"].strip() or None
    for msg in item.get("messages") or []:
        if isinstance(msg, dict) and msg.get("role") == "user" and isinstance(msg.get("content"), str):
            return msg["content"].strip() or None
    p = item.get("prompt")
    return (p.strip() or None) if isinstance(p, str) else None


def load_prompts(opts: BenchOptions) -> list[str]:
    """The prompt pool before sizing: a seeded sample of the file, or built-in prompts of about
    the target length (tokenizer.py then cuts or extends them to the exact length)."""
    if opts.prompts_file:
        prompts = read_prompt_file(opts.prompts_file)
        rng = random.Random(f"prompts:{opts.seed}")
        rng.shuffle(prompts)
        return prompts[:opts.prompt_pool or FILE_PROMPT_POOL]
    return builtin_prompts(opts.prompt_pool or BUILTIN_PROMPTS, opts.builtin_input_tokens(), opts.seed)


def content(body: str, nonce: str = NONCE.decode()) -> str:
    """The user message of a request: the nonce, a space, the prompt."""
    return f"{nonce} {body}"


def request_payload(model: str, body: str, opts: BenchOptions, max_tokens: int) -> dict:
    payload: dict = {
        "model": model,
        "messages": [{"role": "user", "content": content(body)}],
        "max_tokens": max_tokens,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.continuous_usage:
        payload["stream_options"]["continuous_usage_stats"] = True
    if opts.ignore_eos:
        payload["ignore_eos"] = True
    if opts.min_tokens is not None:
        payload["min_tokens"] = opts.min_tokens
    payload.update(opts.extra_body)
    return payload


class RequestFactory:
    """(request bytes, max_tokens) for request number i: prompt i % pool, length table[i % size],
    a unique nonce each."""

    def __init__(self, ep: Endpoint, model: str, opts: BenchOptions, bodies: list[str] | None = None):
        lengths = parse_lengths(opts.max_tokens)
        self.lengths = lengths.table(opts.seed)
        self.spread = not lengths.fixed
        marker = MAXTOK if self.spread else lengths.a
        self.templates = [build_post(ep, ep.chat_path,
                                     json.dumps(request_payload(model, b, opts, marker)).encode(),
                                     opts.api_key)
                          for b in (bodies if bodies is not None else load_prompts(opts))]
        if self.spread and any(MAXTOK_FIELD not in t for t in self.templates):
            raise ConfigError("--extra-body must not set max_tokens when --max-tokens is a range")

    def __call__(self, i: int) -> tuple[bytes, int]:
        t = self.templates[i % len(self.templates)].replace(NONCE, b"%08d" % (i % 100_000_000), 1)
        n = self.lengths[i % len(self.lengths)]
        if self.spread:
            t = t.replace(MAXTOK_FIELD, b'"max_tokens": %9d' % n, 1)
        return t, n
