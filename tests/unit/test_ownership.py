"""The one GPU-ownership rule (orchestrator.host.ownership), as deploy, swap, stop and preflight use
it: processes classified from what the facts script read (cgroup, process group, names), then sorted
for a placement into ours / kill / others / foreign."""

from __future__ import annotations

import subprocess
import sys
import time

from orchestrator.host.ownership import (
    ABANDONED,
    FOREIGN,
    LEFT,
    SERVICE,
    Proc,
    classify,
    gpu_list,
    holders,
    kill_commands,
)
from orchestrator.plan.preflight import FAIL, OK, WARN, check_foreign_gpu_processes

CG = "/system.slice/vllm-kimi.service"
SYSTEMD = {"kimi": {"ActiveState": "active", "MainPID": "100", "ControlGroup": CG},
           "mini": {"ActiveState": "failed", "MainPID": "0", "ControlGroup": ""}}
PROCESS = {"kimi": {"ActiveState": "active", "MainPID": "100", "PGID": "100"},
           "mini": {"ActiveState": "failed", "MainPID": "0", "PGID": "200"}}
ORPHAN = {"cmdline": ["VLLM::Worker_TP0"], "leader_alive": False, "engine_root_ppid": 1}


def test_classify_by_the_units_exact_control_group():
    running = ["kimi"]
    assert classify({"cgroup": f"0::{CG}"}, SYSTEMD, running) == (SERVICE, "kimi")
    assert classify({"cgroup": f"0::{CG}/worker"}, SYSTEMD, running) == (SERVICE, "kimi")      # a sub-group
    # hybrid hierarchy: the name=systemd line counts
    assert classify({"cgroup": f"3:cpu:/\n1:name=systemd:{CG}"}, SYSTEMD, running) == (SERVICE, "kimi")
    # the unit is dead, its cgroup still holds a worker: left behind (systemd reports no
    # ControlGroup for a dead unit; a system unit's group is /system.slice/<unit>)
    assert classify({"cgroup": "0::/system.slice/vllm-mini.service"}, SYSTEMD, running) == (LEFT, "mini")
    # another user's `systemctl --user` unit with the same name is not ours
    user_unit = "0::/user.slice/user-1001.slice/user@1001.service/app.slice/vllm-kimi.service"
    assert classify({"cgroup": user_unit, "cmdline": ["python3", "-m", "vllm"]}, SYSTEMD, running) == (FOREIGN, None)
    assert classify({"cgroup": f"0::{CG}-other"}, SYSTEMD, running) == (FOREIGN, None)   # a prefix is not a match


def test_abandoned_only_when_the_api_server_is_gone():
    assert classify({**ORPHAN, "cgroup": "0::/user.slice"}, SYSTEMD, ["kimi"]) == (ABANDONED, None)
    assert classify({**ORPHAN, "cmdline": ["VLLM::EngineCore"]}, {}, []) == (ABANDONED, None)
    assert classify({**ORPHAN, "cmdline": ["VLLM::EngineCore_DP1"]}, {}, []) == (ABANDONED, None)
    # someone's live vLLM server: its engine's tree still hangs below the API server
    assert classify({**ORPHAN, "engine_root_ppid": 4242}, {}, []) == (FOREIGN, None)
    # its process group's leader lives: not abandoned, whatever the parent
    assert classify({**ORPHAN, "leader_alive": True}, {}, []) == (FOREIGN, None)
    # never by a name that merely mentions vllm
    script = {"cmdline": ["python", "/home/alice/vllm-eval/train.py"], "leader_alive": False, "engine_root_ppid": 1}
    assert classify(script, {}, []) == (FOREIGN, None)
    assert classify({"cmdline": ["python3", "-m", "vllm.entrypoints.openai.api_server"]}, {}, []) == (FOREIGN, None)


