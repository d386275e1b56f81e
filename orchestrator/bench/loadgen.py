"""Closed-loop load at a fixed concurrency, with warm-up, a measurement window and a drain.

Load model (documented in formulas.py): C workers, each with its own keep-alive connection, send
the next request as soon as their previous one ends. Phases on one clock (perf_counter_ns):
  t_start ... warm-up (>= warmup_s and >= warmup_requests completed) ... t_w
  t_w ... window (>= duration_s and >= min_requests window requests completed) ... t_end
  t_end ... drain: no new requests; requests already sent finish and are kept.
Requests sent in [t_w, t_end) are the level's "measure" requests; their latencies are the level's
latency statistics. Aggregate throughput counts tokens *arriving* in [t_w, t_end] from any request,
so warm-up ramp and drain tail never dilute it.

Client self-check: a heartbeat task sleeps 10 ms and records its oversleep (event-loop lag); the
process CPU time over the window gives client CPU%.
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter, perf_counter_ns

from orchestrator.bench.client import Endpoint, connect, http_get
from orchestrator.bench.options import BenchOptions
from orchestrator.bench.promscrape import snapshot
from orchestrator.bench.stream import RequestRecord
from orchestrator.bench.wire import ResponseParser

HEARTBEAT_S = 0.010


@dataclass
class LevelRun:
    concurrency: int
    records: list[RequestRecord]
    t_start: int
    t_window_start: int
    t_window_end: int
    t_drained: int
    lag_ms: list[float]
    cpu_pct: float | None
    stop_reason: str
    metrics_before: dict | None = None
    metrics_after: dict | None = None
    metrics_during: list[dict] = field(default_factory=list)
    processes: int = 1


@dataclass
class _Progress:
    completed: int = 0
    measured_done: int = 0
    errors: int = 0
    tokens: int = 0
    phase: str = "warm-up"
    stop: bool = False
    t_w: int = 0


ProgressFn = Callable[[dict], None]


async def scrape(ep: Endpoint) -> dict | None:
    """/metrics read through bench's own asyncio client (a blocking request would stall every
    stream's timestamps), aggregated by the shared reader (probe/metrics.py); None if unusable."""
    try:
        status, body = await http_get(ep, "/metrics", timeout=5.0)
        return snapshot(body.decode("utf-8", "replace")) if status == 200 else None
    except (TimeoutError, OSError, ValueError):     # MetricsError is a ValueError
        return None


