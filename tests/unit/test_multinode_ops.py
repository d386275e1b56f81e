"""The parts of operating a multi-node service that need no host: which node a readiness failure is
pinned on (probe/readiness.py, with scripted logs and unit states), status showing the service once
with its nodes (ops/status.fold_nodes), and the nodes' logs merged by time (ops/stop.merge_logs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import load_all
from orchestrator.host.services import ServiceState
from orchestrator.ops.status import HostStatus, ServiceStatus, fold_nodes
from orchestrator.ops.stop import line_time, merge_logs
from orchestrator.paths import shipped_dir
from orchestrator.probe.readiness import NotReady, wait_ready

MODELS, _ = load_all(shipped_dir("models"))
CUDA = "(Worker_PP1_TP0 pid=7) torch.AcceleratorError: CUDA error: an illegal memory access was encountered"
PEER = ("(Worker_PP0_TP0 pid=5) RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
        "Connection closed by peer [127.0.0.1]:40012")


def _refused(*_args, **_kw):
    raise ConnectionRefusedError("nothing listens yet (the service is loading)")


@dataclass
class Scripted:
    """A Service whose log grows by one scripted batch per read, and whose unit dies at a poll."""

    name: str
    batches: list[list[str]]
    dies_at: int | None = None          # the read after which state() says it exited
    reads: int = 0
    entry: HostEntry = field(init=False)
    host: object = field(init=False)

    def __post_init__(self):
        self.entry = HostEntry(name=self.name, address="10.0.0.9")
        self.host = type("H", (), {"connects": 0, "name": self.name, "connect_tcp": _refused})()

    def log_cursor(self) -> str:
        return "o:0"

    def read_log(self, cursor: str):
        batch = self.batches[self.reads] if self.reads < len(self.batches) else []
        self.reads += 1
        return batch, cursor

    def state(self) -> ServiceState:
        return ServiceState(active=self.dies_at is None or self.reads < self.dies_at, main_pid=1)


def wait(head: Scripted, worker: Scripted):
    return wait_ready(head.host, head, MODELS["kimi-k25-int4-2node"], "o:0", budget_s=30, poll_s=0.01,  # type: ignore[arg-type]
                      nodes=[(worker.name, worker)])  # type: ignore[list-item]


def test_a_rank_crash_on_the_worker_is_pinned_on_the_worker_not_the_head_that_died_of_it():
    head = Scripted("gpu1", [["INFO waiting for ranks"], [PEER]], dies_at=2)
    worker = Scripted("gpu2", [["INFO loading"], [], [CUDA]], dies_at=3)
    with pytest.raises(NotReady) as err:
        wait(head, worker)
    assert err.value.host == "gpu2" and err.value.kind == "fatal-log" and "CUDA error" in err.value.root_cause
    assert "on node gpu2" in err.value.message


def test_a_head_that_exits_right_after_its_consequence_line_still_waits_for_the_cause():
    """The head prints "Connection closed by peer" and exits between two reads of a poll (a race a
    busy machine hit): its exit is judged with that line, so the rank's root cause on gpu2 is named."""
    head = Scripted("gpu1", [["INFO waiting for ranks"], [PEER]], dies_at=1)
    worker = Scripted("gpu2", [["INFO loading"], [], [CUDA]], dies_at=3)
    with pytest.raises(NotReady) as err:
        wait(head, worker)
    assert err.value.host == "gpu2" and err.value.kind == "fatal-log" and "CUDA error" in err.value.root_cause


def test_a_line_about_another_nodes_death_alone_fails_after_the_grace_naming_where_it_was_seen():
    head = Scripted("gpu1", [[PEER]], dies_at=None)
    worker = Scripted("gpu2", [["INFO loading"]])
    with pytest.raises(NotReady) as err:
        wait(head, worker)
    assert err.value.host == "gpu1" and "Connection closed by peer" in err.value.root_cause


def test_a_worker_that_exits_without_a_fatal_line_is_named():
    head = Scripted("gpu1", [["INFO waiting"]])
    worker = Scripted("gpu2", [["INFO loading"]], dies_at=2)
    with pytest.raises(NotReady) as err:
        wait(head, worker)
    assert err.value.host == "gpu2" and err.value.kind == "crash" and "exited" in err.value.message


def svc(name: str, rank: int | None, state: str, nodes=("gpu1", "gpu2")) -> ServiceStatus:
    return ServiceStatus(name, model=name, state=state, rank=rank, node_names=list(nodes) if rank is not None else [])


