"""What an interrupted swap leaves on a host, and what to run about it (pure).

A swap writes state_dir/swap.json when it stops the old model and removes it when it ends (the new
model recorded, or the rollback finished). A run killed in between, one whose rollback was
abandoned by a second Ctrl-C, or one that lost its SSH connection for good leaves it behind: then
`status` shows it, `deploy` refuses, and `swap` to either side resumes or undoes it
(orchestrator.plan.swap).
"""

from __future__ import annotations

from orchestrator.host.facts import HostFacts
from orchestrator.host.services import ServiceState


def service_word(st: ServiceState | None) -> str:
    """One word for a service's state, as status and the half-done message say it."""
    if st is None or not (st.active or st.failed):
        return "stopped"
    if st.failed:
        return "failed"
    return "serving" if st.ready else ("loading" if st.ready is False else "running")


def half_done(facts: HostFacts, host_name: str) -> tuple[str, str] | None:
    """(what is half done, what to run) when the host has a swap that stopped its old model and
    never ended (swap.json: the run was killed, interrupted twice, or lost its connection)."""
    half = facts.half_swap
    if half is None:
        return None
    old, new = half.from_, half.to
    text = (f"a swap from {old} to {new} (started {half.since or '?'} by {half.by or '?'}) did not "
            f"end: {old} is {service_word(facts.services.get(old))}, {new} is "
            f"{service_word(facts.services.get(new))}")
    hint = (f"run `vllm-orch swap {new} --host {host_name}` to finish it (it rolls back to {old} if {new} "
            f"fails), or `vllm-orch swap {old} --host {host_name}` to go back to {old}")
    return text, hint
