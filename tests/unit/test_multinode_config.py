"""Multi-node services (issue 14), the configuration half: the manifest's `multinode` section and its
checks (file:line, exit 2), the inventory's `cluster` settings, binding hosts to ranks
(config/placement.py node_roles) and every node's rendered files (render/artifacts.py role=):
per-rank argv for vLLM's multiprocessing runtime (TP/PP across nodes, data parallel across nodes)
and for Ray, the per-node env file, worker units without readiness probe or health timer, the Ray
head unit, `systemd-analyze verify` of each, and `vllm-orch render M --host a,b`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.config.inventory import HostEntry, load_inventory_file
from orchestrator.config.manifest import Manifest, load_all, load_manifest
from orchestrator.config.placement import NodeRole, node_roles
from orchestrator.errors import ConfigError
from orchestrator.paths import shipped_dir
from orchestrator.render.artifacts import build_argv, ray_unit_name, render
from orchestrator.sim import unitcheck

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
MODELS, _ = load_all(shipped_dir("models"))
TWO_NODE = MODELS["kimi-k25-int4-2node"]

GPU1 = HostEntry(name="gpu1", address="10.0.0.1", cluster={"interface": "ens1f0"})
GPU2 = HostEntry(name="gpu2", address="gpu2.example", cluster={"address": "10.0.0.2", "interface": "ens1f0"})
GPU3 = HostEntry(name="gpu3", address="10.0.0.3")          # no interface: NCCL/Gloo choose


def variant(base: Manifest, **changes) -> Manifest:
    """The manifest with sections changed: variant(m, vllm={...}, multinode={...})."""
    data = base.model_dump()
    for section, values in changes.items():
        data[section] = {**(data.get(section) or {}), **values} if isinstance(values, dict) else values
    return Manifest.model_validate(data)


# data parallel across nodes: 4 replicas of TP 4 (expert parallel), 2 per node
DP = variant(TWO_NODE, name="kimi-dp", vllm={"tensor_parallel_size": 4, "pipeline_parallel_size": 1,
                                              "data_parallel_size": 4, "enable_expert_parallel": True})
RAY = variant(TWO_NODE, name="kimi-ray", multinode={"backend": "ray"})


def write_manifest(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


BASE = """source: {repo: org/m}
serving: {gpus: 8}
vllm:
  tensor_parallel_size: 8
  pipeline_parallel_size: 2
