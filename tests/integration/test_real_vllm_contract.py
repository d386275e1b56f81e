"""The CONTRACT between vllm-orch and vLLM, checked against the real server (vLLM's CPU build) and the
simulated one with the same probes (tests/integration/vllm_contract.py): wherever the simulator
differs from the real thing, this fails - that is what keeps the simulator honest. Also: readiness
phases and fatal-line detection (probe/logsig.py) read from the real start-up and failure logs."""

from __future__ import annotations

import pytest

from orchestrator.probe import logsig
from tests.plugins.real_vllm import RealServer
from tests.plugins.sim_hosts import SimServer

from .vllm_contract import descendant_titles, diff, extra_metric_problems, observe_dp, observe_http, observe_log, observe_titles

pytestmark = pytest.mark.real_vllm

KEY = "contract-key-0123"
SERVED = "tiny"
ARGS = ["--served-model-name", SERVED, "--api-key", KEY]
SAME_AS_REAL = ["--max-model-len", "1024", "--enforce-eager", "--gpu-memory-utilization", "0.1"]


@pytest.fixture(scope="module")
def real_server(real_vllm, tiny_model, tmp_path_factory):
    """One keyed real server for the module (a real start is ~30 s: shared, not per test)."""
    model = tiny_model("vllm-orch-sim/tiny-llama-a")
    with RealServer(real_vllm, model, ARGS, log_dir=tmp_path_factory.mktemp("contract")) as srv:
        srv.ready_s = srv.wait_ready()
        print(f"\nFIGURE real vLLM (CPU build) tiny model start-to-ready: {srv.ready_s:.1f} s")
        srv.model = model
        yield srv


def test_the_simulator_keeps_the_real_vllm_contract(real_server, sim_host):
    real = observe_http(real_server.port, KEY, SERVED)
    real["log"] = observe_log(real_server.log)
    real["titles"] = observe_titles(descendant_titles(real_server.proc.pid))
    with SimServer(sim_host, [str(real_server.model), *ARGS, *SAME_AS_REAL]) as sim_srv:
        sim_srv.wait_ready()
        sim = observe_http(sim_srv.port, KEY, SERVED)
        sim["log"] = observe_log(sim_srv.log + sim_srv.stderr)
        sim["titles"] = observe_titles(descendant_titles(sim_srv.proc.pid))
    # The probes themselves saw what they must (so a shared mistake cannot pass unnoticed).
    assert real["models without key"][0] == 401 and real["chat without key"][0] == 401
    assert real["wrong model"][0] == 404 and real["stream"]["usage completion_tokens"] == 4
    assert all(real["log"].values()), real["log"]
    assert all(real["titles"].values()), real["titles"]
    problems = extra_metric_problems(real.pop("_metrics_text"), sim.pop("_metrics_text"))
    problems += diff(real, sim)
    assert not problems, "the simulator differs from the real vLLM:\n" + "\n".join(problems)


def test_readiness_phases_are_read_from_the_real_start_up_log(real_server):
    phases = []
    for line in real_server.log.splitlines():
        phase = logsig.phase_of(line)
        if phase and (not phases or phases[-1] != phase):
            phases.append(phase)
    # In order, as the live view shows them (no CUDA graphs: --enforce-eager, and none on CPU).
    assert phases == ["loading weights", "weights loaded", "KV cache", "starting API server",
                      "API server up"], phases
    assert not [line for line in real_server.log.splitlines() if logsig.fatal_in(line)]


def test_fatal_line_of_a_flag_the_real_parser_refuses_is_recognised(real_vllm, tiny_model, tmp_path):
    """(A start the engine itself refuses - its KV cache below one request - is the failed swap of
    test_real_vllm.py, whose recorded root cause is that real line.)"""
    with RealServer(real_vllm, tiny_model(), ["--bogus-flag", "3"], log_dir=tmp_path) as srv:
        assert srv.wait_exit() == 2, srv.log[-3000:]
        sig, line = logsig.root_cause(srv.log.splitlines())
    assert sig is not None and sig.key == "unrecognized-arguments", (sig, line, srv.log[-3000:])
    assert line == "vllm: error: unrecognized arguments: --bogus-flag 3"


def test_the_simulator_keeps_the_real_data_parallel_contract(real_vllm, tiny_model, sim_host, tmp_path):
    """--data-parallel-size 2: DPCoordinator, EngineCore_DP<n> and one API server per engine
    (vLLM defaults api_server_count to the DP size), per-engine series, who logs what."""
    args = [*ARGS, "--data-parallel-size", "2", "--num-gpu-blocks-override", "64"]
    with RealServer(real_vllm, tiny_model(), args, log_dir=tmp_path,
                    env={"CUDA_VISIBLE_DEVICES": "0,1"}) as real_srv:
        real_srv.wait_ready(api_servers=2)   # both API servers have logged their start
        real = observe_dp(real_srv.port, KEY, SERVED, real_srv.log, descendant_titles(real_srv.proc.pid))
    assert real["titles"] == ["VLLM::APIServer_0", "VLLM::APIServer_1", "VLLM::DPCoordinator",
                              "VLLM::EngineCore_DP0", "VLLM::EngineCore_DP1"], real
    assert all(v == ["0", "1"] for v in real["engines"].values()), real
    with SimServer(sim_host, [str(tiny_model()), *args, *SAME_AS_REAL]) as sim_srv:
        sim_srv.wait_ready()
        sim = observe_dp(sim_srv.port, KEY, SERVED, sim_srv.log + sim_srv.stderr,
                         descendant_titles(sim_srv.proc.pid))
    problems = diff(real, sim)
    assert not problems, "the simulator differs from the real vLLM (DP=2):\n" + "\n".join(problems)
