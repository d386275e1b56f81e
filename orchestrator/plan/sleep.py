"""Sleep mode's steps, pure to plan (their work is bound `run` callables): put a service to sleep,
read what it keeps on its GPUs, wake it, check it against its canary, warm it up; the room an awake
service needs beside sleeping ones; whether host RAM holds a level-1 sleep.

vLLM 0.33 (entrypoints/serve/dev/sleep/api_router.py, v1/executor/abstract.py): `POST /sleep?level=1`
copies the weights to pinned host RAM and frees the GPUs but for a CUDA context each; level 2 drops
the weights too; `POST /wake_up` maps everything back in the same process, without a new start,
compile or graph capture. After level 2 the weights come back EMPTY (cumem restores only what it
backed up): api.wake wakes the weights' tag, has every worker read the checkpoint again
(`collective_rpc("reload_weights")`), then wakes the KV cache, as vLLM's own restore does
(vllm/snapshot/server.py). The endpoints exist only with VLLM_SERVER_DEV_MODE=1
(the manifest's `sleep` section renders it, on loopback only: docs/security.md).

A wake is trusted only after its canary: the greedy completion recorded when the service first
became ready must come back token for token (corrupted weights after a wake were seen in the
field). Then one warm-up request (the first after a wake is several times slower). GPU memory a
sleeping service holds is read after each sleep and compared with the CUDA-context allowance; what
it grows over cycles (vllm issue #36651) is recorded, and past LEAK_BOUND_MIB the next wake restarts
the service cold instead.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.errors import DeployFailed, RefusedError
from orchestrator.fmt import fmt_bytes
from orchestrator.host import state
from orchestrator.host.facts import HostFacts, gather
from orchestrator.host.ownership import SERVICE, gpu_list, wait_released
from orchestrator.host.records import Asleep, Canary, ServiceRecord
from orchestrator.host.services import Service
from orchestrator.plan.inputs import ServiceInput
from orchestrator.plan.model import Action
from orchestrator.plan.run import RunEnv
from orchestrator.plan.warm import MARGIN_PCT
from orchestrator.probe import api, keyed
from orchestrator.probe.readiness import wait_ready

CONTEXT_ALLOWANCE_MIB = 1024    # what a sleeping worker may keep per GPU: its CUDA context (~0.5 GiB
                                # on an H100/B200, vLLM's "memory is still in use" line) and NCCL's;
                                # plus its CUDA-graph pool (`allowance_mib`): vLLM 0.33 keeps the
                                # graphs on the GPU through a sleep unless --sleep-mode-offload-cudagraph
START_CONTEXT_MIB = 768         # the CUDA context a starting process takes before vLLM's memory check
OFFLOAD_GRAPHS = "--sleep-mode-offload-cudagraph"
LEAK_BOUND_MIB = 4096           # growth over cycles past which the next wake is a cold restart


def graph_pool_mib(ledger: Mapping[str, float], argv: Collection[str]) -> int | None:
    """MiB per GPU a sleeping process of this start keeps for its CUDA graphs: what capture took
    (vLLM's "Graph capturing finished in N secs, took X GiB", probe/logsig.LEDGER `graphs_gib`), 0
    when the graphs are offloaded with the rest (--sleep-mode-offload-cudagraph: config/model.py
    sleep_mode_offload_cudagraph, vllm/config/vllm.py use_cumem_cudagraph_pool), None when the start
    logged no capture (vllm-orch then allows the context alone)."""
    if OFFLOAD_GRAPHS in argv:
        return 0
    gib = ledger.get("graphs_gib")
    return None if gib is None else int(round(float(gib) * 1024))


def allowance_mib(rec: ServiceRecord | None) -> int:
    """What the service of record `rec` may keep per GPU asleep: a CUDA context and NCCL's buffers,
    and its CUDA-graph pool when its start logged one (`graph_pool_mib`)."""
    return CONTEXT_ALLOWANCE_MIB + ((rec.graph_pool_mib or 0) if rec is not None else 0)


def _endpoint(env: RunEnv, svc: ServiceInput) -> api.Endpoint:
    """Sleep mode's endpoints (outside vLLM's guarded prefixes): no key."""
    return api.Endpoint(env.host, svc.manifest.serving.port)


def _keyed(env: RunEnv, svc: ServiceInput) -> api.Endpoint:
    """The endpoint for the canary (/v1/completions): with the key once the listener is proven the
    service's (probe/keyed.py); keyed.ForeignListener, an HttpError, otherwise."""
    return keyed.endpoint(env.host, env.entry, svc.name, svc.manifest.serving.port, svc.api_key)


