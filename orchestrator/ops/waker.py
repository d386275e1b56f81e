"""On-demand wake (`vllm-orch gateway waker`, docs/gateway.md "On-demand wake"): a request for a
sleeping model of a wake group waits at the gateway (render/gateway.py hold.lua) while this loop
puts the group's awake model to sleep and wakes the named one, by the same sleep swap as `vllm-orch
swap MODEL --sleep-old` (its canary checked; a failure rolls back), so the host's records, history
and gateway steps are what any swap writes. With a TTL, a model of the group that gets no request
for that long is put to sleep.

The anti-thrash policy (`decide`, pure): a model woken here serves at least the group's
min_awake_seconds before another model's waiting requests may put it to sleep, unless it has no
request in flight or waiting; among sleeping models with waiting requests, the one with the most
goes first; a wake that failed (rolled back) waits FAILED_WAKE_PAUSE_S before it is tried again.
Requests wait at most gateway.hold_seconds, then get 503 + Retry-After. Two loads for two
models of one GPU set thus alternate at most once per min_awake_seconds (plus a swap), never per
request.

The loop reads the gateway's counters (one gateway_ctl.py call per poll, every worker summed) and
acts only through operations that take the host lock: while another operation holds it, the wake
waits for the next poll. It touches only the group's services: a wake whose GPUs an awake service
outside the group holds is not tried (said once).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from orchestrator.config.inventory import HostEntry, WakeGroup
from orchestrator.config.manifest import Manifest
from orchestrator.errors import ConfigError, Interrupted, OrchestratorError, RefusedError
from orchestrator.host import gateway as hg
from orchestrator.host import state
from orchestrator.host.connect import open_host
from orchestrator.plan.run import Options


@dataclass(frozen=True)
class Member:
    """A service of a wake group now: asleep or not, its requests at the gateway."""

    name: str
    asleep: bool
    waiting: int = 0        # held at the gateway (not yet sent to the service)
    inflight: int = 0       # sent to the service, not answered yet
    routed: int = 0         # routed to it since the gateway's workers started (a change: activity)

    @property
    def busy(self) -> bool:
        return self.waiting + self.inflight > 0


@dataclass
class Memory:
    """What the loop remembers between polls: when it woke each model, when each was last busy."""

    woke_at: dict[str, float] = field(default_factory=dict)
    active_at: dict[str, float] = field(default_factory=dict)
    routed: dict[str, int] = field(default_factory=dict)
    failed_at: dict[str, float] = field(default_factory=dict)     # its last wake failed (rolled back)

    def see(self, members: Mapping[str, Member], now: float) -> None:
        for m in members.values():
            if m.busy or self.routed.get(m.name) != m.routed:
                self.active_at[m.name] = now
            self.routed[m.name] = m.routed


def decide(group: WakeGroup, members: Mapping[str, Member], memory: Memory, now: float) -> tuple[str, str, str] | None:
    """("wake", NAME, why) or ("sleep", NAME, why) or None (pure: the anti-thrash policy above)."""
    awake = [m for m in members.values() if not m.asleep]
    wanting = sorted((m for m in members.values() if m.asleep and m.waiting > 0
                      and now - memory.failed_at.get(m.name, -math.inf) >= FAILED_WAKE_PAUSE_S),
                     key=lambda m: (-m.waiting, m.name))
    if wanting:
        want = wanting[0]
        why = f"{want.waiting} request{'s' if want.waiting != 1 else ''} wait for it"
        if not awake:
            return ("wake", want.name, why)
        cur = awake[0]
        served = now - memory.woke_at.get(cur.name, -math.inf)
        if not cur.busy:
            return ("wake", want.name, f"{why}; {cur.name} is idle")
        if served >= group.min_awake_seconds:
            return ("wake", want.name, f"{why}; {cur.name} served its {group.min_awake_seconds} s turn")
        return None
    if group.ttl_seconds:
        for m in awake:
            idle = now - memory.active_at.get(m.name, now)
            if not m.busy and idle >= group.ttl_seconds:
                return ("sleep", m.name, f"no request for {idle:.0f} s (ttl {group.ttl_seconds} s)")
    return None


def members_of(group: WakeGroup, backends: Mapping[str, dict], records: Mapping) -> dict[str, Member]:
    """The group's services that have a record, from the gateway's counters (gateway_ctl.py state)."""
    out = {}
    for name in group.services:
        rec = records.get(name)
        if rec is None:
            continue
        b = backends.get(f"svc_{name}", {})
        inflight, waiting = hg.load_of(b)
        out[name] = Member(name, rec.asleep is not None, waiting=waiting, inflight=inflight,
                           routed=int(b.get("routed", 0)))
    return out


def blocker(records: Mapping, group: WakeGroup, name: str) -> str | None:
    """An awake service outside the group on NAME's GPUs (the waker leaves it alone), or None."""
    mine = set(records[name].gpus) if name in records else set()
    for other, rec in sorted(records.items()):
        if other not in group.services and rec.asleep is None and mine & set(rec.gpus):
            return other
    return None