def test_classify_by_the_proven_process_group_on_process_hosts():
    running = ["kimi"]
    assert classify({"pgid": 100, "comm": "python"}, PROCESS, running) == (SERVICE, "kimi")
    assert classify({"pgid": 200, "comm": "VLLM::Worker_TP"}, PROCESS, running) == (LEFT, "mini")
    assert classify({"pgid": 300, "comm": "bash"}, PROCESS, running) == (FOREIGN, None)
    # a stale record (another boot, a reused PID) names no group: the facts script reports no PGID
    stale = {"kimi": {"ActiveState": "inactive", "MainPID": "0", "StaleRecord": "recorded in another boot"}}
    assert classify({"pgid": 100, "comm": "sleep"}, stale, []) == (FOREIGN, None)


def test_a_zombie_main_process_means_the_service_is_not_running():
    # The facts script reports a service whose main process is a zombie as not active; its
    # processes are then left behind, and may be killed.
    dead = {"kimi": {"ActiveState": "failed", "MainPID": "0", "PGID": "100"}}
    assert classify({"pgid": 100, "comm": "VLLM::Worker_TP"}, dead, running=[]) == (LEFT, "kimi")


def p(pid, gpu, kind, model=None, name="VLLM::Worker_TP0"):
    return Proc(pid=pid, name=name, used_mib=1000 if gpu is not None else 0, gpu_index=gpu, kind=kind, model=model,
                start_time=pid * 100)           # what the facts script reads of every process it sees


PROCS = [p(1, 0, SERVICE, "kimi"), p(2, 1, LEFT, "kimi"), p(3, 2, ABANDONED),
         p(4, 5, LEFT, "kimi"),                                        # on a GPU the placement does not use
         p(5, 3, SERVICE, "mini"), p(6, 3, LEFT, "mini"),
         p(7, 2, FOREIGN, name="python3 train.py")]


def test_deploy_sorts_a_placements_holders():
    h = holders(PROCS, [], "kimi", [0, 1, 2, 3], protected=())
    assert [x.pid for x in h.ours] == [1]
    assert [x.pid for x in h.kill] == [2, 3, 6]
    assert [x.pid for x in h.others] == [5]          # a running managed service: deploy refuses
    assert [x.pid for x in h.foreign] == [7]
    assert [x.pid for x in h.victims(kill_foreign=False)] == [2, 3, 6]
    assert [x.pid for x in h.victims(kill_foreign=True)] == [2, 3, 6, 7]


def test_swap_counts_the_model_it_stops_as_its_own():
    h = holders(PROCS, [], "other-new", [0, 1, 2, 3], stopping={"mini"}, protected=())
    assert [x.pid for x in h.ours] == [5]            # mini is stopped first by the swap itself
    assert [x.pid for x in h.others] == [1]          # kimi still runs: never killed


def test_port_holders_are_killed_only_when_a_dead_managed_service_left_them():
    port = [p(20, None, ABANDONED, name="VLLM::EngineCore"),
            p(21, None, LEFT, "kimi", name="python"), p(22, None, FOREIGN, name="nginx")]
    h = holders([], port, "kimi", [0], protected=())
    assert [x.pid for x in h.kill] == [21]
    assert [x.pid for x in h.foreign] == [20, 22]    # someone's server, maybe on other GPUs


def test_preflight_reports_what_the_gpu_step_will_do():
    gpus = [0, 1, 2, 3]
    leftovers_only = holders([x for x in PROCS if x.kind != FOREIGN], [], "kimi", gpus, protected=())
    c = check_foreign_gpu_processes(leftovers_only, gpus)
    assert c.status == WARN and len(c.details) == 3
    with_stranger = holders(PROCS, [], "kimi", gpus, protected=())
    c = check_foreign_gpu_processes(with_stranger, gpus)
    assert c.status == FAIL and "pid 7" in c.summary and "--kill-foreign" in c.fix
    assert check_foreign_gpu_processes(with_stranger, gpus, kill_foreign=True).status == WARN
    assert check_foreign_gpu_processes(holders(PROCS, [], "kimi", [6, 7], protected=()), [6, 7]).status == OK


def test_gpu_list_text():
    assert gpu_list([0, 1, 2, 3]) == "GPUs 0-3" and gpu_list([5]) == "GPU 5" and gpu_list([1, 3]) == "GPUs 1,3"


def start_ticks(pid: int) -> int:
    stat = open(f"/proc/{pid}/stat").read()
    return int(stat[stat.rindex(")") + 2:].split()[19])