def held_mib(facts: HostFacts, name: str) -> dict[int, int]:
    """MiB the service NAME's processes hold per GPU (nvidia-smi, by the ownership rule)."""
    out: dict[int, int] = {}
    for p in facts.procs:
        if p.kind == SERVICE and p.model == name and p.gpu_index is not None:
            out[p.gpu_index] = out.get(p.gpu_index, 0) + p.used_mib
    return out


def weights_bytes(facts: HostFacts, svc: ServiceInput) -> int:
    folder = facts.models.get(svc.folder)
    return folder.bytes if folder is not None else 0


# PyTorch's pinned host allocator (CachingHostAllocator) rounds each block up to a power of two, and
# cumem backs up each GPU allocation with a block of its own (device_allocator/cumem.py sleep): a
# fused MoE expert tensor per layer and rank. Kimi-K2.5 at TP8: ~672 and ~336 MiB per rank, pinned as
# 1 GiB and 512 MiB, about 1.5x the weights. The estimate until a host has measured a sleep of it.
PIN_ROUNDING = 1.5


def pin_need(facts: HostFacts, svc: ServiceInput) -> tuple[int, str]:
    """Host RAM a level-1 sleep of `svc` pins beyond what its process pins already, and why: none
    when its process slept at level 1 before (same main PID: its blocks stay cached), the measured figure of its
    first level-1 sleep when there is one, else the weights x PIN_ROUNDING."""
    rec, size = facts.record(svc.name), weights_bytes(facts, svc)
    st = facts.services.get(svc.name)
    if rec is not None and rec.sleep_pinned_pid and st is not None and st.main_pid == rec.sleep_pinned_pid:
        held = rec.sleep_pinned_bytes or size
        return 0, (f"its process keeps the {fmt_bytes(held)} its first level-1 sleep pinned (PyTorch caches "
                   f"pinned blocks): it pins nothing more")
    if rec is not None and rec.sleep_pinned_bytes:
        return rec.sleep_pinned_bytes, (f"{fmt_bytes(rec.sleep_pinned_bytes)} pinned, as its first level-1 sleep "
                                        f"measured for {fmt_bytes(size)} of weights")
    pinned = int(size * PIN_ROUNDING)
    return pinned, (f"{fmt_bytes(size)} of weights pinned as ~{fmt_bytes(pinned)} (estimated: PyTorch rounds each "
                    f"pinned block up to a power of two, {PIN_ROUNDING:g}x for fused MoE experts; its first sleep "
                    f"measures it)")


def level_for(facts: HostFacts, svc: ServiceInput, need_bytes: int) -> tuple[int, str, int]:
    """The level to sleep `svc` at, why, and the host RAM that sleep pins: the manifest's level, but
    level 1 only when host RAM holds what it pins (`pin_need`: outside MemAvailable once pinned)
    above the memory floor (10% of MemAvailable, as the warm-up keeps, plus `need_bytes`: what the
    service that comes up takes on the CPU side). The warm-up of that service is budgeted net of
    the pinned bytes (the pinning evicts the page cache it warmed)."""
    m = svc.manifest
    assert m.sleep is not None
    if m.sleep.level == 2:
        return 2, "the manifest's level", 0
    mem = facts.memory
    if mem is None or mem.available is None:
        return 2, "level 1 needs the host's free RAM, which could not be read: level 2 (weights dropped)", 0
    pinned, how = pin_need(facts, svc)
    room = mem.available - mem.available * MARGIN_PCT // 100 - need_bytes
    if pinned > room:
        return 2, (f"level 1 would pin {fmt_bytes(pinned)} of host RAM ({how}), and {fmt_bytes(max(room, 0))} is "
                   f"free above the memory floor ({fmt_bytes(mem.available)} available - 10% - "
                   f"{fmt_bytes(need_bytes)} for the service that comes up): level 2 instead (weights dropped, a "
                   f"wake reads them again)"), 0
    return 1, f"{how}; {fmt_bytes(room)} free above the memory floor", pinned