FAILED_WAKE_PAUSE_S = 60      # a wake that failed (and was rolled back) is not tried again sooner: its
                              # requests get 503 + Retry-After past the hold bound instead of a loop


Act = Callable[[str, str, str | None], tuple[bool, str]]


def run(entry: HostEntry, manifests: dict[str, Manifest], say: Callable[[str], None], *, poll_s: float = 0.25,
        act: Act | None = None, until: Callable[[], bool] = lambda: False, accept_new_host_key: bool = False) -> None:
    """The loop (until `until()`); `act(kind, name, replaces)` runs a wake or a sleep (default: the
    sleep swap, or the sleep of an idle one) and says (ok, what happened)."""
    groups = entry.gateway.wake_groups
    if not groups:
        raise ConfigError(f"{entry.name} has no gateway.wake_groups: nothing to wake on demand", host=entry.name,
                          hint="list the services the gateway may wake in hosts.yaml (docs/gateway.md "
                               "\"On-demand wake\")")
    for g in groups:
        for name in g.services:
            m = manifests.get(name)
            if m is None:
                raise ConfigError(f"wake group service {name} has no manifest in the models folder", host=entry.name)
            if m.sleep is None:
                raise ConfigError(f"wake group service {name} has no `sleep` section: it cannot sleep or wake",
                                  host=entry.name, hint=f"add `sleep: {{level: 1}}` to models/{name}.yaml")
    act = act or _default_act(entry, manifests, accept_new_host_key)
    memory = {id(g): Memory() for g in groups}
    said: set[str] = set()
    with open_host(entry, accept_new_host_key) as host:
        rec = hg.read_record(host, entry)
        if rec is None:
            raise RefusedError(f"{entry.name} runs no gateway", host=entry.name,
                               hint=f"vllm-orch gateway up --host {entry.name}")
        say(f"waking on demand on {entry.name}: " + "; ".join(
            f"{', '.join(g.services)} (min awake {g.min_awake_seconds} s, ttl {g.ttl_seconds or 'none'})"
            for g in groups))
        while not until():
            now = time.monotonic()
            try:
                backends = hg.state_of(host, entry, rec).get("backends", {})
                records = state.read_records(host, entry)
            except OrchestratorError as exc:
                if "state" not in said:
                    say(f"cannot read the gateway ({exc}); trying again")
                    said.add("state")
                time.sleep(max(poll_s, 1.0))
                continue
            said.discard("state")
            for g in groups:
                members = members_of(g, backends, records)
                mem = memory[id(g)]
                mem.see(members, now)
                choice = decide(g, members, mem, now)
                if choice is None:
                    continue
                kind, name, why = choice
                awake = next((m.name for m in members.values() if not m.asleep), None)
                if kind == "wake" and awake is None and (other := blocker(records, g, name)):
                    if f"blocked:{name}" not in said:
                        say(f"{name}: not woken, {other} (outside the wake group) serves on its GPUs")
                        said.add(f"blocked:{name}")
                    continue
                t0 = time.monotonic()
                ok, text = act(kind, name, awake if kind == "wake" else None)
                seconds = time.monotonic() - t0
                say(f"{'woke' if kind == 'wake' else 'put to sleep'} {name} ({why}): {text} [{seconds:.1f} s]"
                    if ok else f"{kind} {name} ({why}) did not happen: {text} [{seconds:.1f} s]")
                if ok and kind == "wake":
                    mem.woke_at[name] = time.monotonic()
                    mem.active_at[name] = time.monotonic()
                elif not ok and kind == "wake":
                    mem.failed_at[name] = time.monotonic()
                break                          # read the gateway again before the next choice
            time.sleep(poll_s)