"""


# -- the manifest ---------------------------------------------------------------------------------

@pytest.mark.parametrize("body, expected", [
    # the arithmetic: tensor x pipeline x data = nodes x serving.gpus, at multinode.nodes
    (BASE + "multinode:\n  nodes: 3\n",
     "m.yaml:7: multinode.nodes: parallel sizes use 16 GPUs (tensor 8 x pipeline 2 x data 1) but nodes x "
     "serving.gpus (GPUs per node) is 3 x 8 = 24"),
    (BASE + "multinode:\n  nodes: 1\n",
     "m.yaml:7: multinode.nodes: nodes is 1: a multi-node service spans at least 2 hosts (remove the "
     "multinode section for one host)"),
    ("source: {repo: org/m}\nserving: {gpus: 8}\nvllm: {tensor_parallel_size: 4, data_parallel_size: 6}\n"
     "multinode:\n  nodes: 2\n",
     "m.yaml:5: multinode.nodes: parallel sizes use 24 GPUs (tensor 4 x pipeline 1 x data 6) but nodes x "
     "serving.gpus (GPUs per node) is 2 x 8 = 16"),
    ("source: {repo: org/m}\nserving: {gpus: 6}\nvllm: {tensor_parallel_size: 4, data_parallel_size: 3}\n"
     "multinode:\n  nodes: 2\n",
     "m.yaml:5: multinode.nodes: data_parallel_size 3 does not split evenly over 2 nodes: each node runs "
     "data_parallel_size / nodes data-parallel ranks"),
    ("source: {repo: org/m}\nserving: {gpus: 8}\nvllm: {tensor_parallel_size: 8, data_parallel_size: 2}\n"
     "multinode:\n  nodes: 2\n  backend: ray\n",
     "m.yaml:6: multinode.backend: data parallel across nodes runs on vLLM's own runtime: use backend mp "
     "(the ray backend spans tensor/pipeline parallel only)"),
    (BASE + "multinode:\n  nodes: 2\n  backend: slurm\n",
     "m.yaml:8: multinode.backend: Input should be 'mp' or 'ray'"),
    (BASE + "multinode:\n  nodes: 2\n  master_port: 8000\n",
     "m.yaml:8: multinode.master_port: master_port 8000 is also serving.port, the head's HTTP port"),
    (BASE + "multinode:\n  nodes: 2\n  master_port: 29510\n  ray_port: 29510\n",
     "m.yaml:9: multinode.ray_port: ray_port 29510 is also multinode.master_port: every port needs its own number"),
    (BASE + "multinode:\n  nodes: 2\n  master_prot: 29501\n",
     "m.yaml:8: multinode.master_prot: unknown field - did you mean 'master_port'?"),
    (BASE + "multinode:\n  nodes: true\n", "m.yaml:7: multinode.nodes: expected a number, got true"),
    (BASE + "multinode:\n  nodes: 2\n  join_timeout_seconds: 900\nstartup: {budget_seconds: 600}\n",
     "m.yaml:8: multinode.join_timeout_seconds: join_timeout_seconds 900 must be shorter than "
     "startup.budget_seconds 600: the nodes join during the start-up, and the load comes after"),
    (BASE + "multinode:\n  nodes: 2\n  collective_timeout_seconds: 300\n",
     "m.yaml:8: multinode.collective_timeout_seconds: Input should be greater than or equal to 600"),
    (BASE + "multinode:\n  nodes: 2\n  collective_timeout_seconds: 700\nloading: {other_seconds: 900}\n",
     "m.yaml:8: multinode.collective_timeout_seconds: collective_timeout_seconds 700 is below loading.other_seconds "
     "900: a rank waiting in a collective while a peer compiles would be aborted"),
    (BASE + "multinode:\n  nodes: 2\nenv:\n  VLLM_HOST_IP: 10.0.0.1\n",
     "m.yaml:9: env.VLLM_HOST_IP: VLLM_HOST_IP differs per node: it is written from the inventory "
     "(hosts.NAME.cluster.address) into each node's env file"),
    # one host, as before: the arithmetic against serving.gpus alone
    (BASE, "m.yaml:4: vllm.tensor_parallel_size: parallel sizes use 16 GPUs (tensor 8 x pipeline 2 x data 1) "
           "but serving.gpus is 8"),
])
def test_manifest_checks_name_the_line_and_field(tmp_path, monkeypatch, body, expected):
    monkeypatch.chdir(tmp_path)
    write_manifest(tmp_path, "m", body)
    with pytest.raises(ConfigError) as info:
        load_manifest(Path("m.yaml"))
    assert str(info.value) == expected
    assert info.value.exit_code == 2


def test_serving_gpus_is_per_node_and_the_defaults_teach():
    mn = TWO_NODE.multinode
    assert mn is not None and mn.nodes == 2 and mn.backend == "mp"
    assert TWO_NODE.serving.gpus == 8 and TWO_NODE.vllm.world_size == 16
    assert (mn.master_port, mn.dp_rpc_port, mn.ray_port) == (None, None, None)      # derived from the placement
    assert [mn.port(n, [0, 1, 2, 3]) for n in ("master_port", "dp_rpc_port", "ray_port")] == [29501, 29550, 6379]
    assert [mn.port(n, [4, 5, 6, 7]) for n in ("master_port", "dp_rpc_port", "ray_port")] == [29505, 29554, 6383]
    for name, f in type(mn).model_fields.items():
        assert f.description and len(f.description) > 40, name
    assert MODELS["kimi-k25-int4"].multinode is None
    text = (shipped_dir("models") / "kimi-k25-int4-2node.yaml").read_text()
    assert "docs.vllm.ai/en/latest/serving/parallelism_scaling" in text      # the layout's public source


# -- the inventory --------------------------------------------------------------------------------

@pytest.mark.parametrize("cluster, expected", [
    ("{address: gpu2.lan}", "hosts.yaml:3: hosts.gpu2.cluster.address: 'gpu2.lan' is not an IP address (the "
                            "nodes' runtimes connect to it as is)"),
    ("{interface: 'eth0; reboot'}", "hosts.yaml:3: hosts.gpu2.cluster.interface: 'eth0; reboot' is not a network "
                                    "interface name (letters, digits, _ . : @ -; at most 15)"),
    ("{adress: 10.0.0.2}", "hosts.yaml:3: hosts.gpu2.cluster.adress: unknown field - did you mean 'address'?"),
])
def test_inventory_cluster_checks(tmp_path, monkeypatch, cluster, expected):
    monkeypatch.chdir(tmp_path)
    Path("hosts.yaml").write_text(f"hosts:\n  gpu2:\n    cluster: {cluster}\n    address: gpu2.example\n")
    with pytest.raises(ConfigError) as info:
        load_inventory_file(Path("hosts.yaml"))
    assert str(info.value) == expected


def test_cluster_address_defaults_to_an_ip_address_only():
    assert GPU1.cluster_address == "10.0.0.1" and GPU1.cluster_interface == "ens1f0"
    assert GPU2.cluster_address == "10.0.0.2"                      # cluster.address wins over the DNS name
    assert HostEntry(name="x", address="gpu.example").cluster_address is None
    assert HostEntry(name="x", address="fd00::2").cluster_address == "fd00::2"
    assert HostEntry(name="x", address="local").cluster_address is None


# -- binding hosts to ranks -----------------------------------------------------------------------

def test_node_roles_head_first():
    roles = node_roles(TWO_NODE, [GPU1, GPU2])
    assert roles == [NodeRole(0, ("gpu1", "gpu2"), "10.0.0.1"), NodeRole(1, ("gpu1", "gpu2"), "10.0.0.1")]
    assert roles[0].head and not roles[1].head and roles[1].host == "gpu2"
    assert node_roles(TWO_NODE, [GPU2, GPU1])[0].head_address == "10.0.0.2"   # the order picks the head


def test_node_roles_refuse_the_wrong_count_duplicates_and_unreachable_hosts(tmp_path, monkeypatch):
    with pytest.raises(ConfigError) as info:
        node_roles(TWO_NODE, [GPU1])
    assert str(info.value) == "kimi-k25-int4-2node runs on 2 nodes (multinode.nodes) but 1 host was given: gpu1"
    assert info.value.exit_code == 2 and "--host gpu1," in info.value.hint
    with pytest.raises(ConfigError, match=r"but 3 hosts were given: gpu1, gpu2, gpu3$"):
        node_roles(TWO_NODE, [GPU1, GPU2, GPU3])
    with pytest.raises(ConfigError, match="host gpu1 is given twice"):
        node_roles(TWO_NODE, [GPU1, GPU1])
    with pytest.raises(ConfigError, match="is not a multi-node manifest"):
        node_roles(MODELS["kimi-k25-int4"], [GPU1, GPU2])
    monkeypatch.chdir(tmp_path)
    Path("hosts.yaml").write_text("hosts:\n  gpu1: {address: 10.0.0.1}\n  gpu9:\n    address: gpu9.example\n")
    inv = load_inventory_file(Path("hosts.yaml"))
    with pytest.raises(ConfigError) as info:
        node_roles(TWO_NODE, [inv.hosts["gpu1"], inv.hosts["gpu9"]])
    assert str(info.value) == ("hosts.yaml:4: hosts.gpu9.address: 'gpu9.example' is not an IP address, and the "
                               "other nodes of kimi-k25-int4-2node must reach gpu9 at one: set "
                               "hosts.gpu9.cluster.address")


# -- argv per rank ----------------------------------------------------------------------------------

def after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def nodes(m: Manifest, entries=(GPU1, GPU2)):
    return [render(m, e, role=r) for e, r in zip(entries, node_roles(m, list(entries)))]


def test_mp_tensor_pipeline_across_nodes_argv_per_rank():
    head, worker = nodes(TWO_NODE)
    for r, rank in ((head, 0), (worker, 1)):
        i = r.argv.index("--nnodes")
        assert r.argv[i:i + 8] == ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "10.0.0.1",
                                   "--master-port", "29501"]
        assert after(r.argv, "--tensor-parallel-size") == "8" and after(r.argv, "--pipeline-parallel-size") == "2"
        assert not any(a.startswith("--data-parallel") for a in r.argv)
        assert "--distributed-executor-backend" not in r.argv
    assert "--headless" not in head.argv and worker.argv[worker.argv.index("--master-port") + 2] == "--headless"
    # apart from the rank's flags, every node runs the same command (same model path, same settings)
    rank_flags = {"--node-rank", "0", "1", "--headless"}
    assert [a for a in head.argv if a not in rank_flags] == [a for a in worker.argv if a not in rank_flags]
    prov = dict((t, f) for t, f in worker.provenance if t.startswith("--"))
    assert prov["--nnodes"] == "multinode.nodes" and prov["--master-port"] == "multinode.master_port"
    assert prov["--headless"] == "(node rank)" and prov["--master-addr"] == "(head cluster address)"
    # vLLM's flag times the rendezvous AND every collective: the collective timeout, never the join wait
    assert prov["--distributed-timeout-seconds"] == "multinode.collective_timeout_seconds"
    for r in (head, worker):
        assert after(r.argv, "--distributed-timeout-seconds") == "600"
    assert head.runs_vllm and worker.runs_vllm and head.role == node_roles(TWO_NODE, [GPU1, GPU2])[0]
    assert build_argv(TWO_NODE, GPU2, worker.role) == (worker.argv, worker.provenance)
    assert build_argv(TWO_NODE, GPU2)[0] == render(TWO_NODE, GPU2).argv      # role None: no node flags
    assert "--nnodes" not in build_argv(TWO_NODE, GPU2)[0]


def test_data_parallel_across_nodes_argv_per_rank():
    head, worker = nodes(DP, (GPU1, GPU3))
    common = ["--data-parallel-size", "4", "--enable-expert-parallel", "--data-parallel-size-local", "2",
              "--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "29550"]
    timeout = ["--distributed-timeout-seconds", "600"]
    i = head.argv.index("--data-parallel-size")
    assert head.argv[i:i + len(common) + 3] == common + timeout + ["--max-model-len"]
    j = worker.argv.index("--data-parallel-size")
    assert worker.argv[j:j + len(common) + 5] == common + ["--data-parallel-start-rank", "2", "--headless"] + timeout
    assert "--nnodes" not in head.argv + worker.argv


def test_three_nodes_data_parallel_start_ranks():
    m = variant(DP, serving={"gpus": 4}, vllm={"tensor_parallel_size": 2, "data_parallel_size": 6},
                multinode={"nodes": 3})
    rs = nodes(m, (GPU1, GPU2, GPU3))
    assert [after(r.argv, "--data-parallel-size-local") for r in rs] == ["2", "2", "2"]
    assert ["--data-parallel-start-rank" in r.argv for r in rs] == [False, True, True]
    assert [after(r.argv, "--data-parallel-start-rank") for r in rs[1:]] == ["2", "4"]


def test_ray_head_runs_vllm_workers_run_ray_start():
    head, worker = nodes(RAY)
    assert after(head.argv, "--distributed-executor-backend") == "ray"
    assert "--nnodes" not in head.argv and "--headless" not in head.argv
    assert head.runs_vllm and not worker.runs_vllm
    # every node's Ray ports pinned per service (GPUs 0-7: the first block, issue 26 finding 5)
    node_ports = ["--node-manager-port", "7000", "--object-manager-port", "7001", "--dashboard-agent-listen-port",
                  "7002", "--dashboard-agent-grpc-port", "7003", "--runtime-env-agent-port", "7004",
                  "--metrics-export-port", "7005"]
    workers = ["--min-worker-port", "10002", "--max-worker-port", "10301"]
    assert worker.argv == ["/opt/vllm/bin/ray", "start", "--address", "10.0.0.1:6379", "--node-ip-address",
                           "10.0.0.2", *node_ports, *workers, "--disable-usage-stats", "--block"]
    ray_unit = next(f for f in head.extra if f.path == f"/etc/systemd/system/{ray_unit_name(RAY)}")
    d = directives(ray_unit.text)
    assert d["ExecStart"] == [" ".join(["/opt/vllm/bin/ray start --head --port 6379 --node-ip-address 10.0.0.1",
                                        *node_ports, "--dashboard-port", "7006",
                                        *workers, "--disable-usage-stats", "--block"])]
    assert d["EnvironmentFile"] == ["/etc/vllm-orch/kimi-ray.env"] and d["PrivateTmp"] == ["yes"]
    unit = directives(head.unit.text)
    assert unit["Requires"] == ["ray-kimi-ray.service"] and "ray-kimi-ray.service" in unit["After"]
    assert unit["JoinsNamespaceOf"] == ["ray-kimi-ray.service"]      # Ray's /tmp session folder is shared
    assert "RAY_ADDRESS=10.0.0.1:6379" in unit["Environment"]
    assert not any(f.path.endswith(".service") and "ray-" in f.path for f in worker.extra)
    # the ray executable is the one beside vllm, in its venv
    other = HostEntry(name="gpu2", address="10.0.0.2", vllm="/srv/venv/bin/vllm")
    assert render(RAY, other, role=node_roles(RAY, [GPU1, other])[1]).argv[0] == "/srv/venv/bin/ray"


def test_ray_needs_systemd_hosts():
    box = HostEntry(name="box", address="10.0.0.9", service_manager="process")
    with pytest.raises(ConfigError, match="runs on Ray .* `process` host: use backend mp"):
        render(RAY, box, role=node_roles(RAY, [box, GPU2])[0])


# -- env file and units per node ------------------------------------------------------------------

def env_lines(r) -> dict[str, str]:
    return dict(line.split("=", 1) for line in r.env_file.text.splitlines() if line and not line.startswith("#"))


def directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.replace("\\\n", " ").splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(" ".join(v.split()))
    return out


def test_env_per_node():
    head, worker = nodes(TWO_NODE, (GPU1, GPU3))
    e0, e1 = env_lines(head), env_lines(worker)
    assert e0["VLLM_HOST_IP"] == "10.0.0.1" and e1["VLLM_HOST_IP"] == "10.0.0.3"
    assert e0["NCCL_SOCKET_IFNAME"] == e0["GLOO_SOCKET_IFNAME"] == "ens1f0"
    assert "NCCL_SOCKET_IFNAME" not in e1 and "GLOO_SOCKET_IFNAME" not in e1
    assert e0["CUDA_VISIBLE_DEVICES"] == e1["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"   # serving.gpus per node
    assert "RAY_ADDRESS" not in e0


def test_a_service_env_that_disagrees_with_the_cluster_interface_is_refused():
    from orchestrator.config.effective import effective

    entry = HostEntry(name="gpu1", address="10.0.0.1", cluster={"interface": "ens1f0"},
                      service_env={"NCCL_SOCKET_IFNAME": "eth0"})
    m = effective(TWO_NODE, entry).manifest
    with pytest.raises(ConfigError) as info:
        render(m, entry, role=node_roles(m, [entry, GPU2])[0])
    assert str(info.value) == ("host gpu1: cluster.interface: gpu1's interface is ens1f0 but the service environment "
                               "(the manifest's env or the host's service_env) sets NCCL_SOCKET_IFNAME=eth0: keep "
                               "one of them")
    # the same name on both sides is one line in the env file, not two
    same = HostEntry(name="gpu1", address="10.0.0.1", cluster={"interface": "ens1f0"},
                     service_env={"NCCL_SOCKET_IFNAME": "ens1f0"})
    m = effective(TWO_NODE, same).manifest
    r = render(m, same, role=node_roles(m, [same, GPU2])[0])
    assert r.env_file.text.count("NCCL_SOCKET_IFNAME=") == 1


def test_worker_unit_has_no_readiness_probe_and_no_health_timer_but_a_head_watch():
    head, worker = nodes(TWO_NODE)
    h, w = directives(head.unit.text), directives(worker.unit.text)
    assert "ExecStartPost" in h and "vllm-kimi-k25-int4-2node-health.timer" in h["Wants"][0]
    assert "ExecStartPost" not in w and "health" not in w["Wants"][0]
    assert w["Wants"][0].endswith(" vllm-kimi-k25-int4-2node-headwatch.service")
    assert [f.path.rsplit("/", 1)[1] for f in head.extra] == [
        "vllm-kimi-k25-int4-2node-health.service", "vllm-kimi-k25-int4-2node-health.timer", "vllm-orch-probe.py"]
    assert [f.path.rsplit("/", 1)[1] for f in worker.extra] == [
        "vllm-kimi-k25-int4-2node-headwatch.service", "vllm-orch-probe.py"]
    watch = directives(worker.extra[0].text)
    assert watch["PartOf"] == watch["After"] == ["vllm-kimi-k25-int4-2node.service"]
    assert watch["ExecStart"] == ["/opt/vllm/bin/python -I /var/lib/vllm-orch/bin/vllm-orch-probe.py watch-head "
                                  "--unit vllm-kimi-k25-int4-2node.service --model kimi-k25-int4-2node "
                                  "--address 10.0.0.1 --port 29501 --state-dir /var/lib/vllm-orch/state"]
    # the watch is the service user's, without the service's environment; only its root part
    # (after it exited 75) restarts the node
    assert watch["User"] == ["vllm"] and "EnvironmentFile" not in watch and "LoadCredential" not in watch
    assert watch["ExecStopPost"] == ["+/opt/vllm/bin/python -I -S /var/lib/vllm-orch/bin/vllm-orch-probe.py restart "
                                     "--unit vllm-kimi-k25-int4-2node.service --model kimi-k25-int4-2node "
                                     "--state-dir /var/lib/vllm-orch/state --operation head-lost-restart --by "
                                     "vllm-kimi-k25-int4-2node-headwatch.service --limit-burst 3 --limit-interval 11400 "
                                     "--address 10.0.0.1 --port 29501"]
    assert watch["RestartPreventExitStatus"] == ["75"]
    # data parallel and Ray nodes have no rendezvous store to watch
    for m in (DP, RAY):
        assert nodes(m)[1].extra == [] and "headwatch" not in nodes(m)[1].unit.text
    assert head.unit.path == worker.unit.path == "/etc/systemd/system/vllm-kimi-k25-int4-2node.service"
    assert "node 1 of 2 (headless)" in w["Description"][0]
    # process hosts: the same start script name, the rank's argv
    box = HostEntry(name="box", address="10.0.0.9", service_manager="process", units_dir="/srv/u",
                    state_dir="/srv/state")
    r = render(TWO_NODE, box, role=node_roles(TWO_NODE, [GPU1, box])[1])
    assert r.unit.path == "/srv/u/vllm-kimi-k25-int4-2node.sh" and "--headless" in r.unit.text


@pytest.mark.parametrize("model", sorted(m for m in MODELS if MODELS[m].multinode is None))
def test_role_none_renders_the_single_host_goldens(model):
    """role=None is today's rendering, byte for byte (tests/golden is unchanged by multi-node)."""
    from orchestrator.config.effective import effective

    host = HostEntry(name="gpu1", address="gpu1.example")
    m = MODELS[model]
    r = render(effective(m, host, hardware=next(iter(m.requires.hardware), None)).manifest, host, role=None)
    assert r.unit.text == (GOLDEN / model / f"vllm-{model}.service").read_text()
    assert r.env_file.text == (GOLDEN / model / f"{model}.env").read_text()
    assert r.role is None and r.runs_vllm