def room_refusal(facts: HostFacts, m: Manifest, host: str, awake_too: Collection[str] = (),
                 expect: Mapping[str, int] | None = None) -> RefusedError | None:
    """An awake service beside sleeping ones on its GPUs: its gpu_memory_utilization share of each
    GPU plus what the sleeping ones hold there must fit (vLLM's start-up check compares its share
    with the free memory: "Free memory on device ... is less than desired GPU memory utilization").
    `awake_too`: services that hold the GPUs now but go before it starts (not counted); `expect`:
    services this operation puts to sleep first, with the MiB per GPU each is expected to keep."""
    expect = dict(expect or {})
    sleeping = (facts.sleeping() - set(awake_too) - {m.name}) | set(expect)
    if not sleeping:
        return None
    totals = {g.index: g.memory_total_mib for g in facts.gpus if g.memory_total_mib}
    held: dict[int, int] = {}
    for name in sleeping:
        if name in expect:
            placed = facts.placement(name, host)
            kept = {g: expect[name] for g in (placed.gpus if placed else ())}
        else:
            kept = held_mib(facts, name)
        for gpu, mib in kept.items():
            held[gpu] = held.get(gpu, 0) + mib
    util = m.vllm.gpu_memory_utilization
    for gpu in m.serving.visible_devices:
        total, there = totals.get(gpu), held.get(gpu, 0)
        if total and there and util * total + there + START_CONTEXT_MIB > total:
            most = (total - there - START_CONTEXT_MIB) / total
            return RefusedError(
                f"{m.name} asks for {util:g} of GPU {gpu} ({total} MiB) and the sleeping "
                f"{', '.join(sorted(sleeping))} keep{'s' if len(sleeping) == 1 else ''} {there} MiB there, and its own "
                f"CUDA context takes about {START_CONTEXT_MIB} MiB before vLLM's start-up memory check, which would "
                f"fail", host=host, step="placement",
                hint=f"set vllm.gpu_memory_utilization to {int(most * 100) / 100:g} or less, or stop the sleeping "
                     f"service first")
    return None


def awake_beside(facts: HostFacts, name: str) -> tuple[list[str], list[int]]:
    """(the awake services on the GPUs of NAME, those GPUs): what a start of NAME would meet there."""
    rec = facts.record(name)
    gpus = set(rec.gpus) if rec is not None else set()
    shared: set[int] = set()
    names = []
    for other in facts.running():
        orec = facts.record(other)
        if other == name or facts.asleep(other) is not None or orec is None or not gpus & set(orec.gpus):
            continue
        names.append(other)
        shared |= gpus & set(orec.gpus)
    return sorted(names), sorted(shared)


def asleep_refusal(facts: HostFacts, name: str, host: str, doing: str) -> RefusedError | None:
    """NAME sleeps on the host: `doing` (a deploy) must not start, restart or probe it (it would come
    up awake beside the awake service on its GPUs, and a request to it waits for a wake): refused
    (exit 3) with the swap that wakes it."""
    asleep = facts.asleep(name)
    if asleep is None:
        return None
    awake, gpus = awake_beside(facts, name)
    beside = f" beside {', '.join(awake)} on {gpu_list(gpus)} (one awake service per GPU)" if awake else ""
    return RefusedError(
        f"{name} is asleep on {host} ({asleep.where()}): {doing} does not start or restart a sleeping service, "
        f"which would come up awake{beside}", host=host, step="sleep",
        hint=f"`vllm-orch swap {name} --host {host}` wakes it" + (
            f" ({awake[0]} sleeps with --sleep-old, or stops)" if awake else "")
        + f"; `vllm-orch stop {name} --host {host}` first to start it cold")


