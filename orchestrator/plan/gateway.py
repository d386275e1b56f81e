"""The gateway's steps in every plan of a host that runs one (docs/gateway.md "What each operation does").

A planner knows nothing of the gateway; `with_gateway` adds its steps around the steps that start,
stop, sleep or wake a service (Action.subject), in the plan and in each recovery branch, so that a
dry run shows them and they run in the plan's one code path:

  before a stop or a sleep   drain: new requests for the service get 503 + Retry-After, its
                             requests in flight finish (up to gateway.drain_seconds)
  before a start or a wake   route: requests for the service wait for its port (up to
                             gateway.hold_seconds, then 503 + Retry-After) instead of 404; for a
                             wake they wait at the gateway (its port is open while it sleeps)
  after a wake               release: its canary matched, the requests held for it go on
  before a restart in place  hold: new requests for the service wait at the gateway, its requests
  (regen --restart, an       in flight finish (up to gateway.drain_seconds) before vLLM stops;
  upgrade)                   after its readiness gates passed, release: the held requests go on
                             (a restart that fails them is rolled back, and released after that)
  at the end                 the routes follow the host's records (a stopped service's name is
                             404, a sleeping one's 503 + Retry-After)

A gateway step never fails its operation: a gateway that cannot be reloaded is said (a warning,
and `vllm-orch gateway status`), and the service's own change goes on, so a swap that serves is
not rolled back for its gateway.
"""

from __future__ import annotations

from dataclasses import replace

from orchestrator.config.inventory import HostEntry
from orchestrator.errors import OrchestratorError
from orchestrator.host import gateway as hg
from orchestrator.host.base import Script
from orchestrator.host.records import GatewayRecord
from orchestrator.plan.model import Action, Plan, Recovery
from orchestrator.plan.run import RunEnv

STOPS = ("stop", "sleep")
STARTS = ("start", "wake")
READY = "ready"                 # the readiness gates' step ("ready" or "ready NAME"): after it, a restart's release


def _guarded(what: str, work):
    def run(env: RunEnv) -> str:
        try:
            return work(env)
        except (OrchestratorError, OSError) as exc:
            line = f"the gateway could not {what}: {exc} (see `vllm-orch gateway status --host {env.entry.name}`)"
            env.record.warnings.append(line)
            return line
    return run


def drain_action(rec: GatewayRecord, name: str, starts_next: tuple[str, ...] = ()) -> Action:
    """`starts_next`: the services the plan starts after this stop. One that serves a name of NAME's
    (a swap between two manifests of one served name) takes that name now: its requests wait at
    the gateway for its port instead of getting 503 (until NAME stops they still reach NAME, on
    the port they share, and its stop lets them finish)."""
    def work(env: RunEnv) -> str:
        env.record.gateway_up.discard(name)
        env.record.gateway_held.discard(name)
        env.record.gateway_down.add(name)
        mine = hg.names_of(env.host, env.entry, name)
        for other in starts_next:
            if other != name and mine & hg.names_of(env.host, env.entry, other):
                env.record.gateway_up.add(other)
        return hg.drain(env.host, env.entry, rec, name, env.record.gateway_up, env.record.gateway_down,
                        env.record.gateway_held)

    return Action("gateway", f"drain {name} at the gateway: new requests for it get 503 + Retry-After, its requests "
                             f"in flight finish (up to {rec.drain_s} s)",
                  commands=[Script("", display=f"reload the gateway with {name} disabled; wait until no HAProxy "
                                               f"worker has a request of it in flight")],
                  run=_guarded(f"drain {name}", work), subject=name)


def hold_action(rec: GatewayRecord, name: str) -> Action:
    """Before a restart in place: NAME's new requests wait at the gateway (as for a wake), the ones
    in flight finish before vLLM is stopped; release_action lets the held ones go on."""
    def work(env: RunEnv) -> str:
        env.record.gateway_down.discard(name)
        env.record.gateway_up.discard(name)
        env.record.gateway_held.add(name)
        return hg.drain(env.host, env.entry, rec, name, env.record.gateway_up, env.record.gateway_down,
                        env.record.gateway_held)

    return Action("gateway", f"hold {name} at the gateway: new requests for it wait while it restarts (up to "
                             f"{rec.hold_s} s, then 503 + Retry-After), its requests in flight finish first (up to "
                             f"{rec.drain_s} s)",
                  commands=[Script("", display=f"reload the gateway with {name}'s requests held; wait until no "
                                               f"HAProxy worker has a request of it in flight")],
                  run=_guarded(f"hold {name}", work), subject=name)


