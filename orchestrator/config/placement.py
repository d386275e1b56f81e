"""Where a service runs. Pure.

The service value (ServiceSpec) is what every later layer is handed about the service an operation
is for: its name, its model, and per node (one for a one-host service) the host, GPU ids and port,
each with where it came from (Origin, an enum). It is built once per operation by `resolve`, from
the command line (Request), the inventory, the manifest and what an earlier run placed (the
installed record's placement, Recorded), and carried to render, the planners, the records and
regen.

A host may run several services on disjoint GPUs and ports. The service's name keys everything
vllm-orch keeps for it on the host (unit, env file, records, history entries, health timer,
process record); it is its model's name unless `--name` says otherwise, so a host from before
several services per host keeps its unit names. Each node's GPU ids and port, strongest first:
  the command line (`deploy --gpus 4-7 --port 8001`)
  the replaced service's (`swap NEW --replace OLD`: NEW takes OLD's GPUs, when it needs as many, and port)
  the installed record, when an earlier run placed the service there (a command line or --replace),
  so a redeploy, swap or regen without --gpus/--port keeps a placed service where it is
  the inventory's per-model overrides (config/inventory.py ServingOverride)
  the manifest
config/effective.py applies the result and names where each value came from.

A multi-node service (a manifest with `multinode:`) has one node per selected host, each checked by
the overlap rule on its host; `node_roles` binds the hosts to ranks (the first is the head).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import PORT_BASES, Manifest, derived_port
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
    binds: tuple[tuple[str, int], ...] = ()     # the other ports it listens on here: (multinode field, port)
    asleep: bool = False            # sleep mode: its GPUs are free but for a CUDA context each

    @property
    def ports(self) -> dict[int, str]:
        """Every port the service listens on here, and what each is (its API port, `master_port`...;
        a Ray worker port range as each of its ports)."""
        return {**expand_ports(dict(self.binds)), **({self.port: "API port"} if self.port else {})}

    def clash(self, other: Placement) -> str | None:
        """What `other` takes of this placement's GPUs or ports (None: they can run side by side).
        A sleeping service shares its GPUs with an awake one (at most one awake per GPU), never
        its ports: its server still listens."""
        if other.host != self.host or other.name == self.name:
            return None
        shared = [] if self.asleep or other.asleep else sorted(set(self.gpus) & set(other.gpus))
        what = []
        if shared:
            what.append("GPU" + ("s " if len(shared) > 1 else " ") + ",".join(map(str, shared)))
        mine, theirs = self.ports, other.ports
        for port in sorted(set(mine) & set(theirs)):
            what.append(f"port {port}" + ("" if mine[port] == theirs[port] == "API port" else
                                          f" (its {theirs[port]}; {self.name}'s {mine[port]})"))
        return " and ".join(what) or None


def choose_service(names: Iterable[str], given: str | None, host: str, usage: str, *,
                   asleep: Iterable[str] = ()) -> str | None:
    """The service a per-service command (logs, history, bench --host) is about: the one given,
    else the only one on the host, else the only one AWAKE (a sleeping service shares its GPUs and
    serves nothing until woken); with several awake and none given, ask for it (exit 2), suggesting
    an awake one. `usage`: the command with SERVICE where the name goes, e.g. `logs SERVICE --host gpu1`.
    `asleep`: which of `names` sleep (leave it empty where a guess would be harmful, as for stop)."""
    known = sorted(set(names))
    if given is not None or len(known) <= 1:
        return given if given is not None else (known[0] if known else None)
    sleeping = set(asleep)
    awake = [n for n in known if n not in sleeping]
    if len(awake) == 1:
        return awake[0]
    shown = ", ".join(f"{n} (asleep)" if n in sleeping else n for n in known)
    raise ConfigError(f"{host} runs several services ({shown}): name one, "
                      f"e.g. `vllm-orch {usage.replace('SERVICE', (awake or known)[0])}`")


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


# -- the service value -----------------------------------------------------------------------------

class Origin(StrEnum):
    """Where a node's GPU ids or port came from."""

    MANIFEST = "manifest"
    INVENTORY = "inventory"             # the host's overrides for the model
    RECORD = "record"                   # kept where an earlier run placed it (installed/NAME.json)
    REPLACED = "replaced"               # took the place of the service a swap replaces (--replace)
    COMMAND_LINE = "command line"       # --gpus / --port
    DERIVED = "derived"                 # a multinode port derived from the head's GPUs (manifest.derived_port)

    @property
    def placed(self) -> bool:
        """Chosen for this service by a run (a command line, a swap's --replace) and kept since: a
        later run without --gpus/--port keeps it. A manifest's or inventory's value follows them."""
        return self in (Origin.COMMAND_LINE, Origin.REPLACED, Origin.RECORD)


