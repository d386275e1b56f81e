"""The sleep-swap planner and the placement rules of sleep mode, from hand-made facts."""

from __future__ import annotations

from orchestrator.config.manifest import Manifest
from orchestrator.config.placement import Placement
from orchestrator.host.ownership import SERVICE, Proc, holders
from orchestrator.host.records import Asleep, ServiceRecord, SwapMarker
from orchestrator.plan.inputs import ServiceInput
from orchestrator.plan.interrupted import half_done, sleep_half
from orchestrator.plan.sleep import START_CONTEXT_MIB, allowance_mib, graph_pool_mib, room_refusal
from orchestrator.plan.swap import old_model_name, plan_sleep_swap
from orchestrator.render.artifacts import render
from tests.unit.test_planners import ENTRY, MODELS, download, facts, inp, running, svc

KIMI, NVFP4 = "kimi-k25-int4", "kimi-k25-nvfp4"


def sleepy(name: str, port: int, util: float | None = None) -> ServiceInput:
    data = MODELS[name].model_dump()
    data["serving"].update(port=port, host="127.0.0.1")
    data["sleep"] = {"level": 1}
    if util is not None:
        data["vllm"]["gpu_memory_utilization"] = util
    m = Manifest.model_validate(data)
    return ServiceInput(manifest=m, rendered=render(m, ENTRY, {}))


def test_a_sleeping_service_shares_gpus_but_never_its_port():
    awake = Placement("a", "a", "h", (0, 1), 8000)
    asleep = Placement("b", "b", "h", (0, 1), 8001, asleep=True)
    assert awake.clash(asleep) is None
    assert awake.clash(Placement("b", "b", "h", (0, 1), 8000, asleep=True)) == "port 8000"
    assert awake.clash(Placement("b", "b", "h", (1,), 8001)) == "GPU 1"


def test_a_sleepers_processes_are_its_own_and_in_nobodys_way():
    procs = [Proc(10, "VLLM::Worker_TP0", 530, 0, SERVICE, "b", start_time=5),
             Proc(11, "VLLM::Worker_TP0", 90000, 1, SERVICE, "c", start_time=5)]
    held = holders(procs, [], "a", [0, 1], protected={"b", "c"}, asleep={"b"})
    assert [p.pid for p in held.asleep] == [10] and [p.pid for p in held.others] == [11]
    assert held.victims(kill_foreign=True) == []


def test_the_awake_one_must_leave_room_for_what_the_sleepers_keep():
    f = facts(services=running("b"), procs=[Proc(10 + g, "VLLM::Worker", 9000, g, SERVICE, "b", start_time=5)
                                            for g in range(8)])
    f.records["b"] = ServiceRecord(model="b", gpus=list(range(8)), port=8001, asleep=Asleep(level=1))
    m = sleepy(NVFP4, 8002, util=0.93).manifest
    refusal = room_refusal(f, m, "gpu1")
    assert refusal is not None and "keeps 9000 MiB" in refusal.message
    assert "gpu_memory_utilization to 0.9 or less" in (refusal.hint or "")
    assert room_refusal(f, sleepy(NVFP4, 8002, util=0.9).manifest, "gpu1") is None


def test_the_room_counts_the_starting_processs_own_cuda_context():
    """vLLM's start-up check compares its share with the memory free AFTER its own CUDA context
    (vllm/v1/worker/utils.py request_memory): 0.98 of a 97887 MiB GPU beside a sleeper keeping 1318
    MiB fits without the context (97247 MiB) and not with it."""
    f = facts(services=running("b"), procs=[Proc(10 + g, "VLLM::Worker", 1318, g, SERVICE, "b", start_time=5)
                                            for g in range(8)])
    f.records["b"] = ServiceRecord(model="b", gpus=list(range(8)), port=8001, asleep=Asleep(level=1))
    refusal = room_refusal(f, sleepy(NVFP4, 8002, util=0.98).manifest, "gpu1")
    assert refusal is not None and f"about {START_CONTEXT_MIB} MiB" in refusal.message, refusal
    assert "gpu_memory_utilization to 0.97 or less" in (refusal.hint or "")
    assert room_refusal(f, sleepy(NVFP4, 8002, util=0.97).manifest, "gpu1") is None


def test_a_sleepers_allowance_counts_the_graph_pool_its_start_logged():
    assert graph_pool_mib({"graphs_gib": 0.52}, ["vllm", "serve"]) == 532
    assert graph_pool_mib({"graphs_gib": 0.52}, ["vllm", "serve", "--sleep-mode-offload-cudagraph"]) == 0
    assert graph_pool_mib({}, ["vllm", "serve"]) is None
    assert allowance_mib(ServiceRecord(model="b", graph_pool_mib=532)) == 1024 + 532
    assert allowance_mib(ServiceRecord(model="b")) == allowance_mib(None) == 1024


