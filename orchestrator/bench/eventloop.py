"""The event loop the client runs on: uvloop when installed (faster I/O callbacks, a higher client
ceiling; docs/figures.md has both figures), asyncio's own loop otherwise. uvloop is optional
(`pip install uvloop` or the `fast` extra), never required.

    result, name = run_coroutine(main(), "auto")     # name: "uvloop" or "asyncio"
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

KINDS = ("auto", "uvloop", "asyncio")


def loop_factory(kind: str = "auto") -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    """(factory for asyncio.Runner, name). "uvloop" raises ImportError when it is not installed."""
    if kind not in KINDS:
        raise ValueError(f"unknown event loop {kind!r} (one of {', '.join(KINDS)})")
    if kind == "asyncio":
        return None, "asyncio"
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise ImportError("uvloop is not installed (pip install uvloop)") from None
        return None, "asyncio"
    return uvloop.new_event_loop, "uvloop"


def run_coroutine(coro: Coroutine[Any, Any, Any], kind: str = "auto") -> tuple[Any, str]:
    try:
        factory, name = loop_factory(kind)
    except (ImportError, ValueError):
        coro.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro), name
