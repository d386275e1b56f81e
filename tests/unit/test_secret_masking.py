"""Plan diffs of an installed env file show no secret: every value whose key is not one vllm-orch
knows to be harmless (the ones it writes itself, the manifest's env) is masked, including a secret
that has since been removed from serving.secret_env (regen --dry-run printed it in clear)."""

from __future__ import annotations

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import load_all
from orchestrator.paths import shipped_dir
from orchestrator.plan.inputs import ServiceInput
from orchestrator.plan.service import install_action
from orchestrator.render.artifacts import render

MODELS, _ = load_all(shipped_dir("models"))
ENTRY = HostEntry(name="gpu1", address="gpu1.example")


def test_a_secret_dropped_from_secret_env_is_masked_in_the_diff():
    m = MODELS["kimi-k25-int4"]                   # lists no secret_env now
    r = render(m, ENTRY, {})
    installed = ("# Managed by vllm-orch: an older env file\nCUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7\n"
                 "HF_TOKEN=hf_StillOnDiskFromLastYear\nVLLM_API_KEY='sk-old key'\nVLLM_WORKER_MULTIPROC_METHOD=fork\n"
                 "export SNEAKY=hunter2\nnot even an assignment hunter3\n")
    svc = ServiceInput(manifest=m, rendered=r, installed_files={r.env_file.path: installed.encode(),
                                                                r.unit.path: r.unit.data()})
    action = install_action(ENTRY, svc)
    text = "\n".join(action.details)
    for secret in ("hf_StillOnDiskFromLastYear", "sk-old key", "hunter2", "hunter3"):
        assert secret not in text, text
    assert "-HF_TOKEN=***" in text and "-VLLM_API_KEY=***" in text
    assert "-VLLM_WORKER_MULTIPROC_METHOD=fork" in text    # a key of the manifest's env: harmless, shown
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in text or "CUDA_VISIBLE_DEVICES" not in text


def test_the_keys_shown_in_clear_are_exactly_what_the_template_writes():
    from orchestrator.config.inventory import HostEntry
    from orchestrator.config.placement import node_roles
    from orchestrator.render.artifacts import ORCH_ENV
    from orchestrator.secret import Secret

    node_keys = {"VLLM_HOST_IP", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}     # a node of a multi-node service
    for m in MODELS.values():
        r = render(m, ENTRY, {k: Secret("s") for k in m.serving.secret_env})
        keys = {line.split("=", 1)[0] for line in r.env_file.text.splitlines() if line and not line.startswith("#")}
        sleep_keys = set() if m.sleep else {"VLLM_SERVER_DEV_MODE"}       # only with sleep mode
        assert keys == (set(ORCH_ENV) - node_keys - sleep_keys) | set(m.env) | set(m.serving.secret_env), m.name
        if m.multinode is not None:
            hosts = [HostEntry(name=f"n{i}", address=f"10.0.0.{i}", cluster={"interface": "ib0"})
                     for i in range(m.multinode.nodes)]
            for host, role in zip(hosts, node_roles(m, hosts)):
                r = render(m, host, role=role)
                keys = {line.split("=", 1)[0] for line in r.env_file.text.splitlines()
                        if line and not line.startswith("#")}
                assert keys == (set(ORCH_ENV) - sleep_keys) | set(m.env) | set(m.serving.secret_env), (m.name, role)


def test_regen_keeps_an_installed_secret_it_is_not_given(tmp_path, monkeypatch):
    """`regen` without VLLM_API_KEY in its environment rendered the env file without it, and
    installing that removed the key from a serving host. A secret vllm-orch is not given keeps the
    installed file's value (deploy and swap refuse instead: tests/unit/test_hostile_input.py)."""
    from orchestrator.config.inventory import HostEntry
    from orchestrator.config.manifest import Manifest
    from orchestrator.config.placement import Request
    from orchestrator.host.facts import HostFacts
    from orchestrator.host.local import LocalHost
    from orchestrator.ops.gather import HostReads, service_input, service_spec

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    entry = HostEntry(name="h", address="local", service_manager="process", units_dir=str(tmp_path / "units"),
                      state_dir=str(tmp_path / "state"), models_root=str(tmp_path / "models"))
    m = Manifest.model_validate({"name": "m", "source": {"repo": "a/b"}, "serving": {"gpus": 1,
                                 "secret_env": ["VLLM_API_KEY"]}})
    (tmp_path / "units").mkdir()
    (tmp_path / "units" / "vllm-m.env").write_text("CUDA_VISIBLE_DEVICES=0\nVLLM_API_KEY=\"it's-old\"\n")
    facts = HostFacts(hostname="h", disk_path="/", disk_total=10, disk_free=5, gpus=[], gpu_error=None,
                      driver_version=None, cuda_version=None, procs=[], vllm_version=None, vllm_error=None,
                      models={}, active=None, installed={}, services={}, usage={})
    host = LocalHost("h")
    spec = service_spec(m, [entry], Request(), {"h": facts})
    svc = service_input(HostReads(host, entry), entry, m, facts, spec, keep_installed_secrets=True)
    assert svc.secrets["VLLM_API_KEY"].reveal() == "it's-old"
    assert "VLLM_API_KEY=\"it's-old\"" in svc.rendered.env_file.data().decode()
    assert "VLLM_API_KEY=***" in svc.rendered.env_file.text
