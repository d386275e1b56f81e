"""Load at one level: closed loop at a fixed concurrency, or open loop at a request rate.

Closed loop: C workers, each with its own keep-alive connection, send the next request as soon as
their previous one ends; with --ramp-up R, worker k starts at k*R/C. Phases on one clock
(perf_counter_ns):
  t_start ... warm-up (>= max(warmup_s, ramp-up) and >= warmup_requests completed) ... t_w
  t_w ... window (>= duration_s and >= min_requests window requests completed) ... t_end
  t_end ... drain: no new requests; requests already sent finish and are kept.
Requests sent in [t_w, t_end) are the level's "measure" requests.

Open loop: requests are due on the absolute schedule of arrivals.py (Poisson/gamma or constant
gaps, optional linear ramp), W warm-up arrivals then N window arrivals; each goes out when due on
an idle (or new) connection, or, with a --max-concurrency cap, when a slot is free. Arrivals W..W+N-1
are the "measure" requests; the window is [due time of arrival W, end of the schedule). Rate inf:
all are due at once (through the cap, if any), and the window is the whole burst, from the first
window send to its last token, drain included, as `vllm bench serve` measures it.

Both: aggregate throughput counts tokens *arriving* in [t_w, t_end] from any request, so warm-up
ramp and drain tail never dilute it. t_ready is when a request could have been sent (closed: its
worker was free; open: it was due), so queue = t_send - t_ready is client-side waiting (a full
cap, a late timer, a reconnect). A level is aborted when errors pass --max-errors or
--max-error-rate; requests still running ABORT_GRACE_S later are cancelled (their connections
closed). Client self-check: a heartbeat task sleeps 10 ms and records its oversleep (event-loop
lag); the process CPU time over the window gives client CPU%.
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter, perf_counter_ns

from orchestrator.bench.arrivals import schedule, warmup_arrivals
from orchestrator.bench.client import Connection, Endpoint, connect, http_get
from orchestrator.bench.options import ABORT_GRACE_S, ABORT_MIN_REQUESTS, BenchOptions, Level
from orchestrator.bench.promscrape import snapshot
from orchestrator.bench.stream import RequestRecord
from orchestrator.bench.wire import ResponseParser

HEARTBEAT_S = 0.010
TICK_S = 0.02

MakeRequest = Callable[[int], "tuple[bytes, int]"]
ProgressFn = Callable[[dict], None]


@dataclass
class LevelRun:
    concurrency: int | None          # closed loop: C; open loop: the in-flight cap (None: none)
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
    rate: float | None = None        # open loop: offered requests/s (inf: all at once)
    aborted: str = ""                # why the level was stopped on errors ("" if it was not)
    max_in_flight: int = 0
    scheduled: int = 0               # open loop: window arrivals scheduled

    @property
    def level(self) -> Level:
        return Level(self.concurrency, self.rate)


@dataclass
class _Progress:
    completed: int = 0
    measured_done: int = 0
    errors: int = 0
    phase: str = "warm-up"
    stop: bool = False
    cancelled: bool = False
    t_w: int = 0
    in_flight: int = 0
    max_in_flight: int = 0


async def scrape(ep: Endpoint) -> dict | None:
    """/metrics read through bench's own asyncio client (a blocking request would stall every
    stream's timestamps), aggregated by the shared reader (probe/metrics.py); None if unusable."""
    try:
        status, body = await http_get(ep, "/metrics", timeout=5.0)
        return snapshot(body.decode("utf-8", "replace")) if status == 200 else None
    except (TimeoutError, OSError, ValueError):     # MetricsError is a ValueError
        return None


