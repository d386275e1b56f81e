"""The page-cache warm-up step, pure: how much of the new model's weights to read into the page
cache before its service starts (in a swap: while the old model still serves), the expected
downtime with and without it, and the step that does it (orchestrator/host/warm.py streams
orchestrator/host/remote/warm.py).

What is kept free, in bytes, from the host facts (MemAvailable) and the manifest:
    need   = what the new service takes on the CPU side once started: the manifest's
             loading.cpu_memory_gib, else the host's cpu_memory_per_gpu_gib x its GPUs (a rule
             documented in the inventory reference)
    margin = 10% of MemAvailable: vLLM 0.33 itself prefetches a checkpoint only when it fits in
             90% of available RAM (model_executor/model_loader/weight_utils.py); the same share
             stays free here
    budget = MemAvailable - margin - need     the most bytes of the files, in load order, cached
    floor  = margin + need                    the script stops before available memory, net of
                                              the pages it warmed, would fall under this
The old service's CPU memory is measured in effect: while it serves it is already outside
MemAvailable, and its growth during the warm-up lowers MemAvailable, which the floor catches.
When the old service stops, its memory comes back and the new one's `need` is taken from it.

Expected downtime = cached bytes / loading.cached_mb_s + the rest / loading.disk_mb_s +
loading.other_seconds (declared or measured rates from the manifest).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.errors import DeployFailed
from orchestrator.fmt import fmt_bytes, fmt_duration
from orchestrator.host import scripts
from orchestrator.host.facts import Memory
from orchestrator.host.records import HistoryEntry
from orchestrator.host.warm import REASONS, SCRIPT, run_warm, warm_args
from orchestrator.plan.inputs import Measured, PlanInput, WarmFacts
from orchestrator.plan.model import Action
from orchestrator.plan.run import RunEnv, RunRecord, WarmResult

GIB = 1024 ** 3
MB = 10 ** 6
MARGIN_PCT = 10            # vLLM 0.33: fits_in_ram = checkpoint <= 90% of available RAM


@dataclass(frozen=True)
class Budget:
    """What the warm-up may use (bytes) and why."""

    total: int                  # MemTotal
    available: int              # MemAvailable when the facts were read
    need: int                   # the new service's CPU memory
    need_source: str
    margin: int
    budget: int                 # most bytes of the weight files to have cached
    floor: int                  # available memory, net of the warmed pages, never goes under it


def cpu_need(m: Manifest, entry: HostEntry) -> tuple[int, str]:
    """The new service's CPU memory and where the figure comes from."""
    if m.loading.cpu_memory_gib is not None:
        return int(m.loading.cpu_memory_gib * GIB), "manifest loading.cpu_memory_gib"
    gpus = m.serving.gpus
    return (int(entry.cpu_memory_per_gpu_gib * gpus * GIB),
            f"{entry.cpu_memory_per_gpu_gib:g} GiB x {gpus} GPUs, the host's cpu_memory_per_gpu_gib")


def budget_for(memory: Memory | None, m: Manifest, entry: HostEntry,
               reserve: tuple[int, str] | None = None) -> Budget | None:
    """None when the host's available memory is unknown. `reserve`: bytes that another step of the
    same plan takes from host RAM after the warm-up (an old service's level-1 sleep pins them) and
    what takes them; kept free as the new service's own need is."""
    if memory is None or memory.available is None:
        return None
    need, source = cpu_need(m, entry)
    if reserve is not None and reserve[0] > 0:
        need, source = need + reserve[0], f"{source}, + {fmt_bytes(reserve[0])} {reserve[1]}"
    margin = memory.available * MARGIN_PCT // 100
    return Budget(memory.total, memory.available, need, source, margin,
                  budget=max(0, memory.available - margin - need), floor=margin + need)


def load_seconds(m: Manifest, total: int, cached: int, measured: Measured | None = None) -> float:
    """Expected start-up time: cached bytes at the page-cache rate, the rest at the disk rate,
    plus what does not depend on the page cache; this host's measured figures where it has them
    (`measured`), the manifest's declared ones otherwise."""
    cached = min(max(cached, 0), total)
    rates = m.loading
    cache_rate = (measured.cached_bytes_s if measured else None) or rates.cached_mb_s * MB
    disk_rate = (measured.disk_bytes_s if measured else None) or rates.disk_mb_s * MB
    other = measured.other_s if measured is not None else rates.other_seconds
    return cached / cache_rate + (total - cached) / disk_rate + other