def route_action(rec: GatewayRecord, name: str) -> Action:
    def work(env: RunEnv) -> str:
        env.record.gateway_down.discard(name)
        env.record.gateway_up.add(name)
        routes, changed = hg.sync(env.host, env.entry, rec, env.record.gateway_up, env.record.gateway_down,
                                  env.record.gateway_held)
        r = next((r for r in routes if r.service == name), None)
        if r is None:
            return f"{name} has no route (no port recorded)"
        return f"{', '.join(r.names)} -> {r.target}" + ("" if changed else " (already routed)")

    return Action("gateway", f"route {name} at the gateway: requests for it wait for its port (up to {rec.hold_s} s, "
                             f"then 503 + Retry-After)",
                  commands=[Script("", display=f"reload the gateway with {name} routed")],
                  run=_guarded(f"route {name}", work), subject=name)


def release_action(rec: GatewayRecord, name: str, why: str = "its canary matched") -> Action:
    """After a wake (its canary matched) or a restart (its readiness gates passed): every HAProxy
    worker lets the requests held for NAME go on."""
    def work(env: RunEnv) -> str:
        env.record.gateway_held.discard(name)
        hg.release(env.host, env.entry, rec, name)
        hg.sync(env.host, env.entry, rec, env.record.gateway_up, env.record.gateway_down, env.record.gateway_held)
        return f"the requests held for {name} go on"

    return Action("gateway", f"release {name} at the gateway: {why}, the requests held for it go on",
                  commands=[Script("", display=f"write the release file of svc_{name}, which every HAProxy worker's "
                                               f"held requests wait for")],
                  run=_guarded(f"release {name}", work), subject=name)


def sync_action(rec: GatewayRecord) -> Action:
    def work(env: RunEnv) -> str:
        env.record.gateway_up.clear()
        env.record.gateway_down.clear()
        env.record.gateway_held.clear()
        routes, changed = hg.sync(env.host, env.entry, rec)
        shown = "; ".join(f"{', '.join(r.names)} -> {r.target}" + ("" if r.up else " (held)" if r.hold else " (503)")
                          for r in routes)
        return (shown or "no model routed") + ("" if changed else " (unchanged)")

    return Action("gateway", "the gateway's routes follow the host's records (a stopped service's name answers 404)",
                  commands=[Script("", display="render the routes from the service records; reload if they changed")],
                  run=_guarded("update its routes", work))


def _around(actions: list[Action], rec: GatewayRecord, head: str) -> tuple[list[Action], dict[int, int]]:
    """The actions with the gateway's steps; old index -> new index."""
    out: list[Action] = []
    where: dict[int, int] = {}
    touched = False
    restarting: set[str] = set()            # held for a restart: released after its readiness gates
    for i, a in enumerate(actions):
        name = a.subject if not a.noop and a.node in (None, head) else None
        ready = a.step.split()[0] == READY
        if name and a.step in STOPS:
            later = tuple(b.subject for b in actions[i + 1:] if b.subject and not b.noop and b.step in STARTS)
            out.append(drain_action(rec, name, later))
        elif name and a.restart:
            out.append(hold_action(rec, name))
            restarting.add(name)
        elif name and a.step in STARTS:
            out.append(route_action(rec, name))
        touched = touched or (bool(name) and not ready)
        where[i] = len(out)
        out.append(a)
        if name and a.step == "wake":
            out.append(release_action(rec, name))
        elif name in restarting and ready:
            out.append(release_action(rec, name, "its readiness gates passed"))
            restarting.discard(name)
    for name in sorted(restarting):         # no readiness step followed: released before the routes follow
        out.append(release_action(rec, name, "it restarted"))
    if touched:
        out.append(sync_action(rec))
    return out, where


def with_gateway(plan: Plan, rec: GatewayRecord | None, entry: HostEntry) -> Plan:
    """The plan with the gateway's steps, when the host runs a gateway (rec) and the plan was not refused."""
    if rec is None or plan.refusal is not None:
        return plan
    actions, where = _around(plan.actions, rec, entry.name)
    if len(actions) == len(plan.actions):
        return plan
    recoveries = []
    for r in plan.recoveries:
        acts, _ = _around(r.actions, rec, entry.name)
        # a recovery covers the same steps as before: their new numbers (1-based)
        recoveries.append(Recovery(where[r.first - 1] + 1, where[r.last - 1] + 1, r.title, acts))
    return replace(plan, actions=actions, recoveries=recoveries)


def read(host, entry: HostEntry) -> GatewayRecord | None:
    """The host's gateway record (None: no gateway; also when it cannot be read)."""
    try:
        return hg.read_record(host, entry)
    except OrchestratorError:
        return None