def test_status_shows_a_multi_node_service_once_on_its_heads_row_with_every_node():
    head = HostStatus("gpu1", services=[svc("k2", 0, "ready"), svc("other", None, "ready")], active_model="k2")
    worker = HostStatus("gpu2", services=[svc("k2", 1, "running")], active_model="k2", state="running")
    fold_nodes([head, worker])
    k2 = head.services[0]
    assert [(n["host"], n["rank"], n["state"]) for n in k2.nodes] == [("gpu1", 0, "ready"), ("gpu2", 1, "running")]
    assert worker.services == [] and worker.active_model is None and worker.state == "running"
    assert worker.node_of == [{"service": "k2", "head": "gpu1", "rank": 1, "state": "running",
                               "reason": ""}]
    assert head.services[1].nodes == []                      # a one-host service: no nodes


def test_a_node_not_asked_or_unreachable_or_stopped_says_so_on_the_heads_row():
    head = HostStatus("gpu1", services=[svc("k2", 0, "ready", ("gpu1", "gpu2", "gpu3", "gpu4"))])
    gone = HostStatus("gpu2", reachable=False, error="connection refused")
    idle = HostStatus("gpu3")
    fold_nodes([head], [gone, idle])
    k2 = head.services[0]
    states = {n["host"]: n["state"] for n in k2.nodes}
    assert states == {"gpu1": "ready", "gpu2": "unreachable", "gpu3": "stopped", "gpu4": "unknown"}
    # a head answering /health with a node down is failed: its next request would fail
    assert k2.state == "failed"
    assert k2.state_reason.startswith("node gpu3 not running: the head still answers /health")
    assert "`vllm-orch deploy k2 --host gpu1,gpu2,gpu3,gpu4` restarts every node" in k2.state_reason
    assert k2.state_reason.endswith("; nodes gpu2, gpu4 not known to run (unknown, unreachable)")


def test_a_node_unreachable_alone_leaves_the_heads_state_and_says_so():
    head = HostStatus("gpu1", services=[svc("k2", 0, "ready")])
    fold_nodes([head], [HostStatus("gpu2", reachable=False, error="timed out")])
    assert head.services[0].state == "ready"
    assert head.services[0].state_reason.endswith("; node gpu2 not known to run (unreachable)")


@pytest.mark.parametrize("head_state", ["stopped", "failed"])
def test_a_headless_node_left_running_without_its_head_is_a_failed_service(head_state):
    """vLLM's headless node outlives its head, holding its GPUs: say so and what to run."""
    head = HostStatus("gpu1", services=[ServiceStatus("k2b", model="k2", state=head_state, rank=0,
                                                      state_reason="unit inactive", node_names=["gpu1", "gpu2"])])
    worker = HostStatus("gpu2", services=[svc("k2b", 1, "running")])
    fold_nodes([head, worker])
    k2 = head.services[0]
    assert k2.state == "failed"
    assert k2.state_reason == ("unit inactive; node gpu2 still running without the head, holding its GPUs (a "
                               "headless vLLM outlives its head): `vllm-orch stop k2b` stops every node, "
                               "`vllm-orch deploy k2 --host gpu1,gpu2 --name k2b` restarts every node")


def test_a_multi_node_service_stopped_everywhere_stays_stopped():
    head = HostStatus("gpu1", services=[svc("k2", 0, "stopped")])
    fold_nodes([head, HostStatus("gpu2", services=[svc("k2", 1, "stopped")])])
    assert head.services[0].state == "stopped"


def test_logs_merge_by_time_keeping_untimed_lines_after_their_own():
    assert line_time("2026-12-01T02:08:38.250000+0000 gpu2 vllm[7]: x") == pytest.approx(
        line_time("2026-12-01T02:08:38+00:00 gpu1 x") + 0.25)
    assert line_time("Traceback (most recent call last):") is None
    head = ["INFO 12-01 02:08:38 [serve.py:1] head up", "INFO 12-01 02:08:41 [core.py:2] head dies",
            "RuntimeError: Connection closed by peer [10.0.0.2]:1"]
    worker = ["INFO 12-01 02:08:39 [serve.py:1] worker up", "ERROR 12-01 02:08:40 [w.py:3] rank crashed",
              "Traceback (most recent call last):", "  File x"]
    assert merge_logs([("gpu1", head), ("gpu2", worker)]) == [
        "[gpu1] INFO 12-01 02:08:38 [serve.py:1] head up", "[gpu2] INFO 12-01 02:08:39 [serve.py:1] worker up",
        "[gpu2] ERROR 12-01 02:08:40 [w.py:3] rank crashed", "[gpu2] Traceback (most recent call last):",
        "[gpu2]   File x", "[gpu1] INFO 12-01 02:08:41 [core.py:2] head dies",
        "[gpu1] RuntimeError: Connection closed by peer [10.0.0.2]:1"]
