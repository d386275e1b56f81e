"""Exact prompt lengths in the server's own tokens, through vLLM's /tokenize and /detokenize.

Why the server's tokenizer: a local tokenizer may differ from the served one, and the chat
template adds tokens a plain count misses (vLLM's bench aligns its prompts the same way,
`_align_prompts_to_server_tokenizer`). The target is what the server reports as
usage.prompt_tokens: the whole chat-templated prompt, nonce included.

Per prompt (vLLM 0.33 request shapes, see vllm/entrypoints/serve/tokenize/protocol.py):
  1. count the templated message: POST /tokenize {model, messages, chat_template_kwargs}
  2. take the prompt's own ids:     POST /tokenize {model, prompt, add_special_tokens: false}
  3. cut (or repeat) the ids to the length the target needs, POST /detokenize {model, tokens},
     count the templated message again; decode/re-encode can merge or split tokens at the cut,
     so correct the length by the difference and retry (a few rounds; usually one).
A server without a usable /tokenize (404, 401, another server) gets the estimate (about 4
characters per token) and a warning; usage.prompt_tokens still records the real counts.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from orchestrator.bench.client import Endpoint, Session
from orchestrator.bench.prompts import NONCE_SAMPLE, content
from orchestrator.errors import ConfigError

ROUNDS = 5          # length corrections per prompt before giving up on exactness
WORKERS = 8         # prompts sized concurrently (one connection each)


@dataclass
class SizedPrompts:
    bodies: list[str]
    target: int | None                 # the prompt_tokens every request should have, or None
    exact: bool                        # counted by the server's tokenizer
    counts: list[int] = field(default_factory=list)   # server count per prompt (templated)
    off_target: int = 0                # prompts that could not be made exact
    warning: str | None = None

    def to_json(self) -> dict:
        return {"target": self.target, "exact": self.exact, "prompts": len(self.bodies),
                "off_target": self.off_target, "warning": self.warning,
                "count_min": min(self.counts) if self.counts else None,
                "count_max": max(self.counts) if self.counts else None}


class _Tokenizer:
    def __init__(self, session: Session, model: str, template_kwargs: dict | None):
        self.s, self.model, self.kwargs = session, model, template_kwargs

    async def _post(self, path: str, obj: dict) -> dict:
        status, body = await self.s.request("POST", path, {"model": self.model, **obj})
        if status != 200:
            raise _Unusable(f"{path} answered HTTP {status}: {body[:200].decode('utf-8', 'replace')}")
        try:
            return json.loads(body)
        except ValueError:
            raise _Unusable(f"{path} answered something that is not JSON")

    async def chat_count(self, text: str) -> int:
        obj: dict = {"messages": [{"role": "user", "content": content(text, NONCE_SAMPLE)}]}
        if self.kwargs:
            obj["chat_template_kwargs"] = self.kwargs
        return int((await self._post("/tokenize", obj))["count"])

    async def ids(self, text: str) -> list[int]:
        return list((await self._post("/tokenize", {"prompt": text, "add_special_tokens": False}))["tokens"])

    async def text(self, ids: list[int]) -> str:
        return str((await self._post("/detokenize", {"tokens": ids}))["prompt"])


class _Unusable(Exception):
    """The server's tokenizer endpoints are missing or misbehave: fall back to the estimate."""


async def size_prompts(ep: Endpoint, model: str, bodies: list[str], target: int | None, *,
                       enabled: bool = True, api_key: str | None = None,
                       template_kwargs: dict | None = None) -> SizedPrompts:
    """Prompts cut to exactly `target` server tokens (or, with target None, counted as they are)."""
    if not enabled:
        return SizedPrompts(bodies, target, False)
    try:
        async with Session(ep, api_key) as s:
            await _Tokenizer(s, model, template_kwargs).ids("probe")
    except (TimeoutError, _Unusable, OSError, ConnectionError, KeyError, TypeError) as exc:
        return SizedPrompts(bodies, target, False, warning=(
            f"the server has no usable /tokenize ({exc}): prompt lengths are estimated at about "
            "4 characters per token; usage.prompt_tokens records the real counts"))
    out: list[tuple[str, int, bool] | None] = [None] * len(bodies)
    queue = list(enumerate(bodies))

    async def worker() -> None:
        async with Session(ep, api_key) as s:
            tok = _Tokenizer(s, model, template_kwargs)
            while queue:
                i, body = queue.pop()
                out[i] = (await _fit(tok, body, target) if target is not None
                          else (body, await tok.chat_count(body), True))

    try:
        await asyncio.gather(*(worker() for _ in range(min(WORKERS, len(bodies)))))
    except (TimeoutError, _Unusable, OSError, ConnectionError, KeyError, TypeError) as exc:
        return SizedPrompts(bodies, target, False, warning=(
            f"sizing prompts with /tokenize failed part-way ({exc}): prompt lengths are estimated"))
    done = [o for o in out if o is not None]
    return SizedPrompts([b for b, _, _ in done], target, True, [c for _, c, _ in done],
                        sum(1 for _, _, ok in done if not ok))


async def _fit(tok: _Tokenizer, body: str, target: int) -> tuple[str, int, bool]:
    """(text, its templated count, exact?) for one prompt."""
    count = await tok.chat_count(body)
    if count == target:
        return body, count, True
    ids = await tok.ids(body)
    overhead = count - len(ids)
    want = target - overhead
    if want < 1:
        raise ConfigError(f"--input-tokens {target} is below what the chat template and the "
                          f"request nonce take alone ({overhead + 1} tokens with a one-token prompt)")
    best = (body, count)
    for _ in range(ROUNDS):
        cand = (ids * (want // len(ids) + 1))[:want] if ids else []
        text = await tok.text(cand)
        count = await tok.chat_count(text)
        if abs(count - target) < abs(best[1] - target):
            best = (text, count)
        if count == target:
            return text, count, True
        want += target - count
        if want < 1:
            break
    return best[0], best[1], False