@dataclass(frozen=True)
class Request:
    """What the command line says about the service: its name (--name), GPUs (--gpus), port (--port)."""

    name: str | None = None
    gpus: tuple[int, ...] | None = None
    port: int | None = None

    @classmethod
    def parse(cls, m: Manifest, name: str | None = None, gpus: str | None = None,
              port: int | None = None) -> Request:
        """The command line's options for model M (a --gpus list of another length than M's layout:
        ConfigError, exit 2, before any host is asked)."""
        ids = tuple(parse_gpus(gpus)) if gpus else None
        if ids is not None:
            _check_count(m, ids)
        return cls(name, ids, port)


def _check_count(m: Manifest, gpus: Sequence[int]) -> None:
    if len(gpus) != m.serving.gpus:
        raise ConfigError(f"--gpus {','.join(map(str, gpus))}: {len(gpus)} GPUs, but {m.name} runs on "
                          f"{m.serving.gpus} (serving.gpus: its tensor x data parallel layout)")


@dataclass(frozen=True)
class Recorded:
    """A service's placement on one host as its installed record keeps it: the GPUs and port it was
    installed with, and whether a run placed each there (Origin.placed)."""

    gpus: tuple[int, ...]
    port: int
    gpus_placed: bool = False
    port_placed: bool = False
    cluster_ports: Mapping[str, int] | None = None   # a multi-node service's ports as rendered (records' cluster_ports)


@dataclass(frozen=True)
class NodeSpec:
    """One node of a service (the only one of a one-host service): its host, GPUs and port, and
    where each came from."""

    host: str
    gpus: tuple[int, ...]
    port: int
    gpus_from: Origin = Origin.MANIFEST
    port_from: Origin = Origin.MANIFEST


@dataclass(frozen=True)
class ClusterPort:
    """The port a multi-node service's nodes meet at on its head (Manifest.cluster_port_name: master_port,
    dp_rpc_port or ray_port), and where it came from: the manifest, the record (kept from an earlier
    run), or derived from the head's GPUs."""

    name: str
    port: int
    origin: Origin


@dataclass(frozen=True)
class ServiceSpec:
    """The service an operation is about: name, model, and its nodes (head first; one for a
    one-host service). `roles`: each node's rank and the head's address (multi-node only)."""

    name: str
    model: str
    nodes: tuple[NodeSpec, ...]
    roles: tuple[NodeRole, ...] = ()
    replaces: str | None = None         # the service whose place it takes (swap --replace)
    cluster_port: ClusterPort | None = None     # multi-node only
    folder: str = ""                    # its weights folder under models_root (config/checkpoints.folder_for);
                                        # "": the manifest's default (a bare render)

    @property
    def head(self) -> NodeSpec:
        return self.nodes[0]

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(n.host for n in self.nodes)

    def node(self, host: str) -> NodeSpec:
        for n in self.nodes:
            if n.host == host:
                return n
        raise KeyError(f"{self.name} has no node on {host}")

    def role(self, host: str) -> NodeRole | None:
        """The node's role in a multi-node service (None: a one-host service)."""
        return next((r for r in self.roles if r.host == host), None)

    def placement(self, host: str) -> Placement:
        n, cp = self.node(host), self.cluster_port
        binds = _binds(cp.name, cp.port, n.gpus, self.role(host)) if cp is not None else ()
        return Placement(self.name, self.model, host, n.gpus, n.port, binds)

    def origin_label(self, what: str, origin: Origin) -> str:
        """How a plan or `render` names where the GPUs (`what` gpus) or the port came from."""
        option = "--gpus" if what == "gpus" else "--port"
        return {Origin.COMMAND_LINE: f"command line {option}",
                Origin.RECORD: f"placed earlier (installed/{self.name}.json keeps it)",
                Origin.REPLACED: f"--replace {self.replaces} (its {'GPUs' if what == 'gpus' else 'port'})",
                Origin.DERIVED: f"derived from the head's GPUs ({what}: {PORT_BASES.get(what, '?')} + the first "
                                f"GPU index; recorded with the service)",
                }.get(origin, str(origin))