# -- systemd-analyze verify of every node's units -----------------------------------------------

@pytest.mark.skipif(bool(unitcheck.available()), reason=str(unitcheck.available()))
@pytest.mark.parametrize("m", [TWO_NODE, DP, RAY], ids=["mp", "dp", "ray"])
def test_every_nodes_units_pass_systemd_analyze_verify(m):
    for r in nodes(m):
        units = [r.unit, *(f for f in r.extra if f.path.endswith((".service", ".timer")))]
        binaries = sorted({r.argv[0], r.host.python, "/opt/vllm/bin/ray", "/usr/bin/install"})
        for target in units:
            others = {f.path: f.text for f in [r.env_file, *units] if f is not target}
            ok, err = unitcheck.verify_unit(target.text, binaries, unit_name=target.path.rsplit("/", 1)[1],
                                            extra_files=others)
            assert ok, (r.role, target.path, err)


# -- `vllm-orch render M --host a,b` ----------------------------------------------------------------

def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "hosts.yaml").write_text(yaml.safe_dump({"hosts": {
        "gpu1": {"address": "10.0.0.1", "cluster": {"interface": "ens1f0"}},
        "gpu2": {"address": "gpu2.example", "cluster": {"address": "10.0.0.2"}},
        "gpu3": {"address": "gpu3.example"}}}))
    env = {**os.environ, "VLLM_ORCH_STATE_HOME": str(tmp_path / "state"), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "render", *args], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=120)