async def run_level(ep: Endpoint, make_request: Callable[[int], bytes], concurrency: int,
                    opts: BenchOptions, progress: ProgressFn | None = None,
                    first_index: int = 0, index_stride: int = 1,
                    start_at_ns: int | None = None) -> LevelRun:
    """Run one concurrency level to completion (warm-up, window, drain)."""
    st = _Progress()
    records: list[RequestRecord] = []
    next_idx = [first_index]
    min_req = opts.window_min_requests(concurrency)
    before = await scrape(ep) if opts.scrape_metrics else None
    conns = await asyncio.gather(*(connect(ep) for _ in range(concurrency)), return_exceptions=True)

    async def worker(w: int) -> None:
        conn = conns[w] if not isinstance(conns[w], BaseException) else None
        while not st.stop:
            rec = RequestRecord(next_idx[0], w)
            next_idx[0] += index_stride
            rec.t_ready = perf_counter_ns()
            raw = make_request(rec.idx)
            if conn is None or conn.closed:
                try:
                    conn = await connect(ep, timeout=min(10.0, opts.timeout_s))
                except (TimeoutError, OSError) as exc:
                    conn = None
                    rec.t_send = rec.t_done = perf_counter_ns()
                    rec.phase = "measure" if st.t_w else "warmup"
                    rec.fail("connect", str(exc) or type(exc).__name__)
                    records.append(rec)
                    st.errors += 1
                    await asyncio.sleep(0.2)
                    continue
            parser = ResponseParser(rec.add_event)
            rec.t_send = perf_counter_ns()
            rec.phase = "measure" if st.t_w and not st.stop else "warmup"
            err = None
            try:
                async with asyncio.timeout(opts.timeout_s):
                    err = await conn.send(raw, parser)
            except TimeoutError:
                rec.fail("timeout", f"no complete answer within {opts.timeout_s:g} s")
                conn.close()
            rec.t_done = perf_counter_ns()
            rec.status, rec.t_first_byte = parser.status, parser.t_first_byte
            if parser.status and parser.status != 200:
                rec.fail(f"http_{parser.status}", bytes(parser.body[:300]).decode("utf-8", "replace"))
            elif err:
                rec.fail("disconnect", err)
            records.append(rec)
            st.completed += 1
            st.tokens += len(rec.chunk_ts)
            if rec.error_kind:
                st.errors += 1
            if rec.phase == "measure":
                st.measured_done += 1
        if conn is not None:
            conn.close()

    lag_ms: list[float] = []
    lag_on = [True]

    async def heartbeat() -> None:
        while lag_on[0]:
            t = perf_counter()
            await asyncio.sleep(HEARTBEAT_S)
            if st.t_w and not st.stop:
                lag_ms.append((perf_counter() - t - HEARTBEAT_S) * 1000.0)

    during: list[dict] = []

    async def scraper() -> None:
        next_due: float | None = None
        while not st.stop:
            await asyncio.sleep(0.1)
            if not st.t_w or st.stop:
                continue
            now = perf_counter()
            if next_due is None:     # the first sample comes early, so short windows get one too
                next_due = now + min(opts.metrics_interval_s, max(0.2, opts.duration_s / 2))
            if now >= next_due:
                next_due = now + opts.metrics_interval_s
                s = await scrape(ep)
                if s:
                    during.append(s)

    gc.collect()
    gc.freeze()        # setup objects never need scanning again: fewer, shorter GC pauses
    t_start = perf_counter_ns()
    tasks = [asyncio.create_task(worker(w)) for w in range(concurrency)]
    hb = asyncio.create_task(heartbeat())
    sc = asyncio.create_task(scraper()) if opts.scrape_metrics and before else None
    cpu0 = None
    reason = ""
    last_report = 0.0
    t_end = 0
    try:
        while True:
            await asyncio.sleep(0.02)
            now = perf_counter_ns()
            if not st.t_w:
                if (now - t_start) / 1e9 >= opts.warmup_s and st.completed >= opts.warmup_requests:
                    st.t_w = now
                    cpu0 = _cpu_seconds()
                    st.phase = "window"
            elif (now - st.t_w) / 1e9 >= opts.duration_s and st.measured_done >= min_req:
                reason = "window complete"
            if not reason and (now - t_start) / 1e9 >= opts.max_level_s:
                reason = f"level time cap ({opts.max_level_s:g} s) reached"
                if not st.t_w:
                    st.t_w = now
                    cpu0 = _cpu_seconds()
            if not reason and all(t.done() for t in tasks):
                reason = "all workers stopped"
            if reason:
                t_end = now
                st.stop = True
                st.phase = "drain"
                break
            if progress and now / 1e9 - last_report >= 0.25:
                last_report = now / 1e9
                progress(_progress_dict(st, concurrency, min_req, t_start, now, opts))
        cpu1 = _cpu_seconds()
        cpu_pct = (100.0 * (cpu1[0] - cpu0[0]) / (cpu1[1] - cpu0[1])
                   if cpu0 and cpu1[1] > cpu0[1] else None)
        await asyncio.gather(*tasks)
    finally:
        st.stop = True
        lag_on[0] = False
        for t in tasks:
            t.cancel()
        await asyncio.gather(hb, *([sc] if sc else []), return_exceptions=True)
        if sc:
            sc.cancel()
        gc.unfreeze()
    t_drained = perf_counter_ns()
    if progress:
        progress(_progress_dict(st, concurrency, min_req, t_start, t_drained, opts))
    after = await scrape(ep) if opts.scrape_metrics and before else None
    records.sort(key=lambda r: r.t_send)
    return LevelRun(concurrency, records, t_start, st.t_w, t_end, t_drained, lag_ms, cpu_pct, reason,
                    before, after, during)


def _cpu_seconds() -> tuple[float, float]:
    """(process CPU seconds, wall seconds) - both monotonic enough for a percentage."""
    t = os.times()
    return t.user + t.system, perf_counter()


def _progress_dict(st: _Progress, c: int, min_req: int, t_start: int, now: int,
                   opts: BenchOptions) -> dict:
    return {"concurrency": c, "phase": st.phase, "completed": st.completed,
            "window_done": st.measured_done, "window_min": min_req, "errors": st.errors,
            "elapsed_s": (now - t_start) / 1e9,
            "window_s": (now - st.t_w) / 1e9 if st.t_w else 0.0, "duration_s": opts.duration_s}