class _Harness:
    """What both load models share: sending one request, the heartbeat, the /metrics sampler,
    CPU accounting, error stops, progress, and the final drain."""

    def __init__(self, ep: Endpoint, make_request: MakeRequest, opts: BenchOptions,
                 progress: ProgressFn | None, level: Level, window_min: int):
        self.ep, self.make_request, self.opts, self.progress = ep, make_request, opts, progress
        self.level, self.window_min = level, window_min
        self.st = _Progress()
        self.records: list[RequestRecord] = []
        self.live: set[Connection] = set()
        self.lag_ms: list[float] = []
        self.during: list[dict] = []
        self.aborted = ""
        self.beating = True

    # -- one request ------------------------------------------------------------------------------
    async def send(self, conn: Connection | None, rec: RequestRecord, phase: Callable[[], str]) -> Connection | None:
        """Send rec on conn (reconnecting if needed); returns the connection to reuse, or None."""
        opts, st = self.opts, self.st
        raw, rec.max_tokens = self.make_request(rec.idx)
        st.in_flight += 1
        st.max_in_flight = max(st.max_in_flight, st.in_flight)
        try:
            if conn is None or conn.closed:
                try:
                    conn = await connect(self.ep, timeout=min(10.0, opts.timeout_s))
                except (TimeoutError, OSError) as exc:
                    rec.t_send = rec.t_done = perf_counter_ns()
                    rec.phase = phase()
                    rec.fail("connect", str(exc) or type(exc).__name__)
                    self._done(rec)
                    return None
            self.live.add(conn)
            parser = ResponseParser(rec.add_event)
            rec.t_send = perf_counter_ns()
            rec.phase = phase()
            err = None
            try:
                async with asyncio.timeout(opts.timeout_s):
                    err = await conn.send(raw, parser)
            except TimeoutError:
                rec.fail("timeout", f"no complete answer within {opts.timeout_s:g} s")
                conn.close()
            finally:
                self.live.discard(conn)
            rec.t_done = perf_counter_ns()
            rec.status, rec.t_first_byte = parser.status, parser.t_first_byte
            if parser.status and parser.status != 200:
                rec.fail(f"http_{parser.status}", bytes(parser.body[:300]).decode("utf-8", "replace"))
            elif err:
                rec.fail("cancelled" if st.cancelled else "disconnect", err)
            self._done(rec)
            return None if conn.closed else conn
        finally:
            st.in_flight -= 1

    def _done(self, rec: RequestRecord) -> None:
        st = self.st
        self.records.append(rec)
        st.completed += 1
        if rec.error_kind:
            st.errors += 1
        if rec.phase == "measure":
            st.measured_done += 1

    # -- background tasks ---------------------------------------------------------------------------
    async def heartbeat(self) -> None:
        st = self.st
        while self.beating:
            t = perf_counter()
            await asyncio.sleep(HEARTBEAT_S)
            if st.t_w and not st.stop:
                self.lag_ms.append((perf_counter() - t - HEARTBEAT_S) * 1000.0)

    async def scraper(self) -> None:
        st, opts = self.st, self.opts
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
                s = await scrape(self.ep)
                if s:
                    self.during.append(s)

    # -- stops ----------------------------------------------------------------------------------------
    def error_stop(self) -> str:
        """Why the level must be aborted now ("" to go on)."""
        st, opts = self.st, self.opts
        if opts.max_errors and st.errors >= opts.max_errors:
            return f"{st.errors} failed requests reached --max-errors {opts.max_errors}"
        if (opts.max_error_rate is not None and st.completed >= ABORT_MIN_REQUESTS
                and st.errors > opts.max_error_rate * st.completed):
            return (f"{st.errors} of {st.completed} finished requests failed "
                    f"({100 * st.errors / st.completed:.0f}% > --max-error-rate "
                    f"{100 * opts.max_error_rate:g}%)")
        return ""

    async def drain(self, tasks: list[asyncio.Task]) -> None:
        """Wait for the requests in flight; after an abort, cancel what is left after the grace."""
        if not tasks:
            return
        if self.aborted:
            _, pending = await asyncio.wait(tasks, timeout=ABORT_GRACE_S)
            if pending:
                self.st.cancelled = True
                for c in list(self.live):
                    c.close()
        await asyncio.gather(*tasks, return_exceptions=True)

    def report(self, t_start: int, now: int) -> None:
        if self.progress:
            st = self.st
            self.progress({"level": self.level.label, "phase": st.phase, "completed": st.completed,
                           "window_done": st.measured_done, "window_min": self.window_min,
                           "errors": st.errors, "in_flight": st.in_flight,
                           "elapsed_s": (now - t_start) / 1e9,
                           "window_s": (now - st.t_w) / 1e9 if st.t_w else 0.0,
                           "duration_s": self.opts.duration_s})


async def _preconnect(ep: Endpoint, n: int) -> list[Connection]:
    conns = await asyncio.gather(*(connect(ep) for _ in range(n)), return_exceptions=True)
    return [c for c in conns if not isinstance(c, BaseException)]


async def _wait_until(t_ns: int) -> None:
    delay = (t_ns - perf_counter_ns()) / 1e9
    if delay > 0:
        await asyncio.sleep(delay)


