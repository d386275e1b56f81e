"""Where a service runs: a placement is (service name, model, host, GPU ids, port). Pure.

A host may run several services on disjoint GPUs and ports. The service's name keys everything
vllm-orch keeps for it on the host (unit, env file, records, history entries, health timer,
process record); it is its model's name, so a host from before several services per host keeps its
unit names. The GPU ids and port come from the manifest, then the inventory's per-model overrides
(config/inventory.py ServingOverride), then the command line (`deploy --gpus 4-7 --port 8001`),
which wins: config/effective.py applies them and says where each came from.

A multi-node service (a manifest with `multinode:`) is one placement per node, each with the
node's GPUs (serving.gpus per node) and the overlap rule per host; `node_roles` binds the selected
hosts to its ranks (the first is the head).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.errors import ConfigError

_RANGE = re.compile(r"^(\d{1,6})-(\d{1,6})$")
MAX_GPUS = 64           # serving.gpus' bound: no service takes more


def parse_gpus(text: str) -> list[int]:
    """`4-7`, `4,5,6,7` or a mix (`0,2-3`) -> [4, 5, 6, 7]: unique, in the order given; at most
    MAX_GPUS of them (checked before a range is expanded: `0-99999` is refused at once)."""
    shown = text if len(text) <= 40 else text[:40] + "..."
    out: list[int] = []
    seen: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        m = _RANGE.match(part)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if hi < lo:
                raise ConfigError(f"--gpus {shown}: {part} is an empty range")
            count = hi - lo + 1
        elif part.isdigit() and len(part) <= 6:
            lo = hi = int(part)
            count = 1
        else:
            raise ConfigError(f"--gpus {shown}: {part[:20]!r} is not a GPU index or a range like 4-7")
        if len(out) + count > MAX_GPUS:
            raise ConfigError(f"--gpus {shown}: more than {MAX_GPUS} GPUs; a service takes at most {MAX_GPUS}")
        for i in range(lo, hi + 1):
            if i in seen:
                raise ConfigError(f"--gpus {shown}: GPU {i} is given twice")
            seen.add(i)
            out.append(i)
    return out


@dataclass(frozen=True)
class Placement:
    """One service on one host."""

    name: str                       # the service: unit vllm-NAME.service, services/NAME.json
    model: str
    host: str
    gpus: tuple[int, ...]
    port: int

    @classmethod
    def from_record(cls, name: str, host: str, record: Mapping) -> Placement:
        """A service as its record on the host names it (the GPUs and port it was started with)."""
        return cls(name, str(record.get("model") or name), host,
                   tuple(int(i) for i in record.get("gpus") or ()), int(record.get("port") or 0))

    def clash(self, other: Placement) -> str | None:
        """What `other` takes of this placement's GPUs or port (None: they can run side by side)."""
        if other.host != self.host or other.name == self.name:
            return None
        shared = sorted(set(self.gpus) & set(other.gpus))
        what = []
        if shared:
            what.append("GPU" + ("s " if len(shared) > 1 else " ") + ",".join(map(str, shared)))
        if other.port and other.port == self.port:
            what.append(f"port {self.port}")
        return " and ".join(what) or None


def choose_service(names: Iterable[str], given: str | None, host: str, usage: str) -> str | None:
    """The service a per-service command (stop, logs, history, bench --host) is about: the one
    given, else the only one on the host; with several and none given, ask for it (exit 2).
    `usage`: the command with SERVICE where the name goes, e.g. `stop SERVICE --host gpu1`."""
    known = sorted(set(names))
    if given is not None or len(known) <= 1:
        return given if given is not None else (known[0] if known else None)
    raise ConfigError(f"{host} runs several services ({', '.join(known)}): name one, "
                      f"e.g. `vllm-orch {usage.replace('SERVICE', known[0])}`")


@dataclass(frozen=True)
class NodeRole:
    """One node of a multi-node service: its rank (0 = the head, which runs the API server) among the
    service's hosts, and the address every node meets the head at."""

    rank: int                       # 0 = head
    nodes: tuple[str, ...]          # inventory host names, head first
    head_address: str               # the head's cluster address (HostEntry.cluster_address)

    @property
    def head(self) -> bool:
        return self.rank == 0

    @property
    def host(self) -> str:
        return self.nodes[self.rank]


def node_roles(m: Manifest, entries: Sequence[HostEntry]) -> list[NodeRole]:
    """The role of each selected host of a multi-node manifest, in the order selected (the first is
    the head). Exactly multinode.nodes distinct hosts, each with a cluster address (ConfigError, exit
    2, one line naming the setting otherwise)."""
    mn = m.multinode
    if mn is None:
        raise ConfigError(f"{m.name} is not a multi-node manifest (it has no multinode section)")
    names = [e.name for e in entries]
    if len(names) != mn.nodes:
        raise ConfigError(
            f"{m.name} runs on {mn.nodes} nodes (multinode.nodes) but {len(names)} host"
            f"{'' if len(names) == 1 else 's'} {'was' if len(names) == 1 else 'were'} given"
            f"{': ' + ', '.join(names) if names else ''}",
            hint=f"select {mn.nodes} hosts, the head first: `--host {','.join(names[:1] or ['gpu1'])},...` "
                 "or `--group NAME`")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"{m.name}: host {twice[0]} is given twice: every node is its own host")
    head = [e.node_address(m.name) for e in entries][0]
    return [NodeRole(rank, tuple(names), head) for rank in range(len(names))]
