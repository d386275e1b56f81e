"""Issue 12's per-host tuning, version traps and performance floor on the SIMULATED host: the host's
service_env in the service's environment, a B200 host served by the manifest's b200 class, an old
vLLM refused before the download (and, let through, dying at the first decode like the real one),
and the throughput measured after the smoke test: recorded, warned about, or failing a swap into
its rollback."""

from __future__ import annotations

import json

from orchestrator.config.manifest import Manifest
from orchestrator.errors import RefusedError
from orchestrator.host.state import read_active, read_history
from orchestrator.plan.perf import BelowFloor
from orchestrator.probe.api import Endpoint, health
from orchestrator.probe.readiness import NotReady
from orchestrator.sim import manager

from .deployhelp import deploy, entry, free_port, on_port, statuses, swap, tuned


def set_sim(sim_host, *, vllm: str | None = None, gpu: tuple[str, int] | None = None) -> None:
    """Make the simulated host run another vLLM release or other GPUs (read at each start)."""
    path = sim_host.dir / "sim.json"
    info = json.loads(path.read_text())
    if vllm:
        info["vllm_version"] = vllm
        manager.write_dist(sim_host.dir / "site-packages", "vllm", vllm)
    if gpu:
        for g in info["gpus"]:
            g["name"], g["memory_total_mib"] = gpu
    path.write_text(json.dumps(info))


def test_host_service_env_reaches_the_running_service(sim_host):
    e = entry(sim_host, service_env={"NCCL_P2P_LEVEL": "SYS", "NCCL_GRAPH_FILE": "/etc/nccl/graph.xml"})
    assert "PYTHONPATH" in e.env                                    # the sim's env for vllm-orch's commands
    m = on_port("minimax-m25")
    result = deploy(e, m)
    assert result.ok, result.error
    env_file = (sim_host.dir / "units" / f"vllm-{m.name}.env").read_text()
    assert "NCCL_P2P_LEVEL=SYS" in env_file and "NCCL_GRAPH_FILE=/etc/nccl/graph.xml" in env_file
    assert "PYTHONPATH" not in env_file                            # vllm-orch's own commands only
    assert "VLLM_USE_DEEP_GEMM=0" in env_file                      # the rtx-pro-6000 class's env
    assert read_active(sim_host.host, e).hardware == "rtx-pro-6000"


def test_a_b200_host_runs_the_b200_class(sim_host):
    set_sim(sim_host, gpu=("NVIDIA B200", 183359))
    e, m = entry(sim_host), on_port("kimi-k25-nvfp4")
    result = deploy(e, m)
    assert result.ok, result.error
    pre = next(a for a in result.plan.actions if a.step == "preflight")
    assert any("hardware class b200 (SM100, NVLink; requires.hardware.b200 applied)" in d for d in pre.details)
    argv = read_active(sim_host.host, e).argv
    assert "--moe-backend" not in argv and "--attention-backend" not in argv      # the SM120 choices stay there
    assert read_active(sim_host.host, e).hardware == "b200"


def test_an_h100_host_is_refused_naming_the_classes(sim_host):
    set_sim(sim_host, gpu=("NVIDIA H100 80GB HBM3", 81559))
    result = deploy(entry(sim_host), on_port("kimi-k25-int4"))
    assert isinstance(result.error, RefusedError) and result.error.step == "preflight"
    assert "class h100" in str(result.error) and "add requires.hardware.h100" in str(result.error)
    assert result.outcome is None                                   # refused: nothing ran


def _old_kimi_layout() -> Manifest:
    """The kimi-k25-int4 manifest as it shipped before: FP8 KV + DCP 8 with a 0.19.1 floor."""
    m = on_port("kimi-k25-int4-dcp8")
    data = m.model_dump()
    data["requires"]["hardware"]["rtx-pro-6000"]["min_vllm_version"] = None
    return Manifest.model_validate(data)


def test_fp8_kv_with_dcp_on_vllm_0_24_is_refused_before_the_download(sim_host):
    set_sim(sim_host, vllm="0.24.0")
    e, m = entry(sim_host), _old_kimi_layout()
    result = deploy(e, m)
    assert isinstance(result.error, RefusedError) and result.error.step == "preflight"
    assert "version-traps: vLLM 0.24.0 accepts --kv-cache-dtype fp8 + --decode-context-parallel-size 8" \
        in str(result.error)
    assert not (sim_host.dir / "models" / m.name).exists(), "nothing may be downloaded"


def test_let_through_it_dies_at_the_first_decode_like_vllm_0_24(sim_host):
    """The stand-in fails the way the real one does: a clean load, then the smoke test's first
    decode kills the engine with the assertion (vllm-project/vllm#32010)."""
    set_sim(sim_host, vllm="0.24.0")
    e, m = entry(sim_host), _old_kimi_layout()
    result = deploy(e, m, skip_checks=frozenset({"version-traps"}))
    assert isinstance(result.error, NotReady), result.error
    assert "DCP not support fp8 kvcache now" in (result.error.root_cause or "")
    assert "0.25.0" in (result.error.hint or "")
    assert statuses(result)["download"] == "done"


def test_throughput_is_measured_and_recorded(sim_host):
    e, m = entry(sim_host), tuned("kimi-k25-int4", perf_tokens=None)       # the manifest's 256 tokens
    result = deploy(e, m)
    assert result.ok, result.error
    perf = read_history(sim_host.host, e)[-1].shown()["perf"]
    # the profile decodes at 79 tok/s; a busy 2-core machine keeps well within the 75% floor
    assert perf["ok"] and 59 < perf["single_stream_tok_s"] < 100, perf
    assert perf["seconds"] < 30 and read_active(sim_host.host, e).perf["ok"]
    assert "warnings" not in result.extra


def test_far_below_the_floor_warns_naming_likely_causes(sim_host):
    e, m = entry(sim_host, service_env={"NCCL_P2P_DISABLE": "1"}), on_port("kimi-k25-int4")
    manager.add_fault("sim", "slow-decode", model=m.name, home=sim_host.home)
    result = deploy(e, m)
    assert result.ok, result.error                                  # warn: the manifest's default
    (warning,) = result.extra["warnings"]
    assert "far below its expected throughput: single stream" in warning and "expected 79" in warning
    perf = read_history(sim_host.host, e)[-1].shown()["perf"]
    assert not perf["ok"] and perf["single_stream_tok_s"] < 59
    assert any("NCCL_P2P_DISABLE=1" in c for c in perf["likely_causes"])


def test_a_failing_floor_rolls_a_swap_back(sim_host):
    port = free_port()
    old = on_port("kimi-k25-nvfp4", port)
    new = on_port("kimi-k25-int4", port)
    data = new.model_dump()           # the figure is the RTX PRO 6000 class's: make it a hard floor there
    data["requires"]["hardware"]["rtx-pro-6000"]["performance"]["on_below"] = "fail"
    new = Manifest.model_validate(data)
    e = entry(sim_host)
    assert deploy(e, old).ok
    manager.add_fault("sim", "slow-decode", model=new.name, home=sim_host.home)
    result = swap(e, new, {old.name: old, new.name: new})
    assert isinstance(result.error, BelowFloor) and result.error.step == "perf", result.error
    assert any("likely causes" in d for d in result.error.details)
    assert result.extra["rollback"]["ok"], result.extra["rollback"]
    assert health(Endpoint(sim_host.host, port)) == 200 and read_active(sim_host.host, e).model == old.name
    swap_record = [h.shown() for h in read_history(sim_host.host, e) if h.operation == "swap"][-1]
    assert swap_record["failure_kind"] == "perf" and not swap_record["perf"]["ok"]