def test_cli_render_shows_every_nodes_files(tmp_path):
    p = cli(tmp_path, "kimi-k25-int4-2node", "--host", "gpu1,gpu2")
    assert p.returncode == 0, p.stderr
    assert p.stdout.index("node 0 of 2 (head): gpu1") < p.stdout.index("node 1 of 2 (headless): gpu2")
    head, worker = p.stdout.split("node 1 of 2 (headless): gpu2")
    assert "ExecStartPost=" in head and "ExecStartPost=" not in worker
    assert "VLLM_HOST_IP=10.0.0.1" in head and "VLLM_HOST_IP=10.0.0.2" in worker
    assert "--master-addr 10.0.0.1" in worker.replace('",\n "', " ")
    assert "* --node-rank 1 --headless" in worker
    p = cli(tmp_path, "kimi-k25-int4-2node", "--host", "gpu1,gpu2", "--out", "out")
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "out/gpu2/argv.json").read_text())[-1] == "30"
    assert (tmp_path / "out/gpu1/vllm-kimi-k25-int4-2node-health.timer").exists()
    assert not (tmp_path / "out/gpu2/vllm-kimi-k25-int4-2node-health.timer").exists()


def test_cli_render_refuses_a_wrong_node_count(tmp_path):
    p = cli(tmp_path, "kimi-k25-int4-2node", "--host", "gpu1")
    assert p.returncode == 2
    assert "kimi-k25-int4-2node runs on 2 nodes (multinode.nodes) but 1 host was given: gpu1" in p.stderr
    p = cli(tmp_path, "kimi-k25-int4-2node", "--host", "gpu1,gpu3")
    assert p.returncode == 2 and "hosts.gpu3.address: 'gpu3.example' is not an IP address" in p.stderr
    p = cli(tmp_path, "kimi-k25-int4", "--host", "gpu1,gpu2")
    assert p.returncode == 2 and "kimi-k25-int4 runs on one host" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_worker_nodes_env_file_holds_no_api_key():
    """Worker nodes serve no HTTP: the API key (VLLM_API_KEY) was written to their env files anyway.
    The head keeps it; the other secrets (model code on every node may read them) stay on every node."""
    from orchestrator.config.manifest import load_manifest
    from orchestrator.config.placement import node_roles
    from orchestrator.paths import shipped_dir
    from orchestrator.render.artifacts import render
    from orchestrator.secret import Secret

    m = load_manifest(shipped_dir("models") / "kimi-k25-int4-2node.yaml")
    m = m.model_validate({**m.model_dump(), "serving": {**m.serving.model_dump(),
                                                        "secret_env": ["VLLM_API_KEY", "HF_TOKEN"]}})
    hosts = [HostEntry(name=f"gpu{i}", address=f"10.0.0.{i}") for i in (1, 2)]
    secrets = {"VLLM_API_KEY": Secret("sk-head-only"), "HF_TOKEN": Secret("hf_x")}
    head, worker = (render(m, h, secrets, role=r) for h, r in zip(hosts, node_roles(m, hosts)))
    assert "VLLM_API_KEY=sk-head-only" in head.env_file.data().decode()
    assert "sk-head-only" not in worker.env_file.data().decode() and "VLLM_API_KEY" not in worker.env_file.text
    assert "HF_TOKEN=hf_x" in worker.env_file.data().decode()