def _node(m: Manifest, entry: HostEntry, request: Request, recorded: Recorded | None,
          replaced: Placement | None, service: str) -> NodeSpec:
    want = m.serving.gpus
    gpus, gpus_from = tuple(m.serving.visible_devices), Origin.MANIFEST
    port, port_from = m.serving.port, Origin.MANIFEST
    for _, ov in entry.override_for(m.name):
        if ov.serving.gpu_ids is not None:
            gpus, gpus_from = tuple(ov.serving.gpu_ids), Origin.INVENTORY
        if ov.serving.port is not None:
            port, port_from = ov.serving.port, Origin.INVENTORY
    if recorded is not None:
        if recorded.gpus_placed:
            if len(recorded.gpus) != want:
                raise ConfigError(
                    f"{service} was placed on GPUs {','.join(map(str, recorded.gpus))} of {entry.name}, but "
                    f"{m.name} now runs on {want} (serving.gpus)", host=entry.name,
                    hint=f"place it anew: `vllm-orch deploy {m.name} --name {service} --host {entry.name} "
                         f"--gpus IDS`")
            gpus, gpus_from = recorded.gpus, Origin.RECORD
        if recorded.port_placed:
            port, port_from = recorded.port, Origin.RECORD
    if replaced is not None:
        if len(replaced.gpus) == want:
            gpus, gpus_from = replaced.gpus, Origin.REPLACED
        if replaced.port:
            port, port_from = replaced.port, Origin.REPLACED
    if request.gpus is not None:
        _check_count(m, request.gpus)
        gpus, gpus_from = request.gpus, Origin.COMMAND_LINE
    if request.port is not None:
        port, port_from = request.port, Origin.COMMAND_LINE
    return NodeSpec(entry.name, gpus, port, gpus_from, port_from)


def resolve(m: Manifest, entries: Sequence[HostEntry], request: Request = Request(),
            recorded: Mapping[str, Recorded | None] | None = None,
            replaced: Mapping[str, Placement] | None = None, name: str | None = None,
            roles: Sequence[NodeRole] | None = None) -> ServiceSpec:
    """The service value of model M on `entries` (its nodes, head first; one for a one-host model):
    its name (the command line's, else `name`, else the model's), and each node's GPUs and port by
    the precedence above. `recorded`: each host's installed record of the service; `replaced`: per
    host, the service a swap replaces (--replace); `roles`: the nodes' roles as recorded (regen of
    one node of a multi-node service; default: `entries` are all its nodes). A wrong GPU count or
    node count: ConfigError (exit 2)."""
    service = request.name or name or m.name
    if roles is None:
        if m.multinode is None and len(entries) != 1:
            raise ConfigError(f"{m.name} runs on one host (its manifest has no multinode section) but "
                              f"{len(entries)} hosts were given")
        roles = tuple(node_roles(m, entries)) if m.multinode is not None else ()
    recorded, replaced = recorded or {}, replaced or {}
    nodes = tuple(_node(m, e, request, recorded.get(e.name), replaced.get(e.name), service) for e in entries)
    replaces = next(iter(replaced.values())).name if replaced else None
    head_known = not roles or roles[0].head
    cluster = _cluster_port(m, nodes[0], recorded.get(entries[0].name), head_known)
    return ServiceSpec(service, m.name, nodes, tuple(roles), replaces, cluster)