def next_sleep_mib(facts: HostFacts, name: str) -> tuple[int, str]:
    """(MiB per GPU the awake service NAME is expected to keep after its next sleep, why): what it
    kept after its last one plus its growth per cycle so far; the CUDA-context allowance when it
    never slept since its start."""
    rec = facts.record(name)
    allow = allowance_mib(rec)
    if rec is None or rec.sleep_last_mib is None or rec.sleep_first_mib is None or not rec.sleep_cycles:
        return allow, f"the {allow} MiB allowance (CUDA context{' and graph pool' if allow > CONTEXT_ALLOWANCE_MIB else ''})"
    per = (rec.sleep_last_mib - rec.sleep_first_mib) // max(rec.sleep_cycles - 1, 1)
    want = max(allow, rec.sleep_last_mib + max(per, 0))
    return want, (f"{rec.sleep_last_mib} MiB after its last sleep" + (f", growing {per} MiB per cycle over "
                                                                      f"{rec.sleep_cycles}" if per > 0 else ""))


def sleep_or_stop(facts: HostFacts, old: ServiceInput, awake: Manifest, host: str) -> tuple[bool, str]:
    """Whether the awake service `old` may sleep beside `awake` (which comes up on its GPUs): what it
    is expected to keep must leave `awake` its memory share, and its growth stay under the bound;
    else it is stopped (its next start is cold) and the plan says why."""
    rec = facts.record(old.name)
    if rec is not None and rec.sleep_first_mib is not None and rec.sleep_last_mib is not None \
            and rec.sleep_last_mib - rec.sleep_first_mib > LEAK_BOUND_MIB:
        return False, (f"{old.name} kept {rec.sleep_last_mib - rec.sleep_first_mib} MiB more per GPU after its last "
                       f"sleep than after its first, over the {LEAK_BOUND_MIB} MiB bound (vllm #36651): stopped "
                       f"instead of put to sleep (its next start is cold)")
    want, why = next_sleep_mib(facts, old.name)
    refusal = room_refusal(facts, awake, host, awake_too={old.name}, expect={old.name: want})
    if refusal is not None:
        return False, (f"{old.name} would keep about {want} MiB per GPU asleep ({why}), which leaves "
                       f"{awake.name} too little: stopped instead of put to sleep")
    return True, why


def record_sleep(env: RunEnv, name: str, level: int, weights: int, first_check: bool = False,
                 available_before: int | None = None) -> tuple[int, int, int, int]:
    """Read what the service NAME keeps on its GPUs after a sleep (nvidia-smi, by the ownership rule)
    and record it asleep: (MiB kept on its fullest GPU, its cycles, its growth since its first sleep,
    the allowance it was measured against: `allowance_mib`).
    `first_check`: a first sleep that kept about everything freed nothing (no --enable-sleep-mode).
    `available_before`: MemAvailable just before a level-1 sleep that pinned new blocks: the drop
    is what it pinned (recorded, at least the weights)."""
    facts = gather(env.host, env.entry, [name])
    held = held_mib(facts, name)
    most = max(held.values(), default=0)
    rec = facts.record(name)
    cycles = ((rec.sleep_cycles or 0) if rec is not None else 0) + 1
    first = most if rec is None or rec.sleep_first_mib is None else rec.sleep_first_mib
    growth = max(0, most - first)
    allow = allowance_mib(rec)
    if first_check and cycles == 1 and most > allow + LEAK_BOUND_MIB:
        raise DeployFailed(f"{name} still holds {most} MiB per GPU after /sleep (a CUDA context and its graph pool "
                           f"are about {allow} MiB): sleep mode freed nothing", host=env.entry.name,
                           step="sleep", hint="is --enable-sleep-mode in its command line (`vllm-orch regen "
                                              "--restart`)?")
    asleep = Asleep(level=level, since=state.now_iso(), weights_bytes=weights if level == 1 else 0,
                    gpu_mib={str(g): v for g, v in sorted(held.items())}, allowance_mib=allow,
                    cycles=cycles, first_mib=first, growth_mib=growth)
    pinned: dict = {}
    if level == 1:
        st = facts.services.get(name)
        pinned["sleep_pinned_pid"] = st.main_pid if st is not None else None
        after = facts.memory.available if facts.memory is not None else None
        if available_before is not None and after is not None:
            pinned["sleep_pinned_bytes"] = max(available_before - after, weights)
            env.record.sleeps.setdefault(name, {})["pinned_bytes"] = pinned["sleep_pinned_bytes"]
    state.update_record(env.host, env.entry, name, asleep=asleep, sleep_cycles=cycles, sleep_first_mib=first,
                        sleep_last_mib=most, **pinned)
    return most, cycles, growth, allow