@pytest.mark.parametrize("changes, expected", [
    ({}, 600),                                                        # torch's NCCL default
    ({"multinode": {"join_timeout_seconds": 30}}, 600),               # the join wait is not the flag
    ({"loading": {"other_seconds": 1800.5}}, 1801),                   # the declared compile time
    ({"multinode": {"collective_timeout_seconds": 3600}}, 3600),
])
def test_the_collective_timeout_is_never_below_torchs_default_nor_the_compile_time(changes, expected):
    for m in (variant(TWO_NODE, **changes), variant(DP, **changes)):
        for r in nodes(m):
            assert after(r.argv, "--distributed-timeout-seconds") == str(expected), (m.name, r.argv)


def test_the_ray_head_unit_has_the_cache_environment_of_the_vllm_unit():
    """vLLM's workers on the head are the raylet's children: they inherit ray-NAME.service's
    environment, which must carry the same compile and JIT caches as vllm-NAME.service (with
    ProtectHome= a Triton JIT compile under ~/.triton fails)."""
    head, _worker = nodes(RAY)
    ray_unit = next(f for f in head.extra if f.path == f"/etc/systemd/system/{ray_unit_name(RAY)}")
    ray_env = " ".join(directives(ray_unit.text)["Environment"])
    vllm_env = " ".join(e for e in directives(head.unit.text)["Environment"] if not e.startswith("RAY_ADDRESS"))
    for name in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE",
                 "CUDA_CACHE_PATH", "XDG_CACHE_HOME"):
        assert f"{name}=%C/vllm-orch" in ray_env, (name, ray_env)
    assert ray_env == vllm_env and directives(ray_unit.text)["CacheDirectory"] == ["vllm-orch"]


