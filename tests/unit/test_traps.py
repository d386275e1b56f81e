"""Version traps, known before the download: flag combinations a vLLM release accepts and then dies
of after the load, checked in preflight against the host's vLLM; the shipped floors avoid them;
environment variables nothing reads are warned about."""

from __future__ import annotations

import re

import pytest

from orchestrator.config.effective import effective
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import load_all
from orchestrator.paths import shipped_dir
from orchestrator.plan.preflight import FAIL, OK, WARN, check_env, check_traps, needs_for
from orchestrator.plan.traps import TRAPS, springs
from orchestrator.plan.versions import version_key
from orchestrator.render.artifacts import render

MODELS, _ = load_all(shipped_dir("models"))
HOST = HostEntry(name="gpu1", address="gpu1.example")
DCP_FP8 = ["vllm", "serve", "/m", "--tensor-parallel-size", "8", "--decode-context-parallel-size", "8",
           "--kv-cache-dtype", "fp8", "--attention-backend", "TRITON_MLA"]
PROVENANCE = [("--decode-context-parallel-size", "vllm.decode_context_parallel_size"),
              ("--kv-cache-dtype", "vllm.kv_cache_dtype")]


@pytest.mark.parametrize("version", ["0.19.1", "0.24.0", "0.24.0+cu130", "0.25.0rc1"])
def test_fp8_kv_with_dcp_fails_on_versions_that_assert(version):
    c = check_traps(version, DCP_FP8, PROVENANCE)
    assert c.status == FAIL and c.field == "vllm.kv_cache_dtype"
    assert f"vLLM {version} accepts --kv-cache-dtype fp8 + --decode-context-parallel-size 8" in c.summary
    assert any("DCP not support fp8 kvcache now." in d for d in c.details)
    assert any("https://github.com/vllm-project/vllm/pull/44044" in d for d in c.details)
    assert "0.25.0" in c.fix


@pytest.mark.parametrize("version,argv", [
    ("0.25.0", DCP_FP8), ("0.33.0", DCP_FP8),
    ("0.19.1", [t for t in DCP_FP8 if t not in ("--kv-cache-dtype", "fp8")]),       # BF16 KV + DCP
    ("0.19.1", DCP_FP8[:5] + ["--kv-cache-dtype=fp8_e4m3"]),                         # FP8 KV, no DCP
])
def test_no_trap_when_fixed_or_not_combined(version, argv):
    assert check_traps(version, argv).status == OK


def test_triton_mla_with_fp8_kv_before_0_18():
    argv = ["serve", "/m", "--kv-cache-dtype", "fp8", "--attention-backend", "TRITON_MLA"]
    c = check_traps("0.17.1", argv)
    assert c.status == FAIL and "TritonMLA V1 with FP8 KV cache not yet supported" in "\n".join(c.details)
    assert check_traps("0.18.0", argv).status == OK


def test_every_trap_cites_public_sources_and_a_fix_version():
    for trap in TRAPS:
        assert trap.sources and all(re.match(r"https://github\.com/vllm-project/", s) for s in trap.sources)
        assert re.fullmatch(r"\d+\.\d+\.\d+", trap.fixed_in) and trap.symptom and trap.evidence
        assert all(f.startswith("vllm.") for f in trap.fields)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_shipped_floors_avoid_every_trap_on_every_class(model):
    """A manifest's minimum vLLM must not be a version its own flags crash on (kimi-k25-int4 once
    declared 0.19.1 with FP8 KV + DCP 8: a crash at the first decode after a 36-minute load)."""
    m = MODELS[model]
    for cls in [None, *m.requires.hardware]:
        eff = effective(m, HOST, hardware=cls).manifest
        argv = render(eff, HOST).argv
        floor = eff.requires.min_vllm_version
        assert springs(floor, argv) == [], f"{model} on {cls}: min_vllm_version {floor} walks into a trap"


def test_the_long_context_layout_is_its_own_manifest_with_its_own_floor():
    tp8 = effective(MODELS["kimi-k25-int4"], HOST, hardware="rtx-pro-6000").manifest
    dcp = effective(MODELS["kimi-k25-int4-dcp8"], HOST, hardware="rtx-pro-6000").manifest
    assert tp8.vllm.decode_context_parallel_size == 1 and dcp.vllm.decode_context_parallel_size == 8
    assert tp8.performance.single_stream_tok_s > dcp.performance.single_stream_tok_s
    assert version_key(dcp.requires.min_vllm_version) >= version_key("0.25.0")
    assert "NCCL_PROTO" not in tp8.env and "NCCL_PROTO" not in dcp.env     # host tuning, not the model's


# -- environment nothing reads ------------------------------------------------------------------------
def test_env_that_nothing_reads_warns_and_library_env_passes():
    env = {"SAFETENSORS_FAST_GPU": "1", "NCCL_PROTO": "LL", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    c = check_env(env, [], not_read=["SAFETENSORS_FAST_GPU", "NCCL_PROTO"])
    assert c.status == WARN and c.field == "env.SAFETENSORS_FAST_GPU"
    assert "nothing reads SAFETENSORS_FAST_GPU" in c.summary
    assert check_env({"NCCL_PROTO": "LL"}, [], not_read=["NCCL_PROTO"]).status == OK     # NCCL reads it


def test_env_warnings_name_where_the_variable_was_set(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts.yaml").write_text("hosts:\n  gpu1:\n    address: x\n    service_env: {MY_TUNING: '1'}\n")
    from orchestrator.config.inventory import load_inventory_file

    entry = load_inventory_file(tmp_path / "hosts.yaml").hosts["gpu1"]
    eff = effective(MODELS["kimi-k25-int4"], entry, hardware="rtx-pro-6000")
    needs = needs_for(eff.manifest, [], [], effective=eff)
    assert needs.env_fields["MY_TUNING"] == "hosts.yaml:4: hosts.gpu1.service_env.MY_TUNING"
    assert needs.env_fields["NCCL_IB_DISABLE"] == "requires.hardware.rtx-pro-6000.env.NCCL_IB_DISABLE"
    c = check_env(needs.env, [], env_fields=needs.env_fields, not_read=["MY_TUNING"])
    assert c.status == WARN and c.summary.startswith("hosts.yaml:4: hosts.gpu1.service_env.MY_TUNING: nothing reads")
