"""The one GPU-ownership rule (orchestrator.host.ownership), as deploy, swap, stop and preflight use
it: processes classified from what the facts script read (cgroup, process group, names), then sorted
for a placement into ours / kill / others / foreign."""

from __future__ import annotations

import subprocess
import sys
import time

from orchestrator.host.ownership import (
    FOREIGN,
    LEFT,
    SERVICE,
    UNMANAGED_VLLM,
    Proc,
    classify,
    gpu_list,
    holders,
    kill_commands,
)
from orchestrator.plan.preflight import FAIL, OK, WARN, check_foreign_gpu_processes

SYSTEMD = {"kimi": {"ActiveState": "active", "MainPID": "100"},
           "mini": {"ActiveState": "failed", "MainPID": "0"}}
PROCESS = {"kimi": {"ActiveState": "active", "MainPID": "100", "PGID": "100"},
           "mini": {"ActiveState": "failed", "MainPID": "0", "PGID": "200"}}


def test_classify_by_cgroup_on_systemd_hosts():
    running = ["kimi"]
    assert classify({"cgroup": "0::/system.slice/vllm-kimi.service"}, SYSTEMD, running) == (SERVICE, "kimi")
    # the unit is dead, its cgroup still holds a worker: left behind
    assert classify({"cgroup": "0::/system.slice/vllm-mini.service"}, SYSTEMD, running) == (LEFT, "mini")
    # never by name: a vLLM-looking process outside every managed cgroup is not a service's
    assert classify({"cgroup": "0::/user.slice", "comm": "VLLM::Worker_TP"}, SYSTEMD, running) == \
        (UNMANAGED_VLLM, None)
    assert classify({"cgroup": "0::/user.slice", "comm": "python3", "cmdline": ["python3", "train.py"]},
                    SYSTEMD, running) == (FOREIGN, None)
    # the nvidia-smi name counts when /proc could not be read
    assert classify({}, SYSTEMD, running, name="VLLM::Worker_TP3") == (UNMANAGED_VLLM, None)


def test_classify_by_process_group_on_process_hosts():
    running = ["kimi"]
    assert classify({"pgid": 100, "comm": "python"}, PROCESS, running) == (SERVICE, "kimi")
    assert classify({"pgid": 200, "comm": "VLLM::Worker_TP"}, PROCESS, running) == (LEFT, "mini")
    assert classify({"pgid": 300, "comm": "bash"}, PROCESS, running) == (FOREIGN, None)


def test_a_zombie_main_process_means_the_service_is_not_running():
    # The facts script reports a service whose main process is a zombie as not active; its
    # processes are then left behind, and may be killed.
    dead = {"kimi": {"ActiveState": "failed", "MainPID": "0", "PGID": "100"}}
    assert classify({"pgid": 100, "comm": "VLLM::Worker_TP"}, dead, running=[]) == (LEFT, "kimi")


def p(pid, gpu, kind, model=None, name="VLLM::Worker_TP0"):
    return Proc(pid=pid, name=name, used_mib=1000 if gpu is not None else 0, gpu_index=gpu, kind=kind, model=model)


PROCS = [p(1, 0, SERVICE, "kimi"), p(2, 1, LEFT, "kimi"), p(3, 2, UNMANAGED_VLLM),
         p(4, 5, LEFT, "kimi"),                                        # on a GPU the placement does not use
         p(5, 3, SERVICE, "mini"), p(6, 3, LEFT, "mini"),
         p(7, 2, FOREIGN, name="python3 train.py")]


def test_deploy_sorts_a_placements_holders():
    h = holders(PROCS, [], "kimi", [0, 1, 2, 3])
    assert [x.pid for x in h.ours] == [1]
    assert [x.pid for x in h.kill] == [2, 3, 6]
    assert [x.pid for x in h.others] == [5]          # a running managed service: deploy refuses
    assert [x.pid for x in h.foreign] == [7]
    assert [x.pid for x in h.victims(kill_foreign=False)] == [2, 3, 6]
    assert [x.pid for x in h.victims(kill_foreign=True)] == [2, 3, 6, 7]


def test_swap_counts_the_model_it_stops_as_its_own():
    h = holders(PROCS, [], "other-new", [0, 1, 2, 3], stopping={"mini"})
    assert [x.pid for x in h.ours] == [5]            # mini is stopped first by the swap itself
    assert [x.pid for x in h.others] == [1]          # kimi still runs: never killed


def test_port_holders_are_killed_only_when_a_dead_managed_service_left_them():
    port = [p(20, None, UNMANAGED_VLLM, name="python -m vllm.entrypoints.openai.api_server"),
            p(21, None, LEFT, "kimi", name="python"), p(22, None, FOREIGN, name="nginx")]
    h = holders([], port, "kimi", [0])
    assert [x.pid for x in h.kill] == [21]
    assert [x.pid for x in h.foreign] == [20, 22]    # someone's server, maybe on other GPUs


def test_preflight_reports_what_the_gpu_step_will_do():
    gpus = [0, 1, 2, 3]
    leftovers_only = holders([x for x in PROCS if x.kind != FOREIGN], [], "kimi", gpus)
    c = check_foreign_gpu_processes(leftovers_only, gpus)
    assert c.status == WARN and len(c.details) == 3
    with_stranger = holders(PROCS, [], "kimi", gpus)
    c = check_foreign_gpu_processes(with_stranger, gpus)
    assert c.status == FAIL and "pid 7" in c.summary and "--kill-foreign" in c.fix
    assert check_foreign_gpu_processes(with_stranger, gpus, kill_foreign=True).status == WARN
    assert check_foreign_gpu_processes(holders(PROCS, [], "kimi", [6, 7]), [6, 7]).status == OK


def test_gpu_list_text():
    assert gpu_list([0, 1, 2, 3]) == "GPUs 0-3" and gpu_list([5]) == "GPU 5" and gpu_list([1, 3]) == "GPUs 1,3"


def test_kill_commands_terminate_then_kill():
    sleeper = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(30)"])
    time.sleep(0.2)
    t0 = time.monotonic()
    for cmd in kill_commands([sleeper.pid]):
        subprocess.run(["sh", "-c", cmd.text], check=True)
    assert sleeper.wait(timeout=20) != 0              # SIGKILL after the TERM grace period
    assert time.monotonic() - t0 >= 5                 # it waited for TERM first (10 s grace)
