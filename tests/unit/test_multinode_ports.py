"""Issue 26, finding 5: the ports a multi-node service's nodes meet at are part of the service value.

Two multi-node services on disjoint GPUs of the same hosts get distinct ports by default (derived
from the head's GPUs); an explicit clash with another service's port, or a foreign listener on it
(a torchrun job's store), is refused before anything changes (exit 3, naming the port and the
holder); a later run keeps the port a service was recorded with. Pure: the facts script's answer as
in tests/unit/test_plan_cases.py, the real gather, render and planners.
"""

from __future__ import annotations

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest, load_all
from orchestrator.config.placement import Request
from orchestrator.host.facts import HostFacts, parse
from orchestrator.ops import gather
from orchestrator.paths import shipped_dir
from orchestrator.plan.deploy import plan_deploy
from orchestrator.plan.inputs import DownloadPlan, PlanInput, RegenInput, ServiceInput
from orchestrator.plan.placements import placement_of
from orchestrator.plan.regen import plan_regen
from orchestrator.plan.service import installed_record
from tests.unit.test_plan_cases import CHECKS, GIB, LOCK, CaseReads, Options, answer

SHIPPED, _ = load_all(shipped_dir("models"))
HOSTS = [HostEntry.model_validate({"name": h, "address": f"{h}.example", "sudo": True,
                                   "cluster": {"address": f"10.0.0.{i + 1}"}}) for i, h in enumerate(("gpu1", "gpu2"))]


def four_by_two(**multinode) -> Manifest:
    """Kimi-K2.5 INT4 as TP 4 x PP 2 over two hosts: 4 GPUs per node, so two fit on the same two hosts."""
    data = SHIPPED["kimi-k25-int4-2node"].model_dump()
    data["serving"]["gpus"] = 4
    data["vllm"]["tensor_parallel_size"] = 4
    data["multinode"].update(multinode)
    return Manifest.model_validate(data)


def facts(installed: dict | None = None, running: tuple[str, ...] = (), ports: dict | None = None,
          procs: dict | None = None, on: str = "gpu1") -> dict[str, HostFacts]:
    """Both hosts' facts: `installed` per host (installed/NAME.json), the services running, and on
    host `on` the listeners (port -> PIDs) and their processes."""
    out = {}
    for e in HOSTS:
        raw = answer(e.name, {"installed": (installed or {}).get(e.name, {}),
                              "services": dict.fromkeys(running, "running")})
        if e.name == on:
            raw.update(ports={str(p): pids for p, pids in (ports or {}).items()}, procs=procs or {})
        out[e.name] = parse(raw, e.name)
    return out


def service(m: Manifest, name: str, gpus: str, f: dict[str, HostFacts], port: int | None = None) -> list[ServiceInput]:
    """The service NAME of M placed on GPUs `gpus` (and API port `port`) of both hosts, as deploy
    resolves and renders it."""
    request = Request.parse(m, name, gpus, port)
    spec = gather.service_spec(m, HOSTS, request, f)
    return [gather.service_input(CaseReads({}, set()), e, m, f[e.name], spec) for e in HOSTS]


def flag(svc: ServiceInput, name: str) -> str:
    argv = svc.rendered.argv
    return argv[argv.index(name) + 1]


def installed(*services: list[ServiceInput]) -> dict:
    """Each host's installed records of the services, as their install step writes them."""
    return {e.name: {s[i].name: installed_record(s[i]).dump() for s in services} for i, e in enumerate(HOSTS)}


def deploy(m: Manifest, name: str, gpus: str, f: dict[str, HostFacts], port: int | None = None):
    nodes = service(m, name, gpus, f, port)
    weights = DownloadPlan(total_bytes=GIB, have_bytes=GIB, to_fetch_bytes=0, files=10, to_fetch=(), commit="c" * 40)
    return plan_deploy(*[PlanInput(entry=e, facts=f[e.name], opts=Options(), lock=LOCK, preflight=CHECKS, target=t,
                                   download=weights) for e, t in zip(HOSTS, nodes, strict=True)]), nodes


def test_two_two_node_services_on_gpus_0_3_and_4_7_of_the_same_hosts_get_distinct_ports():
    m = four_by_two()
    a = service(m, "kimi-a", "0-3", facts())
    f = facts(installed(a), running=("kimi-a",))
    plan, b = deploy(m, "kimi-b", "4-7", f, port=8001)
    assert plan.refusal is None, plan.refusal
    ports_a = {flag(n, "--master-port") for n in a}
    ports_b = {flag(n, "--master-port") for n in b}
    assert ports_a == {"29501"} and ports_b == {"29505"}, (ports_a, ports_b)     # every node dials its own head's
    assert [flag(n, "--master-addr") for n in a + b] == ["10.0.0.1"] * 4
    # recorded with the service, so a later run finds and keeps it
    assert installed_record(b[0]).cluster_ports == installed_record(b[1]).cluster_ports == {"master_port": 29505}