def sleep_action(entry: HostEntry, svc: ServiceInput, level: int, why: str, *, downtime_starts: bool = False,
                 weights: int = 0, swap_to: str | None = None, to_wakes: bool = False) -> Action:
    """POST /sleep?level=N, then read what the service keeps on its GPUs and record it asleep (its
    cycles, and how much more it keeps than after its first sleep). `swap_to`: the sleep begins a
    swap to that service (woken: `to_wakes`, else started), so the host first records the swap as
    half done (state_dir/swap.json, as the ordinary swap's stop does). A service that sleeps already
    (a run cut short put it to sleep) is not put to sleep again: recorded asleep if its record does
    not say so."""
    name = svc.name
    drain_s = svc.manifest.vllm.shutdown_timeout      # the drain a stop gives its requests, the same here

    def run(env: RunEnv) -> str:
        if swap_to is not None:
            state.write_swap(env.host, env.entry, name, swap_to, False, from_sleeps=True, to_wakes=to_wakes)
        if downtime_starts:
            env.record.stopped_at = time.monotonic()
        ep = _endpoint(env, svc)
        if api.is_sleeping(ep):
            rec = state.read_record(env.host, env.entry, name)
            if rec is not None and rec.asleep is not None:
                return f"{name} is asleep already (level {rec.asleep.level})"
            most, _cycles, _growth, _allow = record_sleep(env, name, level, weights)
            return f"{name} was asleep already (a run cut short put it to sleep): recorded, keeping {most} MiB per GPU"
        before = None
        if level == 1:       # a first level-1 sleep of this process: what it pins is measured
            now = gather(env.host, env.entry, [name])
            if pin_need(now, svc)[0]:
                before = now.memory.available if now.memory is not None else None
        t0 = time.monotonic()
        try:
            aborted = drain_then_sleep(ep, level, drain_s)
        except api.HttpError as exc:
            raise DeployFailed(f"{name} did not go to sleep: {exc}", host=env.entry.name, step="sleep",
                               hint="a level-1 sleep pins host RAM: if it ran short, the engine died in "
                                    "the middle of the sleep (its log says \"out of memory\")"
                                    if level == 1 else None) from None
        seconds = time.monotonic() - t0
        env.record.sleeps[name] = {}
        most, cycles, growth, allow = record_sleep(env, name, level, weights, first_check=True, available_before=before)
        env.record.sleeps[name].update({"level": level, "seconds": round(seconds, 3), "gpu_mib": most,
                                        "cycles": cycles, "growth_mib": growth, "aborted": aborted})
        over = f"; {growth} MiB more than after its first sleep ({cycles} cycles)" if growth else ""
        if most > allow:
            env.record.warnings.append(f"{name} keeps {most} MiB per GPU asleep, over the {allow} "
                                       f"MiB allowance (CUDA context, NCCL and its graph pool){over}")
        if aborted:
            env.record.warnings.append(f"{name}: {aborted} request{'s' if aborted != 1 else ''} still running after "
                                       f"the {drain_s} s drain {'were' if aborted != 1 else 'was'} aborted by its sleep")
        drained = ("its requests in flight drained first" if aborted == 0 else
                   f"{aborted} aborted after the {drain_s} s drain" if aborted else "aborted requests unknown")
        return (f"{name} asleep at level {level} in {seconds:.1f}s ({drained}); it keeps {most} MiB per GPU "
                f"(allowance {allow}){over}")

    details = [f"first records the swap to {swap_to} as under way in {entry.state_dir}/swap.json"] if swap_to else []
    return Action("sleep", f"put {name} to sleep at level {level} ({why})", run=run,
                  details=[*details, f"POST http://127.0.0.1:{svc.manifest.serving.port}/sleep?level={level}&mode=wait "
                                     f"(its requests in flight finish first, new ones queue; nothing if it sleeps "
                                     f"already), after {drain_s} s mode=abort (vllm.shutdown_timeout, the stop's drain)",
                           "then read what it keeps on its GPUs (nvidia-smi) and record it asleep"], subject=name)


