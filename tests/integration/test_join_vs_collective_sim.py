"""Issue 26, finding 4: vllm-orch's join wait is not vLLM's collective timeout. In vLLM 0.33
`--distributed-timeout-seconds` is init_process_group's timeout AND every NCCL device group's
(vllm/distributed/parallel_state.py, get_distributed_timeout_or_none), so a rank waiting in a
collective for a peer that still compiles is aborted after it. The simulator does the same
(fault slow-compile on one node); vllm-orch renders the flag from the collective timeout (never
below torch's 600 s nor loading.other_seconds) and keeps its own join wait, naming the node that
did not join."""

from __future__ import annotations

import pytest

from orchestrator.config.manifest import Manifest
from orchestrator.ops.deploy import run_deploy
from orchestrator.ops.execute import Reporter
from orchestrator.plan.run import Options
from orchestrator.probe import logsig
from orchestrator.sim import manager
from tests.integration.test_multinode_sim import cli, cluster, running  # noqa: F401  (the fixture)
from tests.integration.test_sim_multinode import nodes, tp_pp_argv  # noqa: F401  (the fixture)
from tests.plugins.sim_hosts import SimServer, free_port


def test_a_rank_waiting_in_a_collective_is_aborted_after_the_flag_as_in_vllm(nodes):  # noqa: F811
    """The stand-in's harshness: the head's ranks wait for sim-2's in the profile run's all-reduce;
    sim-2 compiles 20 s longer; with --distributed-timeout-seconds 8 torch's watchdog aborts the head."""
    port = free_port()
    head_node, other = nodes[0], nodes[1]
    manager.add_fault("sim-2", "slow-compile", home=other.home, seconds=20)
    head_argv = tp_pp_argv(head_node, 0, 2, port) + ["--distributed-timeout-seconds", "8"]
    other_argv = tp_pp_argv(other, 1, 2, port) + ["--distributed-timeout-seconds", "8"]
    with SimServer(head_node, head_argv) as head, SimServer(other, other_argv):
        assert head.wait_exit(120) == 1
        sig, line = logsig.root_cause(head.log.splitlines())
        assert sig is not None and sig.key == "collective-timeout", (sig, line)
        assert "Timeout(ms)=8000" in (line or "")


@pytest.mark.long
def test_a_peer_compiling_longer_than_the_join_wait_is_not_aborted(cluster):  # noqa: F811
    """join_timeout_seconds 10, sim-2 compiles 20 s longer than the head: every rank joined at
    once, so the join wait is met; the head's ranks wait in a collective for sim-2, within the
    rendered --distributed-timeout-seconds (600 s), and the service serves. (Before: the flag was
    the join timeout, 10 s, and torch's watchdog aborted the head.)"""
    env, entries, m = cluster
    data = m.model_dump()
    data["multinode"]["join_timeout_seconds"] = 10
    m = Manifest.model_validate(data)
    assert cli(env, "sim", "fault", "sim-2", "slow-compile").returncode == 0       # 30 s by default
    res = run_deploy(list(entries.values()), m, Options(poll_s=0.2), Reporter(None, quiet=True), False)
    assert res.ok, res.error and (res.error.message, res.error.details)
    assert all(running(e, m.name) for e in entries.values())
