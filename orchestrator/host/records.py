"""vllm-orch's records on a host, as versioned pydantic models, all in this one module. Pure: host/
state.py reads and writes them (and the facts script reads them in the facts' round trip).

  services/NAME.json   ServiceRecord: a service vllm-orch started and proved serving
  installed/NAME.json  InstalledRecord: a service whose unit vllm-orch installed (regen re-renders it)
  history.jsonl        HistoryEntry, one per line: an operation (or a host-side restart) and its result
  swap.json            SwapMarker: a swap that stopped its old service and has not ended
  active.json          the one record of a host from before several services per host: read as
                       a ServiceRecord of its model (host/state.upgrade_records moves it)

Read old, write new: a record without `version` was written before records were versioned (version
0) and is read as it was written (an installed record's `placed` dict becomes its origins); fields
this version does not know (a newer vllm-orch's) are kept, so a rewrite does not drop them. Every
record is written at RECORDS_VERSION. A file that does not parse as its record (hand-edited,
truncated, of another shape) reads as absent: `Record.read` returns None and says why.

`vllm-orch schema --records` prints the JSON schema of each (record_schemas).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from orchestrator.config.manifest import LEGACY_PORTS
from orchestrator.config.placement import NodeRole, Origin, Recorded
from orchestrator.fmt import fmt_bytes

RECORDS_VERSION = 1


class Record(BaseModel):
    """A record file's common part: its version, and the fields it does not know kept as they are."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    FILE: ClassVar[str] = ""

    version: int = Field(0, description="The record format; 0: written before records were versioned.")

    @classmethod
    def read(cls, value: Any) -> Self | None:
        """The record from what a file held (parsed JSON); None when it is not one (see why_not)."""
        return cls.parse(value)[0]

    @classmethod
    def parse(cls, value: Any) -> tuple[Self | None, str | None]:
        """(the record, None), or (None, why it is not one)."""
        if not isinstance(value, Mapping):
            return None, f"not a JSON object but {type(value).__name__}"
        try:
            return cls.model_validate(dict(value)), None
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "(record)"
            return None, f"{where}: {err['msg']}"

    def dump(self) -> dict:
        """What is written: this version's fields (None left out), and the unknown ones as read."""
        out = self.shown()
        out["version"] = RECORDS_VERSION
        return out

    def shown(self) -> dict:
        """The record as JSON shows it (history --json, status): its fields as read, None left out."""
        out = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        out.pop("version", None)
        return out


class NodeFields(Record):
    """A node of a multi-node service: every node (head first), this one's rank, the head and the
    address the nodes meet it at. None for a one-host service."""

    nodes: list[str] | None = None
    rank: int | None = None
    head: str | None = None
    head_address: str | None = None
    cluster_ports: dict[str, int] | None = Field(
        None, description="The ports its nodes meet at on the head, as rendered (e.g. master_port), the "
                          "same on every node: kept by later runs. None on a record from before they were "
                          "recorded (then the defaults of that time, manifest.LEGACY_PORTS).")

    node_ports: dict[str, int] | None = Field(
        None, description="Ray (backend ray): this node's own Ray ports as rendered (`ray start --NAME`: "
                          "node manager, object manager, agents, min/max_worker_port...).")

    def kept_ports(self) -> dict[str, int] | None:
        """The multinode ports the service was rendered with (None for a one-host service)."""
        if not self.multinode:
            return None
        return dict(self.cluster_ports) if self.cluster_ports is not None else dict(LEGACY_PORTS)

    def binds(self) -> tuple[tuple[str, int], ...]:
        """The ports besides the API port the service listens on on this host: on the head, the ports
        its nodes meet at; with Ray, this node's Ray ports (config/placement.node_binds)."""
        head = sorted((self.kept_ports() or {}).items()) if self.rank == 0 else []
        return tuple(head + sorted((self.node_ports or {}).items()))

    def role(self) -> NodeRole | None:
        """The node role the record names; None for a one-host service or a record without one."""
        nodes, rank, address = self.nodes, self.rank, self.head_address
        if not (nodes and rank is not None and 0 <= rank < len(nodes) and address):
            return None
        return NodeRole(rank, tuple(nodes), address)

    @staticmethod
    def of(role: NodeRole | None) -> dict:
        """The node fields of a role (nothing for one host: a record without `nodes` is single-node)."""
        return {} if role is None else {"nodes": list(role.nodes), "rank": role.rank, "head": role.nodes[0],
                                        "head_address": role.head_address}

    @property
    def multinode(self) -> bool:
        return bool(self.nodes) and len(self.nodes or ()) > 1