def measured_from(history: list[HistoryEntry], name: str, load_bytes: int) -> Measured | None:
    """The last successful deploy or swap that started the service NAME and recorded its ledger;
    `load_bytes`: the weights' bytes now (the rates are per byte of them)."""
    for rec in reversed(history):
        led = rec.extra("startup") or {}
        if rec.operation not in ("deploy", "swap") or not rec.ok or rec.subject != name or \
                not isinstance(led.get("weights_s"), (int, float)) or not isinstance(led.get("ready_s"), (int, float)):
            continue
        weights_s = max(float(led["weights_s"]), 1e-3)
        warm = rec.extra("warm") or {}
        share = warm["cached_bytes"] / warm["total_bytes"] if warm.get("total_bytes") else None
        return Measured(at=rec.at or "?", other_s=max(0.0, float(led["ready_s"]) - weights_s),
                        cached_bytes_s=load_bytes / weights_s if share is not None and share >= 0.9 else None,
                        disk_bytes_s=load_bytes / weights_s if share is not None and share <= 0.1 else None)
    return None


@dataclass(frozen=True)
class Expected:
    """Expected downtime without and with the warm-up (seconds) and the bytes behind them."""

    cold_s: float
    warm_s: float | None        # None: the warm-up cannot be sized (memory unknown)
    total: int
    cached_now: int
    cached_after: int | None
    measured: Measured | None = None
    time_scale: float = 1.0     # the host loads this many times faster than the field (a SIMULATED one)

    def on_host(self, time_scale: float) -> Expected:
        """The estimate on a host `time_scale` times faster than the field (inventory `time_scale`,
        what `sim up --speed` writes). A host's own measured start is its own pace: never scaled."""
        if time_scale == 1 or self.measured is not None:
            return self
        return replace(self, cold_s=self.cold_s / time_scale, time_scale=time_scale,
                       warm_s=None if self.warm_s is None else self.warm_s / time_scale)

    def as_dict(self) -> dict:
        return {"cold_s": round(self.cold_s, 1), "warm_s": None if self.warm_s is None else round(self.warm_s, 1)}

    def text(self, m: Manifest, what: str = "downtime") -> str:
        r = m.loading
        with_warm = f"{fmt_duration(self.warm_s)} with it" if self.warm_s is not None else \
            "unknown with it (the host's memory is unknown)"
        ms = self.measured
        if ms is not None:
            rates = ", ".join(f"{label} {v / MB:.0f} MB/s" for label, v in (("page cache", ms.cached_bytes_s),
                                                                             ("disk", ms.disk_bytes_s)) if v)
            return (f"expected {what}: {fmt_duration(self.cold_s)} without warming, {with_warm} ({fmt_bytes(self.total)} "
                    f"of weights; this host's last start of {m.name} ({ms.at}): {ms.other_s:.0f} s besides reading "
                    f"the weights" + (f", {rates}" if rates else "") + "; the rest manifest loading.*)")
        other = f"{r.other_seconds:g} s of compile and graphs" if r.other_seconds else \
            "compile and graphs not declared (loading.other_seconds)"
        scaled = "" if self.time_scale == 1 else (
            f"; this host loads {self.time_scale:g}x faster than that (inventory time_scale: SIMULATED), "
            f"{fmt_duration(self.cold_s * self.time_scale)} without warming in the field")
        return (f"expected {what}: {fmt_duration(self.cold_s)} without warming, {with_warm} "
                f"({fmt_bytes(self.total)} of weights at {r.disk_mb_s:g} MB/s from disk or {r.cached_mb_s:g} MB/s "
                f"from the page cache, + {other}; manifest loading.*{scaled})")


def expected(m: Manifest, total: int, cached_now: int, b: Budget | None, weights: int | None = None,
             measured: Measured | None = None) -> Expected:
    """Expected load times from the files' bytes (`total`, what the page cache holds) and, when the
    index states it, the checkpoint's tensor bytes (`weights`, what vLLM loads: a simulated host's
    index keeps the real size of its scaled files); `measured`: this host's last start of it."""
    load = weights or total
    share = load / total if total else 1.0
    cold = load_seconds(m, load, int(cached_now * share), measured)
    if b is None:
        return Expected(cold, None, load, cached_now, None, measured)
    after = min(total, max(cached_now, b.budget))
    return Expected(cold, load_seconds(m, load, int(after * share), measured), load, cached_now, after, measured)