def room_action(m: Manifest, why: str) -> Action:
    """Wait until the service's GPUs hold nothing but sleeping services' contexts (the stopped or
    slept service's memory released)."""
    gpus = m.serving.visible_devices

    def run(env: RunEnv) -> str:
        facts = gather(env.host, env.entry, [m.name])
        sleepers = facts.sleeping() | {m.name}
        kept = [p for p in facts.procs if p.kind == SERVICE and p.model in sleepers]
        return wait_released(env.host, env.entry, gpus, env.opts.gpu_release_timeout_s, env.opts.poll_s,
                             asleep=kept)

    return Action("gpus", f"check that {gpu_list(gpus)} are free but for sleeping services ({why})", run=run)


def wake_action(entry: HostEntry, svc: ServiceInput, why: str, *, marks_ready: bool = True,
                cold_fallback: bool = False, budget_s: float | None = None) -> Action:
    """POST /wake_up, the canary token for token, one warm-up request; the service's record says it
    serves again. Past LEAK_BOUND_MIB of growth over its cycles it is restarted cold instead (and its
    canary recorded anew). `cold_fallback` (a rollback's last resort): a failed wake or canary
    restarts it cold too."""
    m, name, key = svc.manifest, svc.name, svc.api_key
    shown = Service.for_host(None, entry, name)

    def cold(env: RunEnv, reason: str) -> str:
        service = Service.for_host(env.host, env.entry, name)
        service.run_all(shown.stop_commands(False), f"stop {name}", timeout=600)
        cursor = service.log_cursor()
        service.run_all(shown.start_commands(), f"start {name}", timeout=600)
        env.record.started.add(name)
        ready = wait_ready(env.host, service, m, cursor, on_event=env.event, budget_s=budget_s or m.startup.budget_seconds,
                           no_progress_s=env.opts.no_progress_s, poll_s=env.opts.poll_s, api_key=key)
        env.record.ready[name] = ready
        state.update_record(env.host, env.entry, name, asleep=None, sleep_cycles=None, sleep_first_mib=None,
                            sleep_last_mib=None, canary=canary_of(env, svc),
                            graph_pool_mib=graph_pool_mib(ready.ledger, svc.rendered.argv))
        if marks_ready:
            env.record.ready_at = time.monotonic()
        env.record.wakes[name] = {"cold": True, "reason": reason}
        return f"restarted {name} cold ({reason}); smoke: {ready.smoke.summary()}"

    def run(env: RunEnv) -> str:
        rec = state.read_record(env.host, env.entry, name)
        asleep = rec.asleep if rec is not None else None
        if asleep is not None and asleep.growth_mib > LEAK_BOUND_MIB:
            return cold(env, f"it kept {asleep.growth_mib} MiB more per GPU after {asleep.cycles} sleeps than after "
                             f"its first, over the {LEAK_BOUND_MIB} MiB bound (vllm #36651)")
        ep = _endpoint(env, svc)
        level = asleep.level if asleep is not None else None
        t0 = time.monotonic()
        try:
            reload_s = api.wake(ep, level, float(budget_s or m.startup.budget_seconds), on_reload=lambda: env.event(
                "phase", f"{name}: its weights mapped back, reading them again from the checkpoint (level "
                         f"{level or 'not known'}: the sleep kept no copy)"))
            wake_s = time.monotonic() - t0
            got = canary_of(env, svc)
            want = rec.canary if rec is not None else None
            if want is not None and not same_answer(want, got):
                raise DeployFailed(f"{name} woke with other answers: its canary gave {got.text[:60]!r} where it "
                                   f"gave {want.text[:60]!r} when it first became ready (corrupted weights after "
                                   f"the wake)", host=env.entry.name, step="wake")
            t1 = time.monotonic()
            api.canary(_keyed(env, svc), m.served_name)     # the warm-up request (the first after a wake is slow)
            warm_s = time.monotonic() - t1
        except (api.HttpError, DeployFailed) as exc:
            if not cold_fallback:
                if isinstance(exc, DeployFailed):
                    raise
                raise DeployFailed(f"{name} did not wake: {exc}", host=env.entry.name, step="wake") from None
            return cold(env, f"the wake failed: {exc}")
        # woken for the first time since vllm-orch records canaries: this answer is its canary
        state.update_record(env.host, env.entry, name, asleep=None, **({} if want is not None else {"canary": got}))
        if marks_ready:
            env.record.ready_at = time.monotonic()
        env.record.wakes[name] = {"wake_s": round(wake_s, 3), "warmup_s": round(warm_s, 3),
                                  "canary": "match" if want is not None else "recorded",
                                  "level": level, "reload_s": round(reload_s, 3)}
        reread = f" (its weights read again in {reload_s:.1f}s)" if level != 1 else ""
        return (f"{name} awake in {wake_s:.1f}s{reread}; canary {'matches token for token' if want else 'recorded'}; "
                f"warm-up request {warm_s:.2f}s")

    details = [f"POST http://127.0.0.1:{m.serving.port}/wake_up (level 1); after a level-2 sleep /wake_up?tags=weights, "
               f"POST /collective_rpc reload_weights (the checkpoint read again), /wake_up?tags=kv_cache; then the "
               f"canary (a greedy completion, token for token as recorded at its first ready) and one warm-up request"]
    if cold_fallback:
        details.append(f"if the wake or the canary fails: restart {name} cold (the last resort)")
    return Action("wake", f"wake {name} ({why})", run=run, details=details, subject=name)


