"""The warm step is planned from facts alone: how much of the new weights fits in the page cache
with the new service's CPU memory and a 10% margin kept free, the expected downtime with and
without it, and a no-op with the reason whenever there is nothing to warm."""

from __future__ import annotations

import pytest

from orchestrator.cli.views import history_details, last_cold_swaps, warm_saving
from orchestrator.config.inventory import HostEntry
from orchestrator.host.facts import Memory
from orchestrator.plan.deploy import plan_deploy
from orchestrator.plan.inputs import ServiceInput
from orchestrator.plan.run import RunRecord, WarmResult
from orchestrator.plan.swap import plan_swap
from orchestrator.plan.warm import budget_for, cpu_need, expected, history_fields, load_seconds
from orchestrator.probe.api import SmokeResult
from orchestrator.probe.readiness import Ready
from orchestrator.render.artifacts import render
from tests.unit.test_planners import ENTRY, GIB, MODELS, download, facts, inp, running, svc, weights

KIMI, NVFP4 = "kimi-k25-int4", "kimi-k25-nvfp4"
GB = 10 ** 9


def swap_plan(memory=None, survey=None, **opts):
    f = facts(services=running(KIMI), active={"model": KIMI, "gpus": list(range(8))},
              **({"memory": memory} if memory is not False else {"memory": None}))
    return plan_swap(inp(svc(NVFP4), f, download(0, 540 * GB), old=svc(KIMI, installed=True), survey=survey,
                         **opts))


def step(plan, name="warm"):
    return next(a for a in plan.actions if a.step == name)


def test_budget_keeps_the_new_services_cpu_memory_and_a_tenth_of_available_free():
    m = MODELS[NVFP4]
    b = budget_for(Memory(total=1536 * GIB, available=600 * GB), m, ENTRY)
    assert b is not None and b.need == 8 * 12 * GIB and b.margin == 60 * GB
    assert b.budget == 600 * GB - 60 * GB - 96 * GIB and b.floor == 60 * GB + 96 * GIB
    declared = m.model_copy(update={"loading": m.loading.model_copy(update={"cpu_memory_gib": 40})})
    assert cpu_need(declared, ENTRY) == (40 * GIB, "manifest loading.cpu_memory_gib")
    small = HostEntry(name="s", address="s", cpu_memory_per_gpu_gib=0.5)
    assert cpu_need(m, small)[0] == 4 * GIB
    assert budget_for(Memory(total=GIB, available=None), m, ENTRY) is None
    assert budget_for(None, m, ENTRY) is None


def test_expected_downtime_uses_the_manifests_rates():
    m = MODELS[KIMI]                         # declared: 315 MB/s from disk, 4000 from the cache, 420 s other
    cold = load_seconds(m, 547 * GB, 0)
    assert cold == pytest.approx(547e9 / 315e6 + 420)          # ~36 min, the field's figure
    warm = load_seconds(m, 547 * GB, 547 * GB)
    assert warm == pytest.approx(547e9 / 4000e6 + 420)
    half = expected(m, 547 * GB, 0, budget_for(Memory(1536 * GIB, 500 * GB), m, ENTRY))
    assert half.cached_after is not None and 0 < half.cached_after < 547 * GB
    assert warm < half.warm_s < cold and half.cold_s == cold
    # a simulated host's files are 1/10000 of the real ones; its index keeps the real total
    scaled = expected(m, 547 * GB // 10000, 0, budget_for(Memory(1536 * GIB // 10000, 1100 * GB // 10000), m,
                                                          HostEntry(name="s", address="s",
                                                                    cpu_memory_per_gpu_gib=12 / 10000)),
                      weights=547 * GB)
    assert scaled.cold_s == pytest.approx(cold) and scaled.warm_s == pytest.approx(warm, rel=0.01)


def test_a_swap_warms_what_fits_before_the_old_model_stops():
    plan = swap_plan(memory=Memory(total=1536 * GIB, available=600 * GB), survey=weights(NVFP4, 119, 540 * GB),
                     warm=True)
    steps = [a.step for a in plan.actions]
    assert steps.index("warm") == steps.index("stop") - 1
    w = step(plan)
    assert not w.noop and w.summary.startswith("warm 436.9 GB of 540.0 GB into the page cache before "
                                               f"{KIMI} stops: 1.6 TB RAM, 600.0 GB available")
    assert "--budget 436920784896" in str(w.commands[0]) and "--floor 163079215104" in str(w.commands[0])
    assert any("expected downtime" in d for d in w.details)
    exp = plan.info["expected_downtime_s"]
    assert exp["cold_s"] > exp["warm_s"] > load_seconds(MODELS[NVFP4], 540 * GB, 540 * GB)