def model_bytes(inp: PlanInput, facts: WarmFacts | None) -> tuple[int, int, int | None]:
    """(file bytes, cached now, tensor bytes per the index): from the warm survey, else (not
    downloaded yet) the download's total with nothing cached."""
    if facts is not None and facts.files:
        return facts.total_bytes, facts.cached_bytes, facts.weights_bytes
    return (inp.download.total_bytes if inp.download else 0), 0, None


# load_format values whose reads go through the page cache: vLLM's default safetensors loader (mmap,
# model_executor/model_loader/default_loader.py), and fastsafetensors without GPUDirect Storage.
PAGE_CACHE_LOADERS = (None, "auto", "safetensors", "pt", "fastsafetensors")


def loader_bypass(m: Manifest) -> str | None:
    """Why the page-cache warm-up would not help the manifest's loader (None: it reads through the
    page cache). fastsafetensors: vLLM 0.33 asks for GPUDirect Storage only when its process group
    is one rank (model_loader/weight_utils.py: `nogds = pg.size() > 1`), and GDS opens the files
    O_DIRECT for cuFileRead (fastsafetensors/cpp/ext.cpp, raw_gds_file_handle); its nogds reader uses
    mmap or pread, through the page cache. Other loaders (runai_streamer, instanttensor, tensorizer,
    ...) read with their own engines, not checked here: not warmed, rather than warmed for nothing."""
    fmt = m.vllm.load_format
    if fmt == "fastsafetensors" and m.vllm.tensor_parallel_size * m.vllm.pipeline_parallel_size == 1:
        return ("load_format fastsafetensors on one rank reads with GPUDirect Storage when the host has it "
                "(O_DIRECT, past the page cache)")
    if fmt not in PAGE_CACHE_LOADERS:
        return (f"load_format {fmt} reads the weights with its own engine, which vllm-orch has not checked "
                f"uses the page cache")
    return None


def warm_step(inp: PlanInput, model_dir: str, *, before: str, what: str = "downtime",
              reserve: tuple[int, str] | None = None) -> tuple[Action, Expected]:
    """The warm step (a no-op with the reason when nothing is to be done) and the expected
    downtimes. `before`: what the warm-up precedes ("kimi-k25-int4 stops", "the start");
    `what`: what the estimate is of ("downtime" for a swap, "start-up" for a deploy)."""
    m, entry, facts = inp.target.manifest, inp.entry, inp.warm
    b = budget_for(inp.facts.memory, m, entry, reserve)
    total, cached_now, weights = model_bytes(inp, facts)
    exp = expected(m, total, cached_now, b, weights, inp.measured).on_host(entry.time_scale)
    estimate = exp.text(m, what)
    if not inp.opts.warm:
        return Action("warm", f"nothing to do, because warming is off (--no-warm); {estimate}", noop=True), exp
    bypass = loader_bypass(m)
    if bypass:
        return Action("warm", f"nothing to do, because {bypass}; {estimate}", noop=True), exp
    if facts is not None and facts.error:
        return Action("warm", f"nothing to do, because the weight files could not be surveyed ({facts.error}); "
                              f"{estimate}", noop=True), exp
    if b is None:
        return Action("warm", f"nothing to do, because the host's available memory is unknown "
                              f"({entry.meminfo}); {estimate}", noop=True), exp
    mem = f"{fmt_bytes(b.total)} RAM, {fmt_bytes(b.available)} available"
    keep = (f"keeps free {fmt_bytes(b.need)} for {m.name}'s CPU side ({b.need_source}) + {fmt_bytes(b.margin)} "
            f"(10% of available, vLLM's own 90% rule): stops before available memory, net of the warmed pages, "
            f"falls under {fmt_bytes(b.floor)}; reads at most {m.loading.warm_max_mb_s:g} MB/s")
    if total and cached_now >= total:
        return Action("warm", f"nothing to do, because all {fmt_bytes(total)} of {m.name}'s weights are in the "
                              f"page cache already ({mem})", noop=True, details=[estimate]), exp
    if b.budget <= cached_now:
        return Action("warm", f"nothing to do, because the host has no memory to spare for it ({mem}; "
                              f"{fmt_bytes(b.need + b.margin)} stays free)", noop=True, details=[keep, estimate]), exp
    target = min(total, b.budget) if total else b.budget
    order = (f"in vLLM's load order: {len(facts.files)} weight files, {facts.files[0][0]} first"
             if facts is not None and facts.files else "in vLLM's load order (files not downloaded yet)")
    already = f"; {fmt_bytes(cached_now)} cached already" if cached_now else ""
    details = [order + already, keep, estimate]
    if m.vllm.safetensors_load_strategy == "prefetch":
        details.append("vllm.safetensors_load_strategy is prefetch: once it starts loading, vLLM also reads "
                       "the files into the page cache itself (in background threads, after the stop)")
    rate = m.loading.warm_max_mb_s * MB
    shown = scripts.command(entry.python, SCRIPT, warm_args(model_dir, meminfo=entry.meminfo, budget=b.budget,
                                                            floor=b.floor, rate=rate))
    of = f" of {fmt_bytes(total)}" if total else ""

    def run(env: RunEnv) -> str:
        return _run(env, model_dir, b, rate, target, m.name)

    return Action("warm", f"warm {fmt_bytes(target)}{of} into the page cache before {before}: {mem}",
                  details=details, commands=[shown], run=run), exp