def _cluster_port(m: Manifest, head: NodeSpec, recorded: Recorded | None, head_known: bool) -> ClusterPort | None:
    """The port the nodes meet at (multi-node only), strongest first: the manifest's; the one the
    service's record keeps while its head stays on the GPUs it was recorded on (a regen, a swap or a
    redeploy never moves a running service's port); derived from the head's GPUs. `head`: the head
    node (head_known), else the one node a regen re-renders, whose record is what is known."""
    name = m.cluster_port_name
    if name is None or m.multinode is None:
        return None
    if name in m.multinode.ports:
        return ClusterPort(name, m.multinode.ports[name], Origin.MANIFEST)
    if recorded is not None and recorded.cluster_ports and name in recorded.cluster_ports \
            and (not head_known or tuple(recorded.gpus) == tuple(head.gpus)):
        return ClusterPort(name, int(recorded.cluster_ports[name]), Origin.RECORD)
    return ClusterPort(name, derived_port(name, head.gpus), Origin.DERIVED)


# Ray's own ports on every node (`ray start` flags, Ray 2.60 ray/scripts/scripts.py), pinned per
# service so that two Ray services share no port on a host: a block of ten from RAY_BLOCK_BASE and a
# worker port range from RAY_WORKERS_BASE, both offset by the node's first GPU index (a host's services
# never share a GPU). Below Linux's ephemeral range (32768-60999), as Ray's own worker range is.
RAY_NODE_PORTS = ("node_manager_port", "object_manager_port", "dashboard_agent_listen_port",
                  "dashboard_agent_grpc_port", "runtime_env_agent_port", "metrics_export_port")
# The head's dashboard too; not its client server (`--ray-client-server-port`, 10001 when the head has
# `ray[client]`): Ray refuses that flag without ray[client] (ray/_private/parameter.py, _check_usage).
RAY_HEAD_PORTS = ("dashboard_port",)
RAY_BLOCK_BASE, RAY_BLOCK = 7000, 10
RAY_WORKERS_BASE, RAY_WORKERS = 10002, 300
WORKER_RANGE = ("min_worker_port", "max_worker_port")


def ray_node_ports(gpus: Sequence[int], head: bool) -> dict[str, int]:
    """The Ray ports of a node whose share of the service runs on `gpus` (each a `ray start --NAME`
    flag): the block of fixed ports (the head's dashboard too) and the worker
    port range (min_worker_port .. max_worker_port)."""
    g = min(gpus) if gpus else 0
    names = RAY_NODE_PORTS + (RAY_HEAD_PORTS if head else ())
    out = {name: RAY_BLOCK_BASE + RAY_BLOCK * g + i for i, name in enumerate(names)}
    low = RAY_WORKERS_BASE + RAY_WORKERS * g
    return {**out, "min_worker_port": low, "max_worker_port": low + RAY_WORKERS - 1}


def expand_ports(named: Mapping[str, int]) -> dict[int, str]:
    """Every port of a node's named ports, a worker port range (min_worker_port, max_worker_port)
    as each of its ports: port -> what it is."""
    out = {p: name for name, p in named.items() if name not in WORKER_RANGE}
    low, high = named.get(WORKER_RANGE[0]), named.get(WORKER_RANGE[1])
    if low and high and 0 <= high - low < 10_000:
        out.update(dict.fromkeys(range(low, high + 1), "Ray worker port range"))
    return out


def node_binds(m: Manifest, role: NodeRole | None) -> tuple[tuple[str, int], ...]:
    """The ports besides its API port that model M (as it runs on the node: config/effective.py)
    listens on there: on a multi-node service's head, the port its nodes meet at (vLLM 0.33: the
    head's rank 0 serves torch's TCPStore on --master-port; its front end binds the data-parallel
    handshake on --data-parallel-rpc-port; Ray's GCS on `ray start --head --port`); with Ray, every
    node's Ray ports (ray_node_ports). vLLM's own other sockets are ephemeral (docs/multi-node.md,
    "Ports")."""
    name = m.cluster_port_name
    if name is None or m.multinode is None:
        return ()
    return _binds(name, m.multinode.port(name, m.serving.visible_devices), m.serving.visible_devices, role)


def _binds(name: str, port: int, gpus: Sequence[int], role: NodeRole | None) -> tuple[tuple[str, int], ...]:
    """A node's ports besides its API port, from the port its nodes meet at (NAME, PORT) and its GPUs."""
    if role is None:
        return ()
    out: tuple[tuple[str, int], ...] = ((name, port),) if role.head else ()
    if name == "ray_port":              # backend ray (Manifest.cluster_port_name)
        out += tuple(ray_node_ports(gpus, role.head).items())
    return out
