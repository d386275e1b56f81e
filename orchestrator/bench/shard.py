"""Run one level across several client processes when one core is not enough.

Each process runs its share of the C streams with the same warm-up/window rules (its share of
min_requests), all starting at a common instant. perf_counter_ns is CLOCK_MONOTONIC, shared by all
processes on Linux, so the merged level uses the intersection of the windows and re-labels requests
by their send time. Server metrics are scraped by the parent, before and after.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from time import perf_counter_ns

from orchestrator.bench.client import Endpoint
from orchestrator.bench.loadgen import LevelRun, run_level, scrape
from orchestrator.bench.options import BenchOptions

START_DELAY_NS = 2_000_000_000   # time for the children to start and connect


def _child(base_url: str, model: str, opts: BenchOptions, conc: int, k: int, n: int,
           start_at_ns: int) -> LevelRun:
    from orchestrator.bench.prompts import RequestFactory

    ep = Endpoint.parse(base_url)
    factory = RequestFactory(ep, model, opts)
    return asyncio.run(run_level(ep, factory, conc, opts, first_index=k, index_stride=n,
                                 start_at_ns=start_at_ns))


def split(concurrency: int, processes: int) -> list[int]:
    base, extra = divmod(concurrency, processes)
    return [base + (1 if i < extra else 0) for i in range(processes)]


def merge(runs: list[LevelRun], concurrency: int) -> LevelRun:
    t_w = max(r.t_window_start for r in runs)
    t_end = max(t_w, min(r.t_window_end for r in runs))
    records = sorted((rec for r in runs for rec in r.records), key=lambda rec: rec.t_send)
    for rec in records:
        rec.phase = "measure" if t_w <= rec.t_send < t_end else "warmup"
    cpu = [r.cpu_pct for r in runs if r.cpu_pct is not None]
    return LevelRun(concurrency, records, min(r.t_start for r in runs), t_w, t_end,
                    max(r.t_drained for r in runs), [x for r in runs for x in r.lag_ms],
                    sum(cpu) if cpu else None, "; ".join(sorted({r.stop_reason for r in runs})),
                    processes=len(runs))


async def run_level_sharded(base_url: str, model: str, concurrency: int, opts: BenchOptions,
                            processes: int) -> LevelRun:
    ep = Endpoint.parse(base_url)
    shares = [s for s in split(concurrency, processes) if s]
    n = len(shares)
    min_req = opts.window_min_requests(concurrency)
    child_opts = dataclasses.replace(opts, scrape_metrics=False, min_requests=-(-min_req // n))
    before = await scrape(ep) if opts.scrape_metrics else None
    start_at = perf_counter_ns() + START_DELAY_NS
    loop = asyncio.get_running_loop()
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
        futs = [loop.run_in_executor(pool, _child, base_url, model, child_opts, share, k, n, start_at)
                for k, share in enumerate(shares)]
        runs = await asyncio.gather(*futs)
    merged = merge(list(runs), concurrency)
    merged.metrics_before = before
    merged.metrics_after = await scrape(ep) if before else None
    return merged


def cpu_count() -> int:
    return len(os.sched_getaffinity(0))
