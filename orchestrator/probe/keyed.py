"""The one rule for sending a service's API key: only to a listener proven the service's own.

vLLM binds its port at start and listens only once loaded (vllm/entrypoints/launchers/launcher.py),
so during a load, a restart or a unit `activating` another local user can listen on the loopback
address of the same port, answer /health and /v1/models, and collect what is sent. Before the key
goes out, the host facts are read for that port (host/facts.gather: one round trip) and every
process bound to it must be the service's by the ownership rule (its unit's cgroup, its recorded
process group: host/ownership.listener_problem); else `ForeignListener` and nothing is sent.

`endpoint()` is the only way vllm-orch makes an Endpoint that carries a key (readiness gates,
`serving_now` of deploy/swap/regen/check, status, a swap's wake canary, the perf measurement);
`prove()` is the same check for a client that brings its own key (bench --host). The Endpoint itself
sends the key only under vLLM's guarded prefixes (probe/api.GUARDED), never to /health or /metrics.
"""

from __future__ import annotations

from orchestrator.config.inventory import HostEntry
from orchestrator.errors import RefusedError
from orchestrator.host import http
from orchestrator.host.base import Host
from orchestrator.host.facts import gather
from orchestrator.host.ownership import listener_problem
from orchestrator.probe.api import Endpoint
from orchestrator.secret import Secret

HINT = ("find who holds it (`ss -ltnp`); vLLM binds its port early and listens only once loaded, and another "
        "user can listen on the loopback address meanwhile")


class ForeignListener(http.HttpError):
    """A process that is not the service's is bound to its port (or nothing is): the key was not sent."""


def refused(exc: ForeignListener, entry: HostEntry, step: str) -> RefusedError:
    """The refusal (exit 3) a step that needs the key ends with when its listener is not proven."""
    return RefusedError(f"{exc}: the API key was not sent", host=entry.name, step=step, hint=HINT)


def prove(host: Host, entry: HostEntry, service: str, port: int) -> None:
    """ForeignListener unless every process bound to `port` on the host is the service's, now."""
    problem = listener_problem(gather(host, entry, [service], ports=[port]).ports.get(port, []), service, port)
    if problem:
        raise ForeignListener(problem)


def endpoint(host: Host, entry: HostEntry, service: str, port: int, key: Secret | None,
             address: str = "127.0.0.1") -> Endpoint:
    """The service's endpoint with its key, once the listener is proven its own (ForeignListener
    otherwise); without a key there is nothing to prove and nothing is read."""
    if key is not None:
        prove(host, entry, service, port)
    return Endpoint(host, port, key, address)


def endpoint_for(step: str, host: Host, entry: HostEntry, service: str, port: int, key: Secret | None) -> Endpoint:
    """endpoint() for a plan step that cannot go on without the key: a listener not proven the
    service's is the step refused (exit 3), naming the holder."""
    try:
        return endpoint(host, entry, service, port, key)
    except ForeignListener as exc:
        raise refused(exc, entry, step) from None