@pytest.mark.parametrize("case, why", [
    ("off", "warming is off (--no-warm)"),
    ("unknown", "the host's available memory is unknown (/proc/meminfo)"),
    ("cached", "all 540.0 GB of kimi-k25-nvfp4's weights are in the page cache already"),
    ("short", "the host has no memory to spare for it"),
    ("survey", "the weight files could not be surveyed (warm-up failed: PermissionError)"),
])
def test_nothing_to_warm_is_a_noop_with_its_reason_and_the_estimate(case, why):
    survey = weights(NVFP4, 119, 540 * GB, cached=540 * GB if case == "cached" else 0)
    if case == "survey":
        survey = type(survey)(survey.model_dir, error="warm-up failed: PermissionError")
    memory = {"unknown": False, "short": Memory(1536 * GIB, 100 * GB)}.get(case, Memory(1536 * GIB, 1100 * GB))
    plan = swap_plan(memory=memory, survey=survey, warm=case != "off")
    w = step(plan)
    assert w.noop and w.run is None and why in w.summary
    assert "expected downtime" in w.summary + " ".join(w.details)
    assert plan.refusal is None and plan.changes


def test_deploy_warms_only_with_warm_and_only_before_a_real_start():
    t = svc(KIMI)
    cold = plan_deploy(inp(t, facts(), download(0, 547 * GB)))
    assert "warm" not in [a.step for a in cold.actions] and "expected_start_s" not in cold.info
    warm = plan_deploy(inp(t, facts(), download(0, 547 * GB), survey=weights(KIMI, 64, 547 * GB), warm=True))
    steps = [a.step for a in warm.actions]
    assert steps[steps.index("start") - 1] == "warm" and "expected start-up" in " ".join(step(warm).details)
    assert warm.recovery_for(steps.index("warm") + 1) is None        # the stop-after-failure covers start on
    serving = svc(KIMI, installed=True, serving=True)
    f = facts(services=running(KIMI), active={"model": KIMI, "unit_hash": serving.rendered.unit_hash,
                                              "gpus": list(range(8))})
    noop = plan_deploy(inp(serving, f, download(0, 547 * GB), warm=True))
    assert "warm" not in [a.step for a in noop.actions]


def test_unstaged_swap_does_not_warm_and_a_prefetch_manifest_says_what_vllm_adds():
    f = facts(services=running(KIMI), active={"model": KIMI, "gpus": list(range(8))}, disk_free=500 * GIB)
    unstaged = plan_swap(inp(svc(NVFP4), f, download(593 * GB), old=svc(KIMI, installed=True), yes=True,
                             warm=True))
    assert unstaged.info["staged"] is False and "warm" not in [a.step for a in unstaged.actions]
    m = MODELS[NVFP4]
    pre = m.model_copy(update={"vllm": m.vllm.model_copy(update={"safetensors_load_strategy": "prefetch"})})
    r = render(pre, ENTRY, {})
    assert r.argv[r.argv.index("--safetensors-load-strategy") + 1] == "prefetch"
    f = facts(services=running(KIMI), active={"model": KIMI, "gpus": list(range(8))})
    plan = plan_swap(inp(ServiceInput(manifest=pre, rendered=r), f, download(0, 540 * GB),
                         old=svc(KIMI, installed=True), survey=weights(NVFP4, 119, 540 * GB), warm=True))
    assert any("vLLM also reads the files into the page cache itself" in d for d in step(plan).details)