def drain_then_sleep(ep: api.Endpoint, level: int, drain_s: int) -> int | None:
    """Put the engine to sleep without cutting its requests: /sleep in mode "wait" (vLLM 0.33's
    default, "abort", ends the requests in flight at once: serve/dev/sleep/api_router.py), and when
    it has not answered within `drain_s` (or `drain_s` is 0), again in mode "abort", which ends what
    still runs, and with it the waiting sleep. The requests the sleep aborted, from the server's
    vllm:request_success_total{finished_reason="abort"} (None when that series cannot be read)."""
    before = api.aborted_requests(ep)
    if drain_s:
        try:
            api.sleep(ep, level, "wait", timeout=float(drain_s))
        except api.HttpTimeout:
            api.sleep(ep, level, "abort")
    else:
        api.sleep(ep, level, "abort")
    after = api.aborted_requests(ep)
    return None if before is None or after is None else int(after - before)


def resleep_action(entry: HostEntry, svc: ServiceInput, why: str) -> Action:
    """A rollback's: the service woken by this run goes back to sleep at level 2 (its weights are
    dropped and read again at its next wake: a corrupted copy does not survive); stopped when even
    that fails."""
    name = svc.name
    shown = Service.for_host(None, entry, name)

    def run(env: RunEnv) -> str:
        try:
            api.sleep(_endpoint(env, svc), 2, "abort")      # it served nothing since its bad wake
        except api.HttpError as exc:
            Service.for_host(env.host, env.entry, name).run_all(shown.stop_commands(False), f"stop {name}",
                                                                timeout=600)
            state.write_record(env.host, env.entry, name, None)
            return f"{name} did not go back to sleep ({exc}): stopped"
        most, _cycles, _growth, _allow = record_sleep(env, name, 2, 0)
        return f"{name} asleep again at level 2, keeping {most} MiB per GPU (its weights are read again at its next wake)"

    return Action("sleep", f"put {name} back to sleep at level 2 ({why}; stopped if that fails)", run=run,
                  subject=name)


def canary_of(env: RunEnv, svc: ServiceInput) -> Canary:
    """The service's greedy answer to the canary prompt now (recorded at its first ready)."""
    ep = keyed.endpoint_for("canary", env.host, env.entry, svc.name, svc.manifest.serving.port, svc.api_key)
    text, ids, _ = api.canary(ep, svc.manifest.served_name)
    return Canary(prompt=api.CANARY_PROMPT, text=text, token_ids=ids, at=state.now_iso())


def same_answer(want: Canary, got: Canary) -> bool:
    """Token for token when both have their ids (vLLM's return_token_ids), else the text."""
    if want.token_ids is not None and got.token_ids is not None:
        return want.token_ids == got.token_ids and want.text == got.text
    return want.text == got.text