class Asleep(BaseModel):
    """A service put to sleep (vLLM's sleep mode): its process lives, its GPUs are free but for a
    CUDA context each; what the last sleep left there, against the allowance, over the cycles."""

    model_config = ConfigDict(extra="allow")

    level: int = Field(description="1: the weights in host RAM; 2: dropped (a wake reads them again).")
    since: str | None = None
    weights_bytes: int = Field(0, description="The weights' size (in host RAM at level 1).")
    gpu_mib: dict[str, int] = Field(default_factory=dict, description="MiB it holds per GPU after the sleep.")
    allowance_mib: int = Field(0, description="What a sleeping process may hold per GPU (its CUDA context).")
    cycles: int = Field(0, description="Sleeps since it last started cold.")
    first_mib: int | None = Field(None, description="The most it held on a GPU after its first sleep.")
    growth_mib: int = Field(0, description="How much more it holds than after its first sleep (a leak).")

    def where(self) -> str:
        """Where its weights are, for status: "level 1: 547 GB in host RAM"."""
        if self.level == 1:
            return f"level 1: {fmt_bytes(self.weights_bytes)} in host RAM"
        return "level 2: weights dropped (a wake reads them from the page cache or disk)"


class Canary(BaseModel):
    """A greedy completion of a fixed prompt recorded when the service first became ready: a wake
    must give the same tokens back (corrupted weights answer otherwise)."""

    model_config = ConfigDict(extra="allow")

    prompt: str
    text: str
    token_ids: list[int] | None = None
    at: str | None = None


class ServiceRecord(NodeFields):
    """services/NAME.json: a service vllm-orch started and proved serving (written by deploy's and
    swap's record step, removed by stop)."""

    FILE: ClassVar[str] = "services/NAME.json"

    model: str = Field(description="The model it serves (its manifest).")
    service: str | None = Field(None, description="The service's name (unit vllm-NAME); the model's when absent.")
    folder: str | None = Field(None, description="Its weights folder under models_root (a checkpoint's folder is "
                                                 "shared by every manifest of that repo@commit); the model's name "
                                                 "when absent (a record from before).")
    served_name: str | None = None
    port: int = 0
    gpus: list[int] = Field(default_factory=list)
    repo: str | None = None
    revision: str | None = Field(None, description="The commit it was downloaded at.")
    manifest_hash: str | None = None
    unit_hash: str | None = None
    vllm_version: str | None = None
    engine: str | None = Field(None, description="Its engine venv (engines_root/NAME), when its manifest has "
                                                 "`engine:`; absent: the inventory's vllm.")
    argv: list[str] = Field(default_factory=list)
    deployed_at: str | None = None
    host_label: str | None = None
    enabled: bool = Field(False, description="Whether it starts at boot.")
    hardware: str | None = None
    perf: dict[str, Any] | None = Field(None, description="The last throughput measurement (the perf step).")
    asleep: Asleep | None = Field(None, description="Put to sleep (sleep mode): None while it serves.")
    canary: Canary | None = Field(None, description="The known answer a wake is checked against.")
    sleep_cycles: int | None = Field(None, description="Sleeps since it last started cold.")
    sleep_first_mib: int | None = Field(None, description="The most it kept on a GPU after its first sleep.")
    sleep_last_mib: int | None = Field(None, description="The most it kept on a GPU after its last sleep.")
    graph_pool_mib: int | None = Field(
        None, description="MiB per GPU its CUDA graphs took at its start (vLLM's \"Graph capturing finished in N "
                          "secs, took X GiB\"): a sleeping process keeps that pool on its GPUs unless "
                          "--sleep-mode-offload-cudagraph, so it is part of what it may keep asleep.")
    sleep_pinned_bytes: int | None = Field(
        None, description="Host RAM its first level-1 sleep pinned, measured (MemAvailable before minus after, at "
                          "least the weights): PyTorch's pinned host allocator rounds each block up to a power of "
                          "two, so it is more than the weights.")
    sleep_pinned_pid: int | None = Field(
        None, description="The main PID of the process that holds those pinned blocks: PyTorch keeps freed pinned "
                          "blocks cached while the process lives (a wake gives none back), so while that process "
                          "serves, its next level-1 sleep pins nothing more.")


