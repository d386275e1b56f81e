"""The performance floor, pure: which expected figures a measurement misses, the likely causes it
names, the manifest's performance section, and the perf step's place in the plans."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from orchestrator.config.effective import effective
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Performance, load_all
from orchestrator.host.records import ServiceRecord
from orchestrator.paths import shipped_dir
from orchestrator.plan.perf import expected_text, likely_causes, shortfalls
from orchestrator.probe.perf import Measured

MODELS, _ = load_all(shipped_dir("models"))
HOST = HostEntry(name="gpu1", address="gpu1.example")


def test_far_below_is_below_the_floor_fraction_of_each_expected_figure():
    perf = Performance(single_stream_tok_s=80, concurrency=32, concurrency_tok_s=900, floor=0.75)
    assert shortfalls(perf, Measured(single_stream_tok_s=61, concurrency=32, concurrency_tok_s=700)) == []
    (short,) = shortfalls(perf, Measured(single_stream_tok_s=35, concurrency=32, concurrency_tok_s=700))
    assert short.describe() == "single stream: 35.0 tok/s, expected 80 (far below under 60.0)"
    both = shortfalls(perf, Measured(single_stream_tok_s=None, concurrency=32, concurrency_tok_s=600))
    assert [s.figure for s in both] == ["single stream", "32 streams"] and both[0].measured is None
    assert expected_text(perf) == "80 tok/s single stream and 900 tok/s at 32 streams"


def test_performance_section_checks():
    assert not Performance().expects and Performance(single_stream_tok_s=1).expects
    with pytest.raises(ValidationError):
        Performance(concurrency=8)
    with pytest.raises(ValidationError):
        Performance(single_stream_tok_s=80, on_below="panic")


def test_likely_causes_start_with_what_changed_since_the_last_good_measurement():
    m = effective(MODELS["kimi-k25-int4"], HOST, hardware="rtx-pro-6000").manifest
    argv = ["vllm", "serve", "/m", "--tensor-parallel-size", "8", "--kv-cache-dtype", "fp8"]
    previous = ServiceRecord(model=m.name, perf={"ok": True, "single_stream_tok_s": 80.1}, deployed_at="2026-08-01",
                             argv=["vllm", "serve", "/m", "--tensor-parallel-size", "8", "--kv-cache-dtype", "auto"],
                             vllm_version="0.32.0")
    causes = likely_causes(m, argv, {}, "0.33.0", previous)
    assert causes[0] == ("the vLLM command line changed since 80.1 tok/s was measured (2026-08-01): "
                         "+--kv-cache-dtype fp8, ---kv-cache-dtype auto")
    assert causes[1].startswith("vLLM changed from 0.32.0 to 0.33.0")
    assert causes[-1].startswith("something no configuration shows")


def test_likely_causes_name_the_layout_and_host_settings_with_their_origin():
    m = effective(MODELS["kimi-k25-int4-dcp8"], HOST, hardware="rtx-pro-6000").manifest
    data = m.model_dump()
    data["env"]["NCCL_P2P_DISABLE"] = "1"
    from orchestrator.config.manifest import Manifest

    m = Manifest.model_validate(data)
    origins = {"env.NCCL_P2P_DISABLE": "hosts.yaml:9: hosts.gpu1.service_env.NCCL_P2P_DISABLE",
               "vllm.attention_backend": "hosts.yaml:12: hosts.gpu1.overrides.x.vllm.attention_backend"}
    causes = likely_causes(m, [], origins, "0.33.0", None)
    text = "\n".join(causes)
    assert "decode context parallel 8 trades single-stream speed" in text
    assert "NCCL_P2P_DISABLE=1 (hosts.yaml:9: hosts.gpu1.service_env.NCCL_P2P_DISABLE)" in text
    assert "vllm.attention_backend TRITON_MLA comes from hosts.yaml:12" in text
    assert "the host's NCCL settings (NCCL_P2P_DISABLE)" in text
