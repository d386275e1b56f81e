"""logsig names the fatal lines of a multi-node vLLM service (torch.distributed's rendezvous and
vLLM's DP handshake), with the root cause winning over the generic wrappers around it."""

from __future__ import annotations

import pytest

from orchestrator.probe import logsig

# The lines as vLLM / torch print them (the simulator prints the same: MULTINODE_LINES).
CASES = [
    ("(Worker_PP1_TP0 pid=4121) torch.distributed.DistNetworkError: The client socket has timed out after "
     "600000ms while trying to connect to (10.200.1.2, 29501).", "head-unreachable"),
    ("torch.distributed.DistNetworkError: The client socket has timed out after 1800000ms while trying to "
     "connect to (172.31.0.2, 29500).", "head-unreachable"),
    ("(Worker_PP0_TP0 pid=311) torch.distributed.DistStoreError: Timed out after 601 seconds waiting for "
     "clients. 8/16 clients joined.", "join-timeout"),
    ("(EngineCore_DP1 pid=77) RuntimeError: Did not receive response from front-end process within 5 "
     "minutes", "dp-handshake-timeout"),
    ("(Worker_PP1_TP0 pid=9) AssertionError: Attempted to load weight (torch.Size([1792, 7168])) into "
     "parameter (torch.Size([2048, 7168]))", "weights-mismatch"),
    ("(Worker_PP0_TP0 pid=12) RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] "
     "Connection closed by peer [10.200.2.2]:40412", "peer-closed"),
    ("(Worker_PP1_TP0 pid=5) torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was "
     "likely closed. Did the remote server shutdown or crash?", "head-gone"),
    ("(Worker_PP1_TP3 pid=5) torch.AcceleratorError: CUDA error: an illegal memory access was encountered",
     "cuda-error"),
]


@pytest.mark.parametrize("line,key", CASES, ids=[k for _, k in CASES])
def test_each_multinode_fatal_line_is_named_with_a_meaning_and_a_fix(line, key):
    sig = logsig.fatal_in(line)
    assert sig is not None and sig.key == key
    assert sig.meaning and sig.fix


def test_the_failed_connect_warnings_while_retrying_are_not_fatal():
    # torch warns at every failed attempt; the rank is still retrying
    line = ("[W1201 02:05:12.123456789 socket.cpp:767] [c10d] The client socket has failed to connect to "
            "[10.200.1.2]:29501 (errno: 111 - Connection refused).")
    assert logsig.fatal_in(line) is None


def test_the_root_cause_beats_the_engine_wrappers_on_the_head_and_on_a_headless_node():
    head = ["(EngineCore pid=2) ERROR 12-01 02:05:12 [core.py:1584] EngineCore failed to start.",
            CASES[5][0],
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"]
    assert logsig.root_cause(head)[0].key == "peer-closed"
    node = [CASES[7][0], "Exception: WorkerProc initialization failed due to an exception in a background "
            "process. See stack trace for root cause."]
    assert logsig.root_cause(node)[0].key == "cuda-error"
    # a node that cannot reach the head also logs the wrapper: the timeout is the cause
    assert logsig.root_cause(["(EngineCore_DP1 pid=7) ERROR 12-01 02:05:12 [core.py:1584] EngineCore failed "
                              "to start.", CASES[3][0]])[0].key == "dp-handshake-timeout"
