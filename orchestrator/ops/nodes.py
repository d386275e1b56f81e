"""What an operation over a service's nodes shares (one node for a one-host service): a session on
every node, the locks taken in sorted host order (two runs over the same nodes wait for each other
instead of each holding one lock the other needs), work on every node at once (one thread and
connection each), and the run's env per node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import TypeVar

from orchestrator.config.inventory import HostEntry
from orchestrator.ops.execute import Reporter
from orchestrator.ops.session import Session, session
from orchestrator.plan.run import Options, RunEnv

T = TypeVar("T")


def as_nodes(nodes: HostEntry | Sequence[HostEntry]) -> list[HostEntry]:
    """One host is a service of one node."""
    return [nodes] if isinstance(nodes, HostEntry) else list(nodes)


def open_sessions(stack: ExitStack, entries: Sequence[HostEntry], operation: str, dry_run: bool,
                  accept_new_host_key: bool) -> dict[str, Session]:
    """A session on every node, entered in sorted host order (the locks too)."""
    return {e.name: stack.enter_context(session(e, operation, dry_run, accept_new_host_key))
            for e in sorted(entries, key=lambda e: e.name)}


def parallel(entries: Sequence[HostEntry], one: Callable[[HostEntry], T]) -> list[T]:
    """one(entry) on every node at once, in the nodes' order (one host: in this thread)."""
    if len(entries) == 1:
        return [one(entries[0])]
    with ThreadPoolExecutor(max_workers=len(entries), thread_name_prefix="node") as pool:
        return list(pool.map(one, entries))


def node_envs(sessions: Mapping[str, Session], entries: Mapping[str, HostEntry], head: str, opts: Options,
              reporter: Reporter) -> RunEnv:
    """The head's RunEnv; with several nodes, every node's env in it (RunEnv.nodes: a step naming a
    node runs with that node's connection and lock)."""
    envs = {n: RunEnv(sessions[n].host, e, opts, reporter, guard=sessions[n].guard) for n, e in entries.items()}
    if len(envs) > 1:
        envs[head].nodes = envs
    return envs[head]
