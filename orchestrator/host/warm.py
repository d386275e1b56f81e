"""Controller side of the page-cache warm-up: run orchestrator/host/remote/warm.py with the HOST's
Python, in plan-only mode while gathering facts (which weight files, in vLLM's load order, and how
much of them is cached already) and streamed when the warm step runs (JSON lines turned into a
result; its progress bar: ops/progress.py), like the download (orchestrator/host/download.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from orchestrator.errors import DeployFailed
from orchestrator.host import scripts
from orchestrator.host.base import Host

SCRIPT = "warm.py"
EVENTS = ("plan", "progress", "file", "done", "error")
REASONS = {
    "complete": "every weight file is in the page cache",
    "budget": "the memory budget is used",
    "memory": "available memory, net of the warmed pages, reached the floor",
    "nofiles": "the folder has no weight files",
}


def warm_args(model_dir: str, *, meminfo: str, budget: int | None = None, floor: int | None = None,
              rate: float | None = None, plan_only: bool = False) -> list[str]:
    """The warm script's arguments (orchestrator/host/remote/warm.py)."""
    argv = ["--dir", model_dir, "--meminfo", meminfo]
    if plan_only:
        return argv + ["--plan-only"]
    if budget is not None:
        argv += ["--budget", str(int(budget))]
    if floor is not None:
        argv += ["--floor", str(int(floor))]
    if rate:
        argv += ["--rate", f"{rate:.0f}"]
    return argv


def _events(host: Host, python: str, args: list[str], *, timeout: float,
            on_event: Callable[[dict], None] | None) -> list[dict]:
    events, result = scripts.stream_events(host, python, SCRIPT, args, EVENTS, on_event=on_event, timeout=timeout)
    errors = [e for e in events if e["event"] == "error"]
    if errors or result.exit_code != 0:
        message = errors[0].get("message") if errors else f"the warm script exited {result.exit_code}"
        raise DeployFailed(f"warm-up failed: {message}", host=host.name, step="warm",
                           details=result.stderr.strip().splitlines()[-5:])
    return events


def plan_warm(host: Host, python: str, model_dir: str, meminfo: str, timeout: float = 300.0) -> dict:
    """The plan event: files [[name, size, cached]] in load order, total_bytes, cached_bytes,
    mem_total, mem_available. Reads no file content (mincore on a mapping)."""
    events = _events(host, python, warm_args(model_dir, meminfo=meminfo, plan_only=True), timeout=timeout,
                     on_event=None)
    plans = [e for e in events if e["event"] == "plan"]
    if not plans:
        raise DeployFailed("the warm script printed no plan", host=host.name, step="warm")
    return plans[0]


def run_warm(host: Host, python: str, model_dir: str, *, meminfo: str, budget: int, floor: int, rate: float,
             on_event: Callable[[dict], None] | None = None, timeout: float = 24 * 3600.0) -> dict:
    """Warm; returns the done event plus "files" (file events) and "wall_s". Raises DeployFailed
    (step "warm") on an error event or a failed script."""
    started = time.monotonic()
    events = _events(host, python, warm_args(model_dir, meminfo=meminfo, budget=budget, floor=floor, rate=rate),
                     timeout=timeout, on_event=on_event)
    done = [e for e in events if e["event"] == "done"]
    if not done:
        raise DeployFailed("the warm script ended without a result", host=host.name, step="warm")
    return {**done[0], "files": [e for e in events if e["event"] == "file"],
            "wall_s": time.monotonic() - started}