def test_sleep_old_is_refused_without_a_sleep_section_or_on_the_old_ones_port():
    f = facts(services=running(KIMI))
    f.records[KIMI] = ServiceRecord(model=KIMI, gpus=list(range(8)), port=8000, argv=["vllm", "--enable-sleep-mode"])
    plain = plan_sleep_swap(inp(sleepy(NVFP4, 8001), f, download(0), old=svc(KIMI, installed=True), sleep_old=True))
    assert plain.refusal is not None and "has no sleep section" in plain.refusal.message
    same = plan_sleep_swap(inp(sleepy(NVFP4, 8000), f, download(0), old=sleepy(KIMI, 8000), sleep_old=True))
    assert same.refusal is not None and "keeps listening on port 8000" in same.refusal.message
    f.records[KIMI] = ServiceRecord(model=KIMI, gpus=list(range(8)), port=8000, argv=["vllm"])
    old_argv = plan_sleep_swap(inp(sleepy(NVFP4, 8001), f, download(0), old=sleepy(KIMI, 8000), sleep_old=True))
    assert old_argv.refusal is not None and "without --enable-sleep-mode" in old_argv.refusal.message


def test_waking_a_sleeper_replaces_the_one_awake_service():
    f = facts(services=running(KIMI, NVFP4))
    f.records[KIMI] = ServiceRecord(model=KIMI, gpus=list(range(8)), port=8000, asleep=Asleep(level=1))
    f.records[NVFP4] = ServiceRecord(model=NVFP4, gpus=list(range(8)), port=8001)
    assert old_model_name(f, KIMI, "gpu1") == NVFP4
    plan = plan_sleep_swap(inp(sleepy(KIMI, 8000), f, None, old=sleepy(NVFP4, 8001), sleep_old=True))
    assert plan.refusal is None, plan.refusal
    assert [a.step for a in plan.actions] == ["lock", "sleep", "wake", "record"]     # level 1: nothing to warm
    back = plan.recovery_for(2)
    assert back is not None and [a.step for a in back.actions] == ["sleep", "gpus", "wake", "record"]
    stop = plan_sleep_swap(inp(sleepy(KIMI, 8000), f, None, old=sleepy(NVFP4, 8001)))     # without --sleep-old
    assert [a.step for a in stop.actions] == ["lock", "stop", "gpus", "wake", "record"]
    assert [a.step for a in stop.recovery_for(2).actions] == ["sleep", "gpus", "start", "ready", "record"]
    # the step that starts the downtime first writes swap.json; the record step and the rollback end it
    assert any("swap.json" in d for d in plan.actions[1].details) and any("swap.json" in d for d in stop.actions[1].details)
    assert "the swap has ended" in plan.actions[-1].summary and "swap.json" in back.actions[-1].summary


def test_a_half_done_sleep_swap_is_finished_or_undone_and_any_other_swap_refused():
    f = facts(services=running(KIMI, NVFP4))
    f.records[KIMI] = ServiceRecord(model=KIMI, gpus=list(range(8)), port=8000, asleep=Asleep(level=1),
                                    argv=["vllm", "--enable-sleep-mode"])
    f.records[NVFP4] = ServiceRecord(model=NVFP4, gpus=list(range(8)), port=8001)
    f.half_swap = SwapMarker(from_=KIMI, to=NVFP4, from_sleeps=True)       # cut while nvfp4 loads
    assert sleep_half(f, NVFP4) and sleep_half(f, KIMI) and not sleep_half(f, "other")
    text, hint = half_done(f, "gpu1") or ("", "")
    assert f"{KIMI} is asleep" in text and f"vllm-orch swap {NVFP4} --host gpu1" in hint
    finish = plan_sleep_swap(inp(sleepy(NVFP4, 8001), f, download(0), old=sleepy(KIMI, 8000)))   # no --sleep-old
    assert finish.refusal is None, finish.refusal
    steps = [a.step for a in finish.actions]
    assert steps.index("sleep") < steps.index("start") < steps.index("record")
    assert "asleep already" in finish.actions[steps.index("sleep")].summary
    back = finish.recovery_for(steps.index("sleep") + 1)
    assert back is not None and back.actions[0].step == "stop" and back.actions[-1].step == "record"
    undo = plan_sleep_swap(inp(sleepy(KIMI, 8000), f, None, old=sleepy(NVFP4, 8001)))
    assert [a.step for a in undo.actions] == ["lock", "stop", "gpus", "wake", "record"]
    assert undo.recoveries == [] and any("restart" in d for d in undo.actions[3].details)     # cold, last resort
    other = plan_sleep_swap(inp(sleepy("minimax-m25", 8002), f, download(0), old=sleepy(NVFP4, 8001),
                                sleep_old=True))
    assert other.refusal is not None and "finish or undo it" in other.refusal.message


def test_the_host_line_of_status_counts_its_sleeping_services():
    import io

    from rich.console import Console

    from orchestrator.cli.views import render_host_details
    from orchestrator.ops.status import HostStatus, ServiceStatus

    def one(name: str, state: str) -> ServiceStatus:
        v = ServiceStatus(name)
        v.state, v.state_reason = state, "why"
        return v

    out = io.StringIO()
    render_host_details(Console(file=out, width=300), HostStatus(
        "gpu1", active_model=NVFP4, state="ready", state_reason="serving",
        services=[one(NVFP4, "ready"), one(KIMI, "asleep"), one("minimax-m25", "asleep")]))
    head = out.getvalue().splitlines()[0]
    assert head.endswith(f"; 2 asleep ({KIMI}, minimax-m25)"), head
    quiet = io.StringIO()
    render_host_details(Console(file=quiet, width=300), HostStatus("gpu1", active_model=NVFP4, state="ready",
                                                                   services=[one(NVFP4, "ready")]))
    assert "asleep" not in quiet.getvalue()