class InstalledRecord(NodeFields):
    """installed/NAME.json: a service whose unit vllm-orch installed: its files and hashes, and its
    placement with where each part came from (a placed value is kept by later runs)."""

    FILE: ClassVar[str] = "installed/NAME.json"

    model: str | None = None
    service: str | None = None
    folder: str | None = Field(None, description="The weights folder its unit serves from (under models_root); "
                                                 "the model's name when absent (a record from before).")
    unit: str | None = None
    env_file: str | None = None
    manifest_hash: str | None = None
    unit_hash: str | None = None
    gpus: list[int] = Field(default_factory=list)
    port: int = 0
    served_name: str | None = Field(None, description="The name clients send as `model` (the gateway routes it here); "
                                                      "absent on a record from before the gateway.")
    address: str | None = Field(None, description="The address vLLM listens on (serving.host).")
    gpus_from: Origin = Field(Origin.MANIFEST, description="Where its GPUs came from.")
    port_from: Origin = Field(Origin.MANIFEST, description="Where its port came from.")
    engine: str | None = Field(None, description="The engine venv its unit runs (engines_root/NAME); absent: "
                                                 "the inventory's vllm.")
    installed_at: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _version_0(cls, data: Any) -> Any:
        """Version 0 kept `placed` ({gpu_ids, port}: what the command line chose) instead of origins."""
        if isinstance(data, Mapping) and not data.get("version") and isinstance(data.get("placed"), Mapping):
            data = dict(data)
            placed = data.pop("placed")
            if placed.get("gpu_ids") is not None:
                data.setdefault("gpus_from", Origin.COMMAND_LINE)
            if placed.get("port") is not None:
                data.setdefault("port_from", Origin.COMMAND_LINE)
        return data

    def placement(self) -> Recorded | None:
        """Where the service was installed, and which of it a run placed (config/placement.resolve
        keeps those); None without GPUs and a port."""
        if not self.gpus and not self.port:
            return None
        return Recorded(tuple(self.gpus), self.port, gpus_placed=bool(self.gpus) and self.gpus_from.placed,
                        port_placed=bool(self.port) and self.port_from.placed, cluster_ports=self.kept_ports())


class HistoryEntry(Record):
    """One line of history.jsonl: an operation and its result. The fields every line may have are
    typed here; what an operation adds (steps and timings, gates, recovery, warm-up...) is kept as
    it is. `health-restart`, `health-busy` and `head-lost-restart` lines are written by the host-side
    unit probe (host/remote/unit_probe.py, stdlib only) with the same common fields (a watchers' limit
    reached: `refused`, and `limit` true)."""

    FILE: ClassVar[str] = "history.jsonl"

    at: str | None = None
    operation: str
    service: str | None = Field(None, description="The service it is about; the model's name when absent.")
    model: str | None = None
    ok: bool | None = None
    seconds: float | None = None
    noop: bool | None = None
    refused: str | None = None
    error: str | None = None
    root_cause: str | None = None
    from_: str | None = Field(None, alias="from", description="swap: the service replaced.")
    to: str | None = None
    downtime_s: float | None = None
    tokens_per_s: float | None = None

    @property
    def subject(self) -> str | None:
        """The service the line is about."""
        return self.service or self.model

    def about(self, name: str) -> bool:
        """Whether the line concerns the service or model NAME (as either side of a swap too)."""
        return name in (self.service, self.model, self.to, self.from_)

    def extra(self, key: str, default: Any = None) -> Any:
        """A field an operation added (not typed above)."""
        return (self.model_extra or {}).get(key, default)


class SwapMarker(Record):
    """swap.json: a swap that stopped its old service (or put it to sleep) and has not ended (written
    by that step, removed by the record step or a finished rollback); what the next command reads to
    finish or undo it."""

    FILE: ClassVar[str] = "swap.json"

    from_: str = Field(alias="from", description="The service the swap replaces.")
    to: str = Field(description="The service it swaps to.")
    since: str | None = None
    by: str | None = None
    from_enabled: bool = Field(False, description="Whether the old service started at boot.")
    from_sleeps: bool = Field(False, description="A sleep swap: the old service is put to sleep, not stopped.")
    to_wakes: bool = Field(False, description="A swap to a sleeping service: the new one is woken, not started.")

    @property
    def sleep(self) -> bool:
        """A swap with sleep mode (plan/swap.plan_sleep_swap finishes or undoes it)."""
        return self.from_sleeps or self.to_wakes


class GatewayRecord(Record):
    """gateway/gateway.json: the gateway `vllm-orch gateway up` installed (removed by `gateway down`):
    where it listens, the HAProxy it runs, its bounds. Every operation's plan reloads its routes
    while this record exists."""

    FILE: ClassVar[str] = "gateway/gateway.json"

    port: int = Field(description="The port it listens on.")
    listen: list[str] = Field(default_factory=lambda: ["127.0.0.1"], description="The addresses it listens on.")
    haproxy: str = Field(description="The HAProxy executable it runs.")
    metrics_port: int | None = Field(None, description="The port of its Prometheus metrics (None: off).")
    hold_s: int = Field(30, description="How long a request for a starting model waits, then 503.")
    drain_s: int = Field(60, description="How long requests in flight may take before their service stops.")
    installed_at: str | None = None


RECORDS: tuple[type[Record], ...] = (ServiceRecord, InstalledRecord, HistoryEntry, SwapMarker, GatewayRecord)


def record_schemas() -> dict:
    """The JSON schema of every record, by its file (`vllm-orch schema --records`)."""
    return {"version": RECORDS_VERSION,
            "records": {r.FILE: r.model_json_schema(by_alias=True) for r in RECORDS}}