def _default_act(entry: HostEntry, manifests: dict[str, Manifest], accept_new_host_key: bool) -> Act:
    from orchestrator.ops.execute import Reporter
    from orchestrator.ops.swap import run_swap

    def act(kind: str, name: str, replaces: str | None) -> tuple[bool, str]:
        try:
            if kind == "sleep":
                return _sleep_idle(entry, manifests, name, accept_new_host_key)
            result = run_swap(entry, manifests[name], manifests, Options(sleep_old=True, yes=True, replace=replaces),
                              Reporter(None, quiet=True), dry_run=False, accept_new_host_key=accept_new_host_key)
        except Interrupted:
            raise
        except OrchestratorError as exc:            # the lock held by another operation, the host gone...
            return False, exc.message
        if isinstance(result.error, Interrupted):  # Ctrl-C or SIGTERM stopped the swap (rolled back): stop too
            raise result.error
        if not result.ok:
            return False, result.error.message if result.error else "the swap failed"
        down = result.extra.get("downtime_s")
        return True, (f"{replaces} asleep, " if replaces else "") + f"{name} serves" + (
            f" (downtime {down:.2f} s)" if down is not None else "")

    return act


def _sleep_idle(entry: HostEntry, manifests: dict[str, Manifest], name: str,
                accept_new_host_key: bool) -> tuple[bool, str]:
    """Put NAME to sleep at its manifest's level: the gateway drains it first (plan/gateway.py)."""
    from orchestrator.host.facts import gather as read_facts
    from orchestrator.host.records import HistoryEntry
    from orchestrator.ops import gather
    from orchestrator.ops.execute import Reporter, run_plan
    from orchestrator.ops.session import session
    from orchestrator.plan import gateway, prepare
    from orchestrator.plan import sleep as sleep_steps
    from orchestrator.plan.model import Plan
    from orchestrator.plan.run import RunEnv

    m = manifests[name]
    assert m.sleep is not None                  # run() refused a group service without one
    t0 = time.monotonic()
    with session(entry, f"sleep {name} (idle)", False, accept_new_host_key) as s:
        facts = read_facts(s.host, entry, [name])
        if facts.asleep(name) is not None or name not in facts.records:
            return False, f"{name} is not awake"
        svc = gather.service_input(gather.HostReads(s.host, entry), entry, m, facts,
                                   gather.recorded_spec(m, entry, name, facts), True)
        level, why, _pinned = sleep_steps.level_for(facts, svc, 0)
        plan = Plan("sleep", entry.name, name)
        plan.add(prepare.lock_action(s.lock))
        plan.add(sleep_steps.sleep_action(entry, svc, level, f"idle past its ttl; {why}",
                                          weights=sleep_steps.weights_bytes(facts, svc)))
        plan = gateway.with_gateway(plan, gateway.read(s.host, entry), entry)
        outcome = run_plan(plan, RunEnv(s.host, entry, Options(yes=True), Reporter(None, quiet=True), guard=s.guard),
                           Reporter(None, quiet=True))
        if isinstance(outcome.error, Interrupted):
            raise outcome.error
        if s.holds_lock():
            state.append_history(s.host, entry, HistoryEntry(
                operation="sleep", model=name, service=name, ok=outcome.ok, seconds=round(time.monotonic() - t0, 2),
                error=str(outcome.error) if outcome.error else None))
        return outcome.ok, (f"asleep at level {level}" if outcome.ok else
                            outcome.error.message if outcome.error else "the sleep failed")