def test_history_keeps_what_the_warm_up_did_and_shows_the_saving():
    rec = RunRecord(warm=WarmResult(warmed_bytes=500 * GB, cached_bytes=540 * GB, total_bytes=540 * GB,
                                    seconds=1700.0, reason="complete", min_headroom=300 * GB))
    rec.ready[NVFP4] = Ready(gates=[], smoke=SmokeResult(True, "4", 0, 1, 0.1, 0.2, 5.0), seconds=560.0, log_lines=9,
                             phases=[("loading weights", 20.0), ("weights loaded", 155.5), ("serving", 540.0)])
    fields = history_fields(rec, NVFP4, {"cold_s": 2134.0, "warm_s": 555.0})
    assert fields["weights_s"] == 135.5 and fields["warm"]["reason"] == "complete"
    assert fields["expected_s"]["cold_s"] == 2134.0 and "error" not in fields["warm"]
    warm = {"operation": "swap", "model": NVFP4, "ok": True, "downtime_s": 561.0, **fields}
    cold = {"operation": "swap", "model": NVFP4, "ok": True, "downtime_s": 2150.0}
    other = {"operation": "swap", "model": KIMI, "ok": True, "downtime_s": 10.0}
    befores = last_cold_swaps([cold, other, warm])
    assert befores == [None, None, 2150.0]
    assert warm_saving(warm, befores[2]) == "26m29s less than the last swap without warming (35m50s)"
    assert "less than expected without warming (35m34s" in warm_saving(warm, None)
    line = history_details(warm, befores[2])
    assert "warm-up read 500.0 GB in 28m20s, 540.0 GB of 540.0 GB cached" in line and "26m29s less" in line
    failed = {**warm, "warm": {"error": "warm-up failed: x"}}
    assert "warm-up failed (warm-up failed: x)" in history_details(failed) and warm_saving(failed, 2150.0) == ""


def test_an_interrupted_swap_whose_new_service_runs_warms_nothing():
    t = svc(NVFP4, installed=True)
    f = facts(services=running(NVFP4), active={"model": KIMI, "gpus": list(range(8))})
    plan = plan_swap(inp(t, f, download(0, 540 * GB), old=svc(KIMI, installed=True),
                         survey=weights(NVFP4, 119, 540 * GB), warm=True))
    steps = [a.step for a in plan.actions]
    assert "warm" not in steps and "stop" not in steps and step(plan, "start").noop


@pytest.mark.parametrize("load_format, tp, why", [
    (None, 8, None),
    ("fastsafetensors", 8, None),                 # vLLM 0.33: nogds with a group of 8: mmap / pread
    ("fastsafetensors", 1, "reads with GPUDirect Storage when the host has it"),
    ("runai_streamer", 8, "load_format runai_streamer reads the weights with its own engine"),
    ("instanttensor", 8, "load_format instanttensor reads the weights with its own engine"),
])
def test_the_warm_up_follows_how_the_loader_reads(load_format, tp, why):
    from orchestrator.plan.warm import loader_bypass
    m = MODELS[NVFP4]
    m = m.model_copy(update={"vllm": m.vllm.model_copy(update={"load_format": load_format,
                                                                "tensor_parallel_size": tp})})
    got = loader_bypass(m)
    assert (got is None) if why is None else (why in got)


def test_the_expected_downtime_uses_this_hosts_last_start_when_history_has_one():
    from orchestrator.host.records import HistoryEntry
    from orchestrator.plan.warm import measured_from
    m = MODELS[KIMI]
    history = [HistoryEntry(operation="deploy", service=KIMI, ok=True, at="2026-12-01T10:00:00+00:00",
                            startup={"weights_s": 137.0, "ready_s": 300.0},
                            warm={"cached_bytes": 547 * GB, "total_bytes": 547 * GB}),
               HistoryEntry(operation="swap", service=NVFP4, ok=True, startup={"weights_s": 1.0, "ready_s": 2.0})]
    ms = measured_from(history, KIMI, 547 * GB)
    assert ms is not None and ms.other_s == 163.0 and ms.cached_bytes_s == pytest.approx(547 * GB / 137.0)
    assert ms.disk_bytes_s is None                      # that start read from the page cache only
    assert load_seconds(m, 547 * GB, 547 * GB, ms) == pytest.approx(137.0 + 163.0)
    assert load_seconds(m, 547 * GB, 0, ms) == pytest.approx(547e9 / 315e6 + 163.0)    # the disk: declared
    text = expected(m, 547 * GB, 0, None, measured=ms).text(m)
    assert "this host's last start of kimi-k25-int4 (2026-12-01T10:00:00+00:00): 163 s besides reading" in text
    assert measured_from(history, "other", 1) is None