def test_two_ray_services_on_the_same_hosts_share_no_port_and_a_listener_in_a_workers_range_is_refused():
    """backend ray: every node runs Ray's own servers (node manager, object manager, agents, a worker
    port range), pinned per service from the node's GPUs; the head also its GCS, client server and
    dashboard."""
    m = four_by_two(backend="ray")
    a = service(m, "ray-a", "0-3", facts())
    f = facts(installed(a), running=("ray-a",))
    plan, b = deploy(m, "ray-b", "4-7", f, port=8001)
    assert plan.refusal is None, plan.refusal
    for i, e in enumerate(HOSTS):
        pa, pb = placement_of(a[i], e.name), placement_of(b[i], e.name)
        assert len(pa.ports) > 300 and not set(pa.ports) & set(pb.ports), e.name
        assert pa.clash(pb) is None
    worker_b = b[1].rendered.argv                    # gpu2's `ray start` of ray-b: its own range
    low = int(worker_b[worker_b.index("--min-worker-port") + 1])
    assert (low, int(worker_b[worker_b.index("--max-worker-port") + 1])) == (11202, 11501)
    squatter = {"pid": 6161, "alive": True, "ppid": 1, "pgid": 6161, "comm": "nc", "start_time": 5,
                "cmdline": ["nc", "-l", str(low + 7)], "uid": 1000, "user": "bob"}
    f = facts(installed(a), running=("ray-a",), ports={low + 7: [6161]}, procs={"6161": squatter}, on="gpu2")
    plan, _ = deploy(m, "ray-b", "4-7", f, port=8001)
    assert plan.refusal is not None and plan.refusal.exit_code == 3
    line = str(plan.refusal)
    assert f"port {low + 7} on gpu2" in line and "Ray worker port range" in line and "PID 6161 nc" in line, line
    assert "--gpus" in (plan.refusal.hint or "")                   # Ray's ports follow the node's GPUs
    # the service's own API port inside its Ray ports: refused, not silently merged
    plan, _ = deploy(m, "ray-b", "4-7", facts(), port=7046)
    assert plan.refusal is not None and "API port 7046 on gpu1 is also its dashboard_port" in str(plan.refusal)


def test_an_explicit_port_another_service_takes_is_refused_naming_it():
    a = service(four_by_two(), "kimi-a", "0-3", facts())
    f = facts(installed(a), running=("kimi-a",))
    plan, _ = deploy(four_by_two(master_port=29501), "kimi-b", "4-7", f, port=8001)
    assert plan.refusal is not None and plan.refusal.exit_code == 3
    text = str(plan.refusal)
    assert "kimi-a" in text and "port 29501" in text and "gpu1" in text, text
    assert not [a for a in plan.actions if a.step in ("install", "start")]     # refused before anything changes


def test_a_foreign_listener_on_the_master_port_is_refused_naming_the_holder():
    torchrun = {"pid": 4242, "alive": True, "ppid": 1, "pgid": 4242, "comm": "torchrun", "start_time": 777,
                "cmdline": ["/usr/bin/python3", "/usr/local/bin/torchrun", "--nproc-per-node", "8", "train.py"],
                "uid": 1001, "user": "alice", "cgroup": "0::/user.slice/user-1001.slice/session-3.scope"}
    f = facts(ports={29501: [4242]}, procs={"4242": torchrun})
    plan, nodes = deploy(SHIPPED["kimi-k25-int4-2node"], "kimi-k25-int4-2node", "0-7", f)
    assert flag(nodes[0], "--master-port") == "29501"
    assert plan.refusal is not None and plan.refusal.exit_code == 3, plan.text()
    line = str(plan.refusal).splitlines()[0]
    assert "gpu1" in line and "port 29501" in line and "PID 4242" in line and "torchrun" in line, line
    text = plan.text()                                                          # what --dry-run prints
    assert "REFUSED: gpu1: placement: port 29501 on gpu1" in text and "PID 4242 torchrun" in text, text
    assert not [a for a in plan.actions if a.step in ("download", "install", "start")]


def test_a_listener_that_is_the_service_itself_is_no_clash():
    """A redeploy of a running service: its own head holds its master port."""
    m = SHIPPED["kimi-k25-int4-2node"]
    first = service(m, "kimi-k25-int4-2node", "0-7", facts())
    rank0 = {"pid": 5151, "alive": True, "ppid": 5150, "pgid": 5150, "comm": "VLLM::Worker_TP0", "start_time": 9,
             "cmdline": ["VLLM::Worker_TP0"], "cgroup": "0::/system.slice/vllm-kimi-k25-int4-2node.service"}
    f = facts(installed(first), running=("kimi-k25-int4-2node",), ports={29501: [5151]}, procs={"5151": rank0})
    plan, _ = deploy(m, "kimi-k25-int4-2node", "0-7", f)
    assert plan.refusal is None, plan.refusal


def test_regen_keeps_the_recorded_port_and_a_record_from_before_keeps_29500():
    m = SHIPPED["kimi-k25-int4-2node"]
    nodes = service(m, "kimi-k25-int4-2node", "0-7", facts())
    records = installed(nodes)
    for host in records.values():
        host["kimi-k25-int4-2node"]["cluster_ports"] = {"master_port": 29600}   # placed by an earlier run
    legacy = installed(nodes)
    for host in legacy.values():
        host["kimi-k25-int4-2node"].pop("cluster_ports", None)                     # written before ports were recorded
    for recs, want in ((records, "29600"), (legacy, "29500")):
        f = facts(recs, running=("kimi-k25-int4-2node",))
        for e in HOSTS:                     # regen re-renders each node from its own record
            found, _ = gather.regen_services(f[e.name], e, {m.name: m})
            svcs = [gather.service_input(CaseReads({}, set()), e, mm, f[e.name], spec, True) for mm, spec in found]
            assert [flag(s, "--master-port") for s in svcs] == [want], (e.name, want)
            plan = plan_regen(RegenInput(entry=e, facts=f[e.name], opts=Options(), lock=LOCK, services=svcs,
                                         orphaned=[], restart=False))
            assert plan.refusal is None
        # a redeploy (a swap's resolve is the same) keeps it too while the head stays on its GPUs
        again = service(m, "kimi-k25-int4-2node", "0-7", f)
        assert {flag(n, "--master-port") for n in again} == {want}