def test_a_ray_node_never_takes_the_heads_network_interface():
    """vLLM's Ray executor (0.33) fills each worker's missing variables from the head's environment
    (setdefault): a node without its own interface would get the head's NCCL_SOCKET_IFNAME. Every Ray
    node's env file names its own, or sets it empty (NCCL and Gloo then choose); mp nodes do not need it."""
    head, worker = nodes(RAY, (GPU1, GPU3))              # gpu3 names no interface
    assert env_lines(head)["NCCL_SOCKET_IFNAME"] == env_lines(head)["GLOO_SOCKET_IFNAME"] == "ens1f0"
    assert env_lines(worker)["NCCL_SOCKET_IFNAME"] == env_lines(worker)["GLOO_SOCKET_IFNAME"] == ""
    _head, mp_worker = nodes(TWO_NODE, (GPU1, GPU3))
    assert "NCCL_SOCKET_IFNAME" not in env_lines(mp_worker)
    # the manifest's own value (the same on every node) is kept and is what the head passes on
    pinned = variant(RAY, env={**RAY.env, "NCCL_SOCKET_IFNAME": "ib0"})
    plain = HostEntry(name="gpu4", address="10.0.0.4")          # no interface either
    assert env_lines(nodes(pinned, (GPU3, plain))[1]).get("NCCL_SOCKET_IFNAME") == "ib0"
