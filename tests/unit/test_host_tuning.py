"""Per-host tuning belongs to the host, per-model to the model: the inventory's service_env reaches
the service's env file (its `env` stays vllm-orch's own), host overrides of manifest fields with
their precedence and conflicts, hardware classes picked by the host's GPUs, and `render --host`
saying where each value comes from."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from orchestrator.config.effective import effective
from orchestrator.config.hardware import class_of, classify
from orchestrator.config.inventory import HostEntry, load_inventory_file
from orchestrator.config.manifest import Manifest, load_all, load_manifest
from orchestrator.errors import ConfigError
from orchestrator.host.nvidia_smi import Gpu
from orchestrator.paths import shipped_dir
from orchestrator.plan.preflight import FAIL, OK, check_gpus, needs_for
from orchestrator.render.artifacts import render

MODELS, _ = load_all(shipped_dir("models"))
RTX = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
B200 = "NVIDIA B200"
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    """Files are written to tmp_path and named relative to it, as a user in that folder sees them."""
    monkeypatch.chdir(tmp_path)


def names(gpu: str, n: int = 8) -> dict[int, str]:
    return {i: gpu for i in range(n)}


def inventory(tmp_path: Path, host: dict) -> HostEntry:
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump({"hosts": {"gpu1": {"address": "gpu1.example", **host}}}, sort_keys=False))
    return load_inventory_file(path).hosts["gpu1"]


def line(needle: str, path: str = "hosts.yaml") -> int:
    """1-based number of the first line of the file (in the current folder) holding `needle`."""
    return next(i for i, text in enumerate(Path(path).read_text().splitlines(), 1) if needle in text)


def manifest(tmp_path: Path, text: str, name: str = "m") -> Manifest:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return load_manifest(path)


# -- hardware classes ------------------------------------------------------------------------------
def test_gpu_names_pick_a_class():
    assert class_of(RTX).key == "rtx-pro-6000"
    assert class_of("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition").key == "rtx-pro-6000"
    assert class_of(B200).key == "b200" and class_of("NVIDIA GB200").key == "gb200"
    assert class_of("NVIDIA H200").key == "h200" and class_of(H100).key == "h100"
    assert class_of("NVIDIA GeForce RTX 4090") is None
    assert classify([RTX, B200]) == (None, "the chosen GPUs are of different classes (b200, rtx-pro-6000)")
    assert classify([]) == (None, None)


def test_a_b200_host_gets_the_b200_needs_and_is_not_refused():
    m = MODELS["kimi-k25-nvfp4"]
    entry = HostEntry(name="hgx", address="hgx.example")
    on_b200 = effective(m, entry, names(B200))
    assert on_b200.hardware == "b200" and on_b200.hardware_problem is None and on_b200.applied
    assert on_b200.manifest.vllm.moe_backend is None                     # FlashInfer's own choice on SM100
    assert "NCCL_IB_DISABLE" not in on_b200.manifest.env
    on_rtx = effective(m, entry, names(RTX))
    assert on_rtx.manifest.vllm.moe_backend == "marlin" and on_rtx.manifest.vllm.attention_backend == "TRITON_MLA"
    assert on_rtx.manifest.requires.min_vllm_version == "0.24.0"
    assert on_rtx.origin("vllm.moe_backend") == "requires.hardware.rtx-pro-6000"
    assert on_rtx.origin("vllm.tensor_parallel_size") == "manifest"
    # preflight shows which class applied, and accepts the B200 host
    needs = needs_for(on_b200.manifest, [], [], effective=on_b200).gpu_needs
    gpus = [Gpu(index=i, name=B200, memory_total_mib=183359) for i in range(8)]
    c = check_gpus(gpus, needs)
    assert c.status == OK and "hardware class b200 (SM100, NVLink; requires.hardware.b200 applied)" in c.summary


def test_a_host_of_a_class_the_manifest_does_not_name_is_refused_with_the_fix():
    eff = effective(MODELS["kimi-k25-int4"], HostEntry(name="h", address="h"), names(H100))
    assert eff.hardware == "h100" and not eff.applied
    assert "states what it needs on rtx-pro-6000, h200, b200 only" in eff.hardware_problem
    needs = needs_for(eff.manifest, [], [], effective=eff).gpu_needs
    c = check_gpus([Gpu(index=i, name=H100, memory_total_mib=97000) for i in range(8)], needs)
    assert c.status == FAIL and c.field == "requires.hardware" and "add requires.hardware.h100" in c.summary


def test_a_manifest_without_classes_runs_on_any_gpu():
    eff = effective(MODELS["example"], HostEntry(name="h", address="h"), {7: "NVIDIA GeForce RTX 4090"})
    assert eff.hardware is None and eff.hardware_problem is None


@pytest.mark.parametrize("text,message", [
    ("requires: {hardware: {b20: {}}}", "requires.hardware.b20: 'b20' is not a hardware class - did you mean 'b200'?"),
    ("requires: {hardware: {b200: {vllm: {tensor_parallel_size: 4}}}}",
     "requires.hardware.b200.vllm.tensor_parallel_size: tensor_parallel_size is part of the layout"),
    ("requires: {hardware: {b200: {vllm: {atention_backend: X}}}}",
     "requires.hardware.b200.vllm.atention_backend: unknown field - did you mean 'attention_backend'?"),
    ("requires: {hardware: {b200: {vllm: {gpu_memory_utilization: 2}}}}",
     "requires.hardware.b200.vllm.gpu_memory_utilization: on b200: Input should be less than or equal to 0.99"),
    ("requires: {hardware: {b200: {env: {HF_TOKEN: x}}}}",
     "requires.hardware.b200.env.HF_TOKEN: HF_TOKEN looks like a secret"),
    ("requires: {gpu_name: RTX, hardware: {b200: {}}}",
     "requires.gpu_name: use requires.hardware or requires.gpu_name"),
    ("env: {CUDA_VISIBLE_DEVICES: '0'}", "env.CUDA_VISIBLE_DEVICES: CUDA_VISIBLE_DEVICES is written by vllm-orch"),
    ("performance: {concurrency: 32}", "performance.concurrency: concurrency and concurrency_tok_s go together"),
])
def test_manifest_hardware_errors_name_the_field(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        manifest(tmp_path, "source: {repo: a/b}\nserving: {gpus: 1}\n" + text + "\n")
    assert message in str(info.value) and str(info.value).startswith("m.yaml:")


# -- the host's service environment ----------------------------------------------------------------
def test_service_env_reaches_the_env_file_and_env_stays_for_commands(tmp_path):
    entry = inventory(tmp_path, {"env": {"HF_ENDPOINT": "https://hf-mirror.internal"},
                                 "service_env": {"NCCL_P2P_LEVEL": "SYS", "NCCL_GRAPH_FILE": "/etc/nccl/graph.xml"},
                                 "overrides": {"minimax-m25-ep": {"service_env": {
                                     "VLLM_TUNED_CONFIG_FOLDER": "/opt/moe-configs"}}}})
    eff = effective(MODELS["minimax-m25-ep"], entry, names(RTX))
    text = render(eff.manifest, entry).env_file.text
    assert "NCCL_P2P_LEVEL=SYS\n" in text and "NCCL_GRAPH_FILE=/etc/nccl/graph.xml\n" in text
    assert "VLLM_TUNED_CONFIG_FOLDER=/opt/moe-configs\n" in text
    assert "HF_ENDPOINT" not in text                            # the commands' env, not the service's
    where = f"hosts.yaml:{line('NCCL_P2P_LEVEL')}: hosts.gpu1.service_env.NCCL_P2P_LEVEL"
    assert eff.origin("env.NCCL_P2P_LEVEL") == where
    other = render(effective(MODELS["minimax-m25"], entry, names(RTX)).manifest, entry).env_file.text
    assert "VLLM_TUNED_CONFIG_FOLDER" not in other and "NCCL_P2P_LEVEL=SYS" in other


@pytest.mark.parametrize("field", ["env", "service_env"])
def test_secrets_are_refused_in_the_inventory_pointing_to_secret_env(tmp_path, field):
    with pytest.raises(ConfigError) as info:
        inventory(tmp_path, {field: {"VLLM_API_KEY": "sk-123"}})
    assert f"hosts.yaml:{line('VLLM_API_KEY')}: hosts.gpu1.{field}.VLLM_API_KEY: VLLM_API_KEY looks like a secret" \
        in str(info.value)
    assert "serving.secret_env" in str(info.value) and "sk-123" not in str(info.value)


def test_a_host_env_contradicting_the_model_is_an_error_naming_both(tmp_path):
    entry = inventory(tmp_path, {"service_env": {"NCCL_IB_DISABLE": "0"}})
    with pytest.raises(ConfigError) as info:
        effective(MODELS["kimi-k25-int4"], entry, names(RTX))
    assert str(info.value) == (f"hosts.yaml:{line('NCCL_IB_DISABLE')}: hosts.gpu1.service_env.NCCL_IB_DISABLE: "
                               "kimi-k25-int4 sets "
                               "NCCL_IB_DISABLE=1 (requires.hardware.rtx-pro-6000); a host adds service "
                               "environment, it does not change a model's")
    assert info.value.exit_code == 2
    same = inventory(tmp_path, {"service_env": {"NCCL_IB_DISABLE": "1"}})         # the same value: fine
    assert effective(MODELS["kimi-k25-int4"], same, names(RTX)).manifest.env["NCCL_IB_DISABLE"] == "1"
    # on a B200 the class does not set it, so the host may
    assert effective(MODELS["kimi-k25-int4"], entry, names(B200)).manifest.env["NCCL_IB_DISABLE"] == "0"


def test_names_vllm_orch_writes_and_the_models_secrets_are_refused_in_service_env(tmp_path):
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES is written by vllm-orch from serving.gpu_ids"):
        effective(MODELS["example"], inventory(tmp_path, {"service_env": {"CUDA_VISIBLE_DEVICES": "0"}}))


# -- overrides of manifest fields ------------------------------------------------------------------
def test_overrides_win_model_entry_over_star_and_are_shown(tmp_path):
    entry = inventory(tmp_path, {"overrides": {
        "*": {"vllm": {"gpu_memory_utilization": 0.85}, "startup": {"budget_seconds": 7200}},
        "minimax-m25": {"serving": {"gpu_ids": [4, 5, 6, 7], "port": 8001}, "vllm": {"gpu_memory_utilization": 0.8}}}})
    eff = effective(MODELS["minimax-m25"], entry, names(RTX))
    m = eff.manifest
    assert m.serving.visible_devices == [4, 5, 6, 7] and m.serving.port == 8001
    assert m.vllm.gpu_memory_utilization == 0.8 and m.startup.budget_seconds == 7200
    assert eff.origin("vllm.gpu_memory_utilization").endswith(
        "hosts.gpu1.overrides.minimax-m25.vllm.gpu_memory_utilization")
    assert eff.origin("startup.budget_seconds").endswith("overrides.*.startup.budget_seconds")
    r = render(m, entry)
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7" in r.env_file.text and "--port 8001" in r.unit.text
    assert "TimeoutStartSec=7200" in r.unit.text
    kimi = effective(MODELS["kimi-k25-int4"], entry, names(RTX)).manifest
    assert kimi.vllm.gpu_memory_utilization == 0.85 and kimi.serving.port == 8000


def test_an_override_that_breaks_the_manifest_blames_the_host_line(tmp_path):
    entry = inventory(tmp_path, {"overrides": {"minimax-m25": {"serving": {"gpu_ids": [0, 1]}}}})
    with pytest.raises(ConfigError) as info:
        effective(MODELS["minimax-m25"], entry, names(RTX))
    assert str(info.value).startswith(f"hosts.yaml:{line('gpu_ids')}: hosts.gpu1.overrides.minimax-m25.serving."
                                      "gpu_ids: with this host's settings minimax-m25 is not valid:")
    assert "lists 2 GPUs but serving.gpus is 4" in str(info.value)


def test_override_keys_and_fields_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="overrides.Kimi: 'Kimi' is not a model name"):
        inventory(tmp_path, {"overrides": {"Kimi": {}}})
    with pytest.raises(ConfigError, match="did you mean 'gpu_memory_utilization'"):
        inventory(tmp_path, {"overrides": {"*": {"vllm": {"gpu_memory_utilisation": 0.9}}}})
    with pytest.raises(ConfigError, match="unknown field"):            # layout is not per host
        inventory(tmp_path, {"overrides": {"*": {"vllm": {"tensor_parallel_size": 4}}}})


def test_render_host_shows_where_each_value_comes_from(tmp_path, monkeypatch):
    from orchestrator.cli.main import cli

    monkeypatch.chdir(tmp_path)
    inventory(tmp_path, {"service_env": {"NCCL_P2P_LEVEL": "SYS"},
                         "overrides": {"kimi-k25-int4": {"serving": {"port": 8001}}}})
    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path / "state"))
    res = CliRunner().invoke(cli, ["render", "kimi-k25-int4", "--host", "gpu1", "--hardware", "rtx-pro-6000"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "hardware class rtx-pro-6000 (SM120, PCIe; requires.hardware.rtx-pro-6000 applied)" in out
    assert "* --port 8001" in out
    assert f"<- hosts.yaml:{line('port')}: hosts.gpu1.overrides.kimi-k25-int4.serving.port" in out
    assert "* --attention-backend TRITON_MLA" in out and "<- requires.hardware.rtx-pro-6000" in out
    assert "* NCCL_P2P_LEVEL=SYS" in out and "  --tensor-parallel-size 8" in out
    assert "<- manifest vllm.tensor_parallel_size" in out
