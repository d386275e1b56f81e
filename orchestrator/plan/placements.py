"""The services on one host and whether a new placement fits beside them. Pure: from gathered
facts (records under state_dir/services, installed records, service states).

A service counts when vllm-orch recorded it serving (services/NAME.json) or when its unit runs
(a deploy killed before its record step): its GPUs and port are taken. A stopped service (its
record cleared by `stop`) takes nothing.
"""

from __future__ import annotations

from collections.abc import Collection

from orchestrator.config.manifest import Manifest
from orchestrator.config.placement import Placement
from orchestrator.errors import RefusedError
from orchestrator.host.facts import HostFacts
from orchestrator.host.ownership import gpu_list


def host_placements(facts: HostFacts, host: str) -> list[Placement]:
    """Every service that takes GPUs and a port on the host now, by name."""
    out = {name: Placement.from_record(name, host, rec) for name, rec in facts.records.items()}
    for name in facts.running():
        if name not in out and isinstance(facts.installed.get(name), dict):
            out[name] = Placement.from_record(name, host, facts.installed[name])
    return [out[n] for n in sorted(out)]


def service_names(facts: HostFacts) -> list[str]:
    """The services a per-service command can be about: recorded ones and running ones."""
    return sorted(set(facts.records) | set(facts.running()))


def placement_of(m: Manifest, host: str) -> Placement:
    """The placement a manifest (as it runs on the host: config/effective.py) asks for."""
    return Placement(m.name, m.model_name, host, tuple(m.serving.visible_devices), m.serving.port)


def clash_refusal(facts: HostFacts, m: Manifest, host: str, replacing: Collection[str] = ()) -> RefusedError | None:
    """Refuse a placement whose GPUs or port another service takes (naming it); `replacing`: the
    services this operation stops first (a swap's old one)."""
    want = placement_of(m, host)
    for other in host_placements(facts, host):
        if other.name in replacing:
            continue
        what = want.clash(other)
        if what:
            named = other.name if other.model == other.name else f"{other.name} ({other.model})"
            return RefusedError(
                f"{named} already takes {what} on {host}: {m.name} needs {gpu_list(want.gpus)} and "
                f"port {want.port}", host=host, step="placement",
                hint=f"place {m.name} elsewhere (--gpus, --port), `vllm-orch swap {m.name} --replace "
                     f"{other.name} --host {host}`, or `vllm-orch stop {other.name} --host {host}` first")
    return None
