"""The services on one host and whether a new placement fits beside them. Pure: from gathered
facts (records under state_dir/services, installed records, service states).

A service counts when vllm-orch recorded it serving (services/NAME.json) or when its unit runs
(a deploy killed before its record step): its GPUs and port are taken. A stopped service (its
record cleared by `stop`) takes nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from orchestrator.config.manifest import PORT_BASES
from orchestrator.config.placement import Placement, expand_ports, node_binds
from orchestrator.errors import RefusedError
from orchestrator.host.facts import HostFacts
from orchestrator.host.ownership import gpu_list, holders
from orchestrator.plan.inputs import ServiceInput
from orchestrator.plan.sleep import room_refusal


def host_placements(facts: HostFacts, host: str) -> list[Placement]:
    """Where every service that takes GPUs and a port on the host now is, by name: where it runs,
    and where its installed files would start it when that is elsewhere (HostFacts.placements)."""
    names = set(facts.records) | set(facts.running())
    return [p for n in sorted(names) for p in facts.placements(n, host)]


def service_names(facts: HostFacts) -> list[str]:
    """The services a per-service command can be about: recorded ones and running ones."""
    return sorted(set(facts.records) | set(facts.running()))


def placement_of(svc: ServiceInput, host: str) -> Placement:
    """The placement a service (as it runs on the host: config/effective.py) takes: its GPUs, its
    API port and a multi-node service's other ports there (config/placement.node_binds)."""
    m = svc.manifest
    return Placement(m.name, svc.model, host, tuple(m.serving.visible_devices), m.serving.port,
                     node_binds(m, svc.rendered.role))


def needs(p: Placement) -> str:
    """What a placement takes, as a refusal says it."""
    return f"{gpu_list(p.gpus)} and port {p.port}" + "".join(f", {name} {port}" for name, port in p.binds)


def clash_refusal(facts: HostFacts, svc: ServiceInput, host: str, replacing: Collection[str] = (),
                  planned: Mapping[str, Placement] | None = None, asleep: bool = False) -> RefusedError | None:
    """Refuse a placement whose GPUs or port another service takes (naming it); `replacing`: the
    services this operation stops first (a swap's old one); `planned`: other services' placements as
    this same operation leaves them (regen re-renders several at once), besides where they are now;
    `asleep`: the service stays asleep (regen), so it shares GPUs and needs no memory room."""
    want = dataclasses.replace(placement_of(svc, host), asleep=asleep)
    name = want.name
    own = expand_ports(dict(want.binds)).get(want.port)
    if own is not None:
        return RefusedError(f"{name}'s API port {want.port} on {host} is also its {own}", host=host, step="placement",
                            hint=f"give it another port: --port, or {_set_port(want, own)}")
    swap = f"vllm-orch swap {svc.model}" + (f" --name {name}" if name != svc.model else "")
    others = host_placements(facts, host)
    others += [p for p in (planned or {}).values() if p.name in {o.name for o in others}]
    for other in others:
        if other.name in replacing:
            continue
        what = want.clash(other)
        if what:
            named = other.name if other.model == other.name else f"{other.name} ({other.model})"
            return RefusedError(
                f"{named} already takes {what} on {host}: {name} needs {needs(want)}", host=host, step="placement",
                hint=f"place {name} elsewhere (--gpus, --port{', ' + _set_port(want) if want.binds else ''}), "
                     f"`{swap} --replace {other.name} --host {host}`, or `vllm-orch stop {other.name} --host {host}` first")
    return listener_refusal(facts, want, replacing) or (
        None if asleep else room_refusal(facts, svc.manifest, host, awake_too=replacing))


def _set_port(p: Placement, label: str | None = None) -> str:
    """How to move the placement's other ports (all, or the one `label` names): the port its nodes meet
    at is a manifest field; Ray's own ports follow the node's GPUs."""
    fields = [name for name, _ in p.binds if name in PORT_BASES and label in (None, name)]
    ray = any(name not in PORT_BASES for name, _ in p.binds) if label is None else label not in PORT_BASES
    return " or ".join([f"multinode.{name} in models/{p.model}.yaml" for name in fields] +
                       (["other GPUs (--gpus: Ray's own ports follow the node's first GPU)"] if ray else []))


def listener_refusal(facts: HostFacts, want: Placement, replacing: Collection[str] = ()) -> RefusedError | None:
    """Refuse a placement whose multi-node port (the port its nodes meet at, on the head) a process
    other than the service itself listens on: another service's (named), or a foreign one (a torchrun
    job's store on 29500, another vLLM's): the service's ranks would dial that process instead of
    their head, and the head watch would watch it. Never killed, whatever the options (unlike the
    API port's left-behind holders, which the GPU step clears). The API port's holders are
    preflight's (plan/service.placement_holders)."""
    for port, label in sorted(want.ports.items()):
        if label == "API port":
            continue
        held = holders([], facts.ports.get(port, []), want.name, [], replacing, protected=facts.services_known())
        for p in held.others + held.foreign:
            who = f"the service {p.model}" if p.model else (
                f"PID {p.pid} {p.name}" + (f" (user {p.user})" if p.user else "") if p.pid else
                "a socket whose owner vllm-orch cannot see (another user's: `ss -ltnp` as root names it)")
            what = "where its nodes meet its head" if label in PORT_BASES else "on this node"
            return RefusedError(
                f"port {port} on {want.host} ({want.name}'s {label}, {what}) is held by {who}",
                host=want.host, step="placement", details=[p.describe()],
                hint=f"stop it, or move {want.name}: {_set_port(want, label)}")
    return None


def record_warnings(facts: HostFacts) -> list[str]:
    """A plan's warnings about record files that did not parse: the services they describe are
    not seen (their GPUs and port are checked only while they run)."""
    return [f"unreadable record {bad}: left out (fix or remove the file)" for bad in facts.bad_records]


def name_refusal(facts: HostFacts, svc: ServiceInput, host: str) -> RefusedError | None:
    """Refuse to put model M under a service name that serves another model now (recorded, or its
    unit running): one unit, one set of records, cannot hold both, and replacing it in place would
    leave nothing to roll back to. A stopped, unrecorded name is free to reuse."""
    name = svc.name
    st = facts.services.get(name)
    if facts.record(name) is None and not (st is not None and st.active):
        return None
    other = facts.model_of(name)
    if other == svc.model:
        return None
    return RefusedError(
        f"the service {name} on {host} serves {other}: {svc.model} cannot take its name while it does",
        host=host, step="placement",
        hint=f"swap to it under another name: `vllm-orch swap {svc.model} --name NAME --replace {name} --host {host}`,"
             f" or `vllm-orch stop {name} --host {host}` first")
