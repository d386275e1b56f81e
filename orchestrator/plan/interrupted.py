"""What an interrupted swap leaves on a host, and what to run about it (pure).

A swap writes state_dir/swap.json when it stops the old model (a sleep swap: when it puts the
awake service to sleep, or stops it to wake the other) and removes it when it ends (the new model
recorded, or the rollback finished). A run killed in between, one whose rollback was
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


def word(facts: HostFacts, name: str) -> str:
    """service_word, and `asleep` for a service its record says sleeps (sleep mode)."""
    return "asleep" if facts.asleep(name) is not None else service_word(facts.services.get(name))


def sleep_half(facts: HostFacts, name: str) -> bool:
    """Whether a swap to NAME finishes or undoes a half-done sleep swap with plan_sleep_swap: the
    half-done swap names NAME, used sleep mode, and one of its two sides sleeps now. (With neither
    asleep, the ordinary swap's resume or return converges it.)"""
    half = facts.half_swap
    return half is not None and half.sleep and name in (half.from_, half.to) and \
        any(facts.asleep(n) is not None for n in (half.from_, half.to))


def half_done(facts: HostFacts, host_name: str) -> tuple[str, str] | None:
    """(what is half done, what to run) when the host has a swap that stopped its old model and
    never ended (swap.json: the run was killed, interrupted twice, or lost its connection)."""
    half = facts.half_swap
    if half is None:
        return None
    old, new = half.from_, half.to
    text = (f"a swap from {old} to {new} (started {half.since or '?'} by {half.by or '?'}) did not "
            f"end: {old} is {word(facts, old)}, {new} is {word(facts, new)}")
    hint = (f"run `vllm-orch swap {new} --host {host_name}` to finish it (it rolls back to {old} if {new} "
            f"fails), or `vllm-orch swap {old} --host {host_name}` to go back to {old}")
    return text, hint