def _run(env: RunEnv, model_dir: str, b: Budget, rate: float, target: int, label: str) -> str:
    try:
        with env.progress("warm", f"warm {label}", target) as progress:
            done = run_warm(env.host, env.entry.python, model_dir, meminfo=env.entry.meminfo, budget=b.budget,
                            floor=b.floor, rate=rate, on_event=progress.handle if progress else None)
    except DeployFailed as err:            # an optimisation that failed: the load reads from disk
        env.record.warm = WarmResult(error=err.message)
        return f"{err.message}; the load reads from disk"
    res = WarmResult(warmed_bytes=int(done.get("warmed_bytes") or 0), cached_bytes=int(done.get("cached_bytes") or 0),
                     total_bytes=int(done.get("total_bytes") or 0), seconds=float(done.get("seconds") or 0),
                     reason=str(done.get("reason") or ""), min_headroom=done.get("min_headroom"))
    env.record.warm = res
    return result_line(res)


def result_line(res: WarmResult) -> str:
    rate = f" ({res.warmed_bytes / res.seconds / MB:.0f} MB/s)" if res.seconds > 0 and res.warmed_bytes else ""
    return (f"read {fmt_bytes(res.warmed_bytes)} in {fmt_duration(res.seconds)}{rate}; {fmt_bytes(res.cached_bytes)} "
            f"of {fmt_bytes(res.total_bytes)} cached: {REASONS.get(res.reason, res.reason)}")


def history_fields(record: RunRecord, model: str, exp: dict | None) -> dict:
    """What a swap's or deploy's history record keeps about loading: the expected times without
    and with warming, what the warm-up did, and the measured weight-loading time (vLLM's log, from
    "Loading safetensors checkpoint shards" to "Loading weights took"), so that `vllm-orch history`
    shows what the warm-up saved."""
    out: dict = {}
    if exp:
        out["expected_s"] = exp
    if record.warm is not None:
        out["warm"] = record.warm.as_dict()
    ready = record.ready.get(model)
    if ready is not None:
        at = dict(reversed(ready.phases))               # each phase's first time
        if "loading weights" in at and "weights loaded" in at:
            out["weights_s"] = round(at["weights loaded"] - at["loading weights"], 2)
    ledger = startup_ledger(record, model)
    if ledger:
        out["startup"] = ledger
    return out


def startup_ledger(record: RunRecord, model: str) -> dict:
    """The run's start-up ledger for `model` (history's `startup`): vllm-orch's download and page-cache
    warm-up, then the start's phases from vLLM's own lines (probe/readiness.start_ledger)."""
    out: dict = {}
    if record.download is not None:
        out["download_s"] = round(record.download.seconds, 2)
    if record.warm is not None:
        out["warm_s"] = round(record.warm.seconds, 2)
    ready = record.ready.get(model)
    if ready is not None:
        out.update(ready.ledger)
        out["ready_s"] = round(ready.seconds, 2)
    return out
