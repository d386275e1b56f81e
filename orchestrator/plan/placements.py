"""The services on one host and whether a new placement fits beside them. Pure: from gathered
facts (records under state_dir/services, installed records, service states).

A service counts when vllm-orch recorded it serving (services/NAME.json) or when its unit runs
(a deploy killed before its record step): its GPUs and port are taken. A stopped service (its
record cleared by `stop`) takes nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from orchestrator.config.placement import Placement
from orchestrator.errors import RefusedError
from orchestrator.host.facts import HostFacts
from orchestrator.host.ownership import gpu_list
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
    """The placement a service (as it runs on the host: config/effective.py) takes."""
    m = svc.manifest
    return Placement(m.name, svc.model, host, tuple(m.serving.visible_devices), m.serving.port)


def clash_refusal(facts: HostFacts, svc: ServiceInput, host: str, replacing: Collection[str] = (),
                  planned: Mapping[str, Placement] | None = None) -> RefusedError | None:
    """Refuse a placement whose GPUs or port another service takes (naming it); `replacing`: the
    services this operation stops first (a swap's old one); `planned`: other services' placements as
    this same operation leaves them (regen re-renders several at once), besides where they are now."""
    want = placement_of(svc, host)
    name = want.name
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
                f"{named} already takes {what} on {host}: {name} needs {gpu_list(want.gpus)} and "
                f"port {want.port}", host=host, step="placement",
                hint=f"place {name} elsewhere (--gpus, --port), `{swap} --replace {other.name} --host {host}`, "
                     f"or `vllm-orch stop {other.name} --host {host}` first")
    return room_refusal(facts, svc.manifest, host, awake_too=replacing)


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