def test_kill_commands_terminate_then_kill_and_spare_a_reused_pid():
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(30)"])
    other = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.3)
        victim = Proc(pid=stubborn.pid, name="x", used_mib=1, gpu_index=0, kind=LEFT, model="m",
                      start_time=start_ticks(stubborn.pid))
        # the classified process was PID other.pid with another start time: that PID is someone else now
        reused = Proc(pid=other.pid, name="y", used_mib=1, gpu_index=0, kind=LEFT, model="m",
                      start_time=start_ticks(other.pid) - 1)
        t0 = time.monotonic()
        for cmd in kill_commands([victim, reused]):
            subprocess.run(["sh", "-c", cmd.text], check=True)
        assert stubborn.wait(timeout=20) != 0             # SIGKILL after the TERM grace period
        assert time.monotonic() - t0 >= 5                 # it waited for TERM first (10 s grace)
        assert other.poll() is None, "a PID whose start time changed must not be signalled"
    finally:
        stubborn.kill()
        other.kill()


def test_a_holder_vllm_orch_cannot_see_or_identify_is_named_and_never_killed():
    """The facts script reports a port bound by a process it cannot see (another user's socket, a
    hidden /proc) as [None], which became PID 0: with --kill-foreign the GPU step emitted
    `kill -TERM 0`, which signals vllm-orch's own process group. A process read without a start
    time (it was exiting, another PID namespace) was killed without the identity check."""
    from orchestrator.config.inventory import HostEntry
    from orchestrator.config.manifest import Manifest
    from orchestrator.plan.service import holders_refusal

    unseen = Proc(pid=0, name="?", used_mib=0, gpu_index=None, kind=FOREIGN)
    unread = Proc(pid=4242, name="python", used_mib=1000, gpu_index=0, kind=FOREIGN)          # no start time
    init = Proc(pid=1, name="systemd", used_mib=1000, gpu_index=0, kind=LEFT, model="kimi", start_time=1)
    stranger = p(7, 0, FOREIGN, name="python3 train.py")
    h = holders([unread, init, stranger], [unseen], "kimi", [0], protected=())
    assert [x.pid for x in h.victims(kill_foreign=True)] == [7]
    assert not any(x.pid in (0, 1) for x in h.kill)
    text = " ".join(c.text for c in kill_commands([unseen, unread, init, stranger]))
    assert "7:700" in text and " 0:" not in text and " 1:" not in text and "4242" not in text and ":-" not in text
    assert kill_commands([unseen, unread, init]) == []
    m = Manifest.model_validate({"name": "kimi", "source": {"repo": "a/b"}, "serving": {"gpus": 1, "port": 8000}})
    entry = HostEntry(name="h", address="local")
    err = holders_refusal(h, m, entry, kill_foreign=True)
    assert err is not None and err.exit_code == 3, "--kill-foreign cannot free what it may not kill"
    assert "not visible" in err.message and "4242" in err.message and "PID 0" not in err.message


def test_stop_spares_what_another_recorded_service_left_on_shared_gpus():
    """Between two starts of a service (systemd's RestartSec), its processes are `left behind`;
    a stop of another service on overlapping GPUs must not kill them (the rule's protection of the
    host's other services reaches stop as it reaches deploy)."""
    from orchestrator.host.facts import HostFacts
    from orchestrator.host.records import ServiceRecord
    from orchestrator.plan.stop import leftovers

    procs = [p(1, 0, SERVICE, "kimi"), p(6, 1, LEFT, "mini"), p(3, 1, ABANDONED)]
    facts = HostFacts(hostname="h", disk_path="/", disk_total=10, disk_free=5, gpus=[], gpu_error=None,
                      driver_version=None, cuda_version=None, procs=procs, vllm_version=None, vllm_error=None,
                      models={}, active=None, installed={}, services={}, usage={},
                      records={"mini": ServiceRecord(model="mini", gpus=[1])})
    held = leftovers(facts, "kimi", [0, 1])
    assert [x.pid for x in held.kill] == [3] and [x.pid for x in held.others] == [6]