async def run_level(ep: Endpoint, make_request: MakeRequest, concurrency: int, opts: BenchOptions,
                    progress: ProgressFn | None = None, first_index: int = 0, index_stride: int = 1,
                    start_at_ns: int | None = None) -> LevelRun:
    """One closed-loop level at `concurrency` streams (warm-up, window, drain)."""
    level = Level(concurrency)
    h = _Harness(ep, make_request, opts, progress, level, opts.window_min_requests(concurrency))
    st = h.st
    next_idx = [first_index]
    before = await scrape(ep) if opts.scrape_metrics else None
    conns = await _preconnect(ep, concurrency)
    if start_at_ns:
        await _wait_until(start_at_ns)
    t_start = perf_counter_ns()

    def phase() -> str:
        return "measure" if st.t_w and not st.stop else "warmup"

    async def worker(w: int) -> None:
        conn = conns[w] if w < len(conns) else None
        if opts.ramp_up_s > 0:
            await _wait_until(t_start + int(w * opts.ramp_up_s / concurrency * 1e9))
        while not st.stop:
            rec = RequestRecord(next_idx[0], w)
            next_idx[0] += index_stride
            rec.t_ready = perf_counter_ns()
            conn = await h.send(conn, rec, phase)
            if conn is None and rec.error_kind == "connect":
                await asyncio.sleep(0.2)
        if conn is not None:
            conn.close()

    warm_s = max(opts.warmup_s, opts.ramp_up_s)

    def window_open(now: int) -> bool:
        return (now - t_start) / 1e9 >= warm_s and st.completed >= opts.warmup_requests

    def window_done(now: int) -> bool:
        return (now - st.t_w) / 1e9 >= opts.duration_s and st.measured_done >= h.window_min

    tasks = [asyncio.create_task(worker(w)) for w in range(concurrency)]
    t_w, t_end, cpu_pct, reason = await _supervise(h, tasks, t_start, window_open, window_done,
                                                   scrape_during=before is not None)
    await h.drain(tasks)
    return await _finish(h, level, t_start, t_w, t_end, cpu_pct, reason, before)


async def run_open_level(ep: Endpoint, make_request: MakeRequest, rate: float, opts: BenchOptions,
                         progress: ProgressFn | None = None, first_index: int = 0,
                         index_stride: int = 1, start_at_ns: int | None = None,
                         cap: int | None = None) -> LevelRun:
    """One open-loop level at `rate` requests/s (warm-up arrivals, window arrivals, drain).
    Sharded runs share one schedule: process k sends arrivals first_index, +index_stride, ..."""
    cap = cap if cap is not None else opts.max_concurrency
    level = Level(opts.max_concurrency, rate)
    burst = math.isinf(rate)
    window_min = opts.window_min_requests(opts.max_concurrency)
    W = opts.warmup_requests if burst else max(warmup_arrivals(rate, opts.warmup_s, opts.ramp_up_s),
                                                opts.warmup_requests)
    N = window_min if burst else max(window_min, round(rate * opts.duration_s))
    offsets = schedule(rate, W + N, burstiness=opts.burstiness, constant=opts.arrivals == "constant",
                       ramp_s=0.0 if burst else opts.ramp_up_s, seed=f"{opts.seed}:{rate}")
    h = _Harness(ep, make_request, opts, progress, level, window_min)
    st = h.st
    before = await scrape(ep) if opts.scrape_metrics else None
    mine = range(first_index, W + N, index_stride)
    # connections opened before the start: the cap, all of a burst (up to 1024), else ~2 s of arrivals
    expected = cap or (1024 if burst else min(256, max(1, math.ceil(2 * rate))))
    idle = await _preconnect(ep, min(len(mine), expected))
    if start_at_ns:
        await _wait_until(start_at_ns)
    t_start = perf_counter_ns()
    ramp_slots = bool(burst and cap and opts.ramp_up_s > 0)
    slots = asyncio.Semaphore(0 if ramp_slots else cap) if cap else None
    tasks: list[asyncio.Task] = []

    async def open_slots() -> None:            # ramp-up with a cap: slot k opens at k*R/cap
        assert cap and slots is not None
        for k in range(cap):
            await _wait_until(t_start + int(k * opts.ramp_up_s / cap * 1e9))
            slots.release()

    async def one(rec: RequestRecord, measure: bool) -> None:
        if slots is not None:
            await slots.acquire()
        try:
            conn = idle.pop() if idle else None
            conn = await h.send(conn, rec, lambda: "measure" if measure else "warmup")
            if conn is not None:
                idle.append(conn)
        finally:
            if slots is not None:
                slots.release()

    async def dispatch() -> None:
        for k in mine:
            due = t_start + int(offsets[k] * 1e9)
            await _wait_until(due)
            if st.stop:
                break
            rec = RequestRecord(k, 0)
            rec.t_ready = due
            tasks.append(asyncio.create_task(one(rec, W <= k)))

    extra = [asyncio.create_task(open_slots())] if ramp_slots else []
    dispatcher = asyncio.create_task(dispatch())
    t_sched_w = t_start + int(offsets[W] * 1e9) if W < len(offsets) else t_start
    t_sched_end = t_start + int(offsets[-1] * 1e9)

    def window_open(now: int) -> bool:
        return now >= t_sched_w

    def window_done(now: int) -> bool:
        return dispatcher.done() and (burst or now >= t_sched_end)

    t_w, t_end, cpu_pct, reason = await _supervise(h, [dispatcher], t_start, window_open, window_done,
                                                   stop_when_idle=False, scrape_during=before is not None)
    dispatcher.cancel()
    await asyncio.gather(dispatcher, return_exceptions=True)
    await h.drain(tasks)
    for t in extra:
        t.cancel()
    for c in idle:
        c.close()
    measure = [r for r in h.records if r.phase == "measure"]
    if burst and measure:          # the whole burst, drain included (as vLLM's bench measures it)
        t_w = min(r.t_send for r in measure)
        t_end = max((r.chunk_ts[-1] for r in measure if r.chunk_ts), default=t_end)
    elif not h.aborted and reason == "window complete":
        t_w, t_end = t_sched_w, t_sched_end
    run = await _finish(h, level, t_start, t_w, t_end, cpu_pct, reason, before)
    run.scheduled = N
    return run


