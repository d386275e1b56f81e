"""Run one level across several client processes when one core is not enough.

All processes connect first, then start at one common instant (perf_counter_ns is CLOCK_MONOTONIC,
shared by all processes on Linux). Closed loop: each process runs its share of the C streams with
the same warm-up/window rules (its share of min_requests); the merged level uses the intersection
of the windows and re-labels requests by their send time. Open loop: every process draws the same
arrival schedule and sends every n-th arrival (and its share of the --max-concurrency cap), so the
merged level has exactly the schedule one process would have sent. Server metrics are scraped by
the parent, before and after.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from time import perf_counter_ns

from orchestrator.bench.client import Endpoint
from orchestrator.bench.eventloop import run_coroutine
from orchestrator.bench.loadgen import LevelRun, run_level, run_open_level, scrape
from orchestrator.bench.options import BenchOptions, Level

START_DELAY_NS = 2_000_000_000   # time for the children to start and connect


def _child(base_url: str, model: str, opts: BenchOptions, bodies: list[str], level: Level,
           share: int | None, k: int, n: int, start_at_ns: int) -> LevelRun:
    from orchestrator.bench.prompts import RequestFactory

    ep = Endpoint.parse(base_url)
    factory = RequestFactory(ep, model, opts, bodies)
    if level.rate is None:
        assert share is not None
        coro = run_level(ep, factory, share, opts, first_index=k, index_stride=n, start_at_ns=start_at_ns)
    else:
        coro = run_open_level(ep, factory, level.rate, opts, first_index=k, index_stride=n,
                              start_at_ns=start_at_ns, cap=share)
    return run_coroutine(coro, opts.event_loop)[0]


def split(concurrency: int, processes: int) -> list[int]:
    base, extra = divmod(concurrency, processes)
    return [base + (1 if i < extra else 0) for i in range(processes)]


def merge(runs: list[LevelRun], level: Level) -> LevelRun:
    records = sorted((rec for r in runs for rec in r.records), key=lambda rec: rec.t_send)
    if level.closed:
        t_w = max(r.t_window_start for r in runs)
        t_end = max(t_w, min(r.t_window_end for r in runs))
        for rec in records:
            rec.phase = "measure" if t_w <= rec.t_send < t_end else "warmup"
    else:                       # one shared schedule: the phases are already right
        t_w = min(r.t_window_start for r in runs)
        t_end = max(r.t_window_end for r in runs)
    cpu = [r.cpu_pct for r in runs if r.cpu_pct is not None]
    return LevelRun(level.concurrency, records, min(r.t_start for r in runs), t_w, t_end,
                    max(r.t_drained for r in runs), [x for r in runs for x in r.lag_ms],
                    sum(cpu) if cpu else None, "; ".join(sorted({r.stop_reason for r in runs})),
                    processes=len(runs), rate=level.rate,
                    aborted="; ".join(sorted({r.aborted for r in runs if r.aborted})),
                    max_in_flight=sum(r.max_in_flight for r in runs),
                    scheduled=max(r.scheduled for r in runs))


async def run_level_sharded(base_url: str, model: str, level: Level, opts: BenchOptions,
                            processes: int, bodies: list[str]) -> LevelRun:
    ep = Endpoint.parse(base_url)
    shares: list[int | None]
    if level.closed:
        assert level.concurrency is not None
        shares = [s for s in split(level.concurrency, processes) if s]
        min_req = opts.window_min_requests(level.concurrency)
        child_opts = dataclasses.replace(opts, scrape_metrics=False, min_requests=-(-min_req // len(shares)))
    else:
        shares = ([s for s in split(level.concurrency, processes) if s] if level.concurrency
                  else [None] * processes)
        child_opts = dataclasses.replace(opts, scrape_metrics=False)
    n = len(shares)
    before = await scrape(ep) if opts.scrape_metrics else None
    start_at = perf_counter_ns() + START_DELAY_NS
    loop = asyncio.get_running_loop()
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
        futs = [loop.run_in_executor(pool, _child, base_url, model, child_opts, bodies, level, share,
                                     k, n, start_at)
                for k, share in enumerate(shares)]
        runs = await asyncio.gather(*futs)
    merged = merge(list(runs), level)
    merged.metrics_before = before
    merged.metrics_after = await scrape(ep) if before else None
    return merged