async def _supervise(h: _Harness, tasks: list[asyncio.Task], t_start: int,
                     window_open: Callable[[int], bool], window_done: Callable[[int], bool],
                     stop_when_idle: bool = True, scrape_during: bool = False
                     ) -> tuple[int, int, float | None, str]:
    """Tick until the window is complete, the level time cap, an error stop, or (closed loop) all
    workers ended; returns (t_w, t_end, client CPU% over the window, reason)."""
    st, opts = h.st, h.opts
    gc.collect()
    gc.freeze()        # setup objects never need scanning again: fewer, shorter GC pauses
    hb = asyncio.create_task(h.heartbeat())
    sc = asyncio.create_task(h.scraper()) if scrape_during else None
    cpu0 = None
    reason = ""
    last_report = 0.0
    t_end = 0
    if window_open(t_start):          # no warm-up: the very first requests are window requests
        st.t_w = t_start
    try:
        while True:
            await asyncio.sleep(TICK_S)
            now = perf_counter_ns()
            if not st.t_w and window_open(now):
                st.t_w = now
            if st.t_w and cpu0 is None:
                cpu0 = _cpu_seconds()
                st.phase = "window"
            if st.t_w and window_done(now):
                reason = "window complete"
            stop = h.error_stop()
            if stop:
                h.aborted = stop
                reason = "aborted: " + stop
            if not reason and (now - t_start) / 1e9 >= opts.max_level_s:
                reason = f"level time cap ({opts.max_level_s:g} s) reached"
            if not reason and stop_when_idle and all(t.done() for t in tasks):
                reason = "all workers stopped"
            if reason:
                if not st.t_w:
                    st.t_w = now
                    cpu0 = cpu0 or _cpu_seconds()
                t_end = now
                st.stop = True
                st.phase = "drain"
                break
            if now / 1e9 - last_report >= 0.25:
                last_report = now / 1e9
                h.report(t_start, now)
        cpu1 = _cpu_seconds()
        cpu_pct = (100.0 * (cpu1[0] - cpu0[0]) / (cpu1[1] - cpu0[1])
                   if cpu0 and cpu1[1] > cpu0[1] else None)
    finally:
        st.stop = True
        h.beating = False
        await asyncio.gather(hb, return_exceptions=True)
        if sc:
            sc.cancel()
            await asyncio.gather(sc, return_exceptions=True)
        gc.unfreeze()
    return st.t_w, t_end, cpu_pct, reason


async def _finish(h: _Harness, level: Level, t_start: int, t_w: int, t_end: int,
                  cpu_pct: float | None, reason: str, before: dict | None) -> LevelRun:
    t_drained = perf_counter_ns()
    h.report(t_start, t_drained)
    after = await scrape(h.ep) if h.opts.scrape_metrics and before else None
    h.records.sort(key=lambda r: r.t_send)
    return LevelRun(level.concurrency, h.records, t_start, t_w, t_end, t_drained, h.lag_ms, cpu_pct,
                    reason, before, after, h.during, rate=level.rate, aborted=h.aborted,
                    max_in_flight=h.st.max_in_flight)


def _cpu_seconds() -> tuple[float, float]:
    """(process CPU seconds, wall seconds) - both monotonic enough for a percentage."""
    t = os.times()
    return t.user + t.system, perf_counter()
