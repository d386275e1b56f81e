"""swap with vLLM's sleep mode on the default SIMULATED host (8 GPUs): `--sleep-old` puts the old
service to sleep instead of stopping it; a swap back wakes it, checks its canary, warms it up; a
corrupted wake, a failing wake and too little RAM for level 1 are each caught and said."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.config.manifest import Manifest
from orchestrator.host.nvidia_smi import parse_gpus
from orchestrator.host.state import read_history, read_record, update_record
from orchestrator.ops.status import gather_status
from orchestrator.plan.sleep import LEAK_BOUND_MIB
from orchestrator.probe.api import Endpoint, health, is_sleeping
from orchestrator.sim import manager, vllm_server
from orchestrator.sim.nvidia_smi import write_meminfo

from .deployhelp import SHIPPED, deploy, entry, free_port, swap


def sleepy(name: str, level: int = 1) -> Manifest:
    data = SHIPPED[name].model_dump()
    data["serving"].update(port=free_port(), host="127.0.0.1")
    data["sleep"] = {"level": level}
    return Manifest.model_validate(data)


@pytest.fixture
def pair(sim_host):
    """kimi-k25-int4 serving with sleep mode; kimi-k25-nvfp4 (sleep mode too) to swap in, on the
    same eight GPUs and another port."""
    old, new = sleepy("kimi-k25-int4"), sleepy("kimi-k25-nvfp4")
    e = entry(sim_host)
    result = deploy(e, old)
    assert result.ok, result.error
    return e, old, new, {old.name: old, new.name: new}


def main_pid(sim_host, e, name: str) -> int | None:
    from orchestrator.host.facts import gather
    st = gather(sim_host.host, e, [name]).services.get(name)
    assert st is not None and st.active
    return st.main_pid


def used(sim_host) -> list[int]:
    return [g.memory_used_mib or 0 for g in parse_gpus(sim_host.nvidia_smi(
        "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"), ["index", "memory.used"])]


def test_sleep_old_then_wake_it_back_with_its_canary(sim_host, pair):
    e, old, new, manifests = pair
    assert read_record(sim_host.host, e, old.name).canary is not None, "the canary is recorded at the first ready"
    result = swap(e, new, manifests, sleep_old=True)
    assert result.ok, result.error
    steps = [a.step for a in result.plan.actions]
    assert steps.index("download") < steps.index("sleep") < steps.index("start")
    asleep = read_record(sim_host.host, e, old.name).asleep
    assert asleep is not None and asleep.level == 1 and asleep.cycles == 1
    assert "in host RAM" in asleep.where()
    assert is_sleeping(Endpoint(sim_host.host, old.serving.port)) is True
    assert health(Endpoint(sim_host.host, new.serving.port)) == 200
    first = read_history(sim_host.host, e)[-1].shown()
    assert first["sleep"]["slept"][old.name]["level"] == 1

    pid = main_pid(sim_host, e, old.name)
    back = swap(e, old, manifests, sleep_old=True)          # nvfp4 sleeps, int4 wakes
    assert back.ok, back.error
    assert [a.step for a in back.plan.actions][:3] == ["lock", "sleep", "wake"]
    assert read_record(sim_host.host, e, old.name).asleep is None
    assert read_record(sim_host.host, e, new.name).asleep is not None
    hist = read_history(sim_host.host, e)[-1].shown()
    woke = hist["sleep"]["woke"][old.name]
    assert woke["canary"] == "match" and woke["level"] == 1
    # no start: the same process serves again (timings are benchmarks/bench_sleep_swap.py's)
    assert "start" not in [a.step for a in back.plan.actions]
    assert read_record(sim_host.host, e, old.name).asleep is None and back.extra["downtime_s"] > 0
    assert main_pid(sim_host, e, old.name) == pid


def test_a_corrupted_wake_is_caught_by_the_canary_and_rolled_back(sim_host, pair):
    e, old, new, manifests = pair
    assert swap(e, new, manifests, sleep_old=True).ok
    manager.add_fault("sim", "wake-corrupt", model=old.name, home=sim_host.home)
    result = swap(e, old, manifests, sleep_old=True)
    assert not result.ok and "canary" in result.error.message, result.error
    assert result.extra["rollback"]["ok"], result.extra["rollback"]
    assert is_sleeping(Endpoint(sim_host.host, old.serving.port)) is True     # back to sleep, level 2
    assert read_record(sim_host.host, e, old.name).asleep.level == 2
    assert is_sleeping(Endpoint(sim_host.host, new.serving.port)) is False    # the other one serves again
    assert read_history(sim_host.host, e)[-1].operation == "rollback"
    again = swap(e, old, manifests, sleep_old=True)      # level 2 re-read the weights: the bad copy is gone
    assert again.ok, again.error
    assert read_history(sim_host.host, e)[-1].shown()["sleep"]["woke"][old.name]["canary"] == "match"


def test_a_failing_wake_rolls_back_to_the_other(sim_host, pair):
    e, old, new, manifests = pair
    assert swap(e, new, manifests, sleep_old=True).ok
    manager.add_fault("sim", "wake-fails", model=old.name, home=sim_host.home)
    result = swap(e, old, manifests, sleep_old=True)
    assert not result.ok and result.extra["rollback"]["ok"]
    assert health(Endpoint(sim_host.host, new.serving.port)) == 200
    assert is_sleeping(Endpoint(sim_host.host, new.serving.port)) is False


def test_too_little_ram_for_level_1_falls_back_to_level_2_and_says_so(sim_host, pair):
    e, old, new, manifests = pair
    cfg = json.loads((sim_host.dir / "sim.json").read_text())
    cfg["available_bytes"] = 400 * 2 ** 30              # less than Kimi's 547 GB of weights
    (sim_host.dir / "sim.json").write_text(json.dumps(cfg))
    write_meminfo(sim_host.dir)
    dry = swap(e, new, manifests, dry_run=True, sleep_old=True)
    assert dry.plan.info["sleep_level"] == 2
    assert any("level 2" in w and "host RAM" in w for w in dry.plan.warnings), dry.plan.warnings
    assert "level 2" in dry.plan.text()
    result = swap(e, new, manifests, sleep_old=True)
    assert result.ok, result.error
    asleep = read_record(sim_host.host, e, old.name).asleep
    assert asleep is not None and asleep.level == 2 and "dropped" in asleep.where()
    back = swap(e, old, manifests, warm=True)           # wakes int4 from level 2; nvfp4 stops
    assert back.ok, back.error
    steps = [a.step for a in back.plan.actions]
    assert steps.index("warm") < steps.index("stop") < steps.index("wake")     # read from the page cache
    woke = read_history(sim_host.host, e)[-1].shown()["sleep"]["woke"][old.name]
    assert woke["level"] == 2 and woke["reload_s"] > 0, woke
    assert read_record(sim_host.host, e, new.name) is None
    # vLLM 0.33's restore of a level-2 sleep (its snapshot/server.py): the weights' tag, the reload of
    # the checkpoint into them, the KV cache's tag; a bare /wake_up would have served empty weights
    log = (Path(e.log_dir) / f"vllm-{old.name}.log").read_text()
    at = [log.rindex(line) for line in ("wake up the engine with tags: ['weights']", "Reloading weights inplace...",
                                        "wake up the engine with tags: ['kv_cache']")]
    assert at == sorted(at), at


def test_a_sleeping_service_keeps_its_context_graph_pool_and_nccl_buffers_within_its_allowance(sim_host, pair):
    """vLLM 0.33 keeps a sleeper's CUDA-graph pool on the GPU (sleep_mode_offload_cudagraph is False
    by default) and NCCL's buffers untouched: a TP8 sleeper keeps context + graphs + NCCL, over the
    bare 1024 MiB context allowance. Its allowance counts the graph pool its start logged, so an
    ordinary sleep warns nothing."""
    e, old, new, manifests = pair
    assert read_record(sim_host.host, e, old.name).graph_pool_mib == vllm_server.GRAPH_POOL_MIB
    result = swap(e, new, manifests, sleep_old=True)
    assert result.ok, result.error
    kept = read_record(sim_host.host, e, old.name).asleep
    want = vllm_server.CUDA_CONTEXT_MIB + vllm_server.GRAPH_POOL_MIB + vllm_server.NCCL_BUFFERS_MIB
    assert kept is not None and max(kept.gpu_mib.values()) == want > 1024
    assert kept.allowance_mib == 1024 + vllm_server.GRAPH_POOL_MIB >= want
    assert not [w for w in result.extra.get("warnings", []) if "allowance" in w], result.extra.get("warnings")
    assert min(used(sim_host)) > 80000          # nvfp4 awake on every GPU beside it


def test_memory_kept_over_cycles_is_reported_and_a_sleeper_that_would_crowd_the_gpus_stops(sim_host, pair):
    """vram-leak (vllm #36651): each sleep of kimi-k25-int4 leaves 2500 MiB more per GPU. The growth
    is recorded and shown; the sleep that would leave kimi-k25-nvfp4 too little memory is not done:
    the plan says so and stops kimi-k25-int4 instead (its next start is cold)."""
    e, old, new, manifests = pair
    manager.add_fault("sim", "vram-leak", model=old.name, mib=2500, home=sim_host.home)
    assert swap(e, new, manifests, sleep_old=True).ok              # int4's 1st sleep
    assert swap(e, old, manifests, sleep_old=True).ok              # int4 wakes, nvfp4 sleeps
    assert swap(e, new, manifests, sleep_old=True).ok              # int4's 2nd sleep
    asleep = read_record(sim_host.host, e, old.name).asleep
    assert asleep.cycles == 2 and asleep.growth_mib == 2500, asleep
    slept = read_history(sim_host.host, e)[-1].shown()["sleep"]["slept"][old.name]
    assert slept["growth_mib"] == 2500 and slept["cycles"] == 2
    row = next(v for h in gather_status([e]) for v in h.services if v.name == old.name)
    assert row.state == "asleep" and "2500 MiB more than after its first sleep" in row.state_reason
    assert row.asleep["growth_mib"] == 2500 and "in host RAM" in row.asleep["where"]
    assert swap(e, old, manifests, sleep_old=True).ok              # int4 wakes (growth under the bound)
    result = swap(e, new, manifests, sleep_old=True)               # a 3rd sleep would keep ~8 GiB
    assert result.ok, result.error
    assert any("too little" in w and "stopped instead" in w for w in result.plan.warnings), result.plan.warnings
    assert read_record(sim_host.host, e, old.name) is None         # stopped, its record gone
    assert is_sleeping(Endpoint(sim_host.host, new.serving.port)) is False


def test_a_sleeper_grown_past_the_bound_is_restarted_cold_at_its_wake(sim_host, pair):
    e, old, new, manifests = pair
    assert swap(e, new, manifests, sleep_old=True).ok
    rec = read_record(sim_host.host, e, old.name)
    grown = rec.asleep.model_copy(update={"growth_mib": LEAK_BOUND_MIB + 1, "cycles": 7})
    update_record(sim_host.host, e, old.name, asleep=grown)
    pid = main_pid(sim_host, e, old.name)
    result = swap(e, old, manifests)                                # nvfp4 stops, int4 restarts cold
    assert result.ok, result.error
    woke = read_history(sim_host.host, e)[-1].shown()["sleep"]["woke"][old.name]
    assert woke["cold"] is True and "bound" in woke["reason"]
    assert main_pid(sim_host, e, old.name) != pid
    assert read_record(sim_host.host, e, old.name).canary is not None


def test_every_start_records_its_phases_from_vllms_lines(sim_host, pair):
    e, old, new, manifests = pair
    deployed = read_history(sim_host.host, e)[-1].shown()
    ledger = deployed["startup"]
    for key in ("download_s", "weights_s", "compile_s", "graphs_s", "init_engine_s", "api_up_s",
                "first_token_s", "ready_s"):
        assert key in ledger, (key, ledger)
    assert ledger["api_up_s"] <= ledger["first_token_s"] <= ledger["ready_s"]
    # the next plan to start it expects this host's figures, not the manifest's declared ones
    assert swap(e, new, manifests).ok                   # a stop/start swap to nvfp4
    dry = swap(e, old, manifests, dry_run=True)
    warm = next(a for a in dry.plan.actions if a.step == "warm")
    assert f"this host's last start of {old.name}" in warm.summary + " ".join(warm.details), warm.summary


def test_per_service_commands_pick_the_awake_service_beside_a_sleeper(sim_host, pair, tmp_path):
    # `history --host sim` and `bench --host sim` refused while one service slept ("runs several
    # services: name one", suggesting the sleeping one); the awake one is the only one that serves.
    import os
    import subprocess
    import sys
    e, old, new, manifests = pair
    assert swap(e, new, manifests, sleep_old=True).ok

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], capture_output=True,
                              text=True, timeout=300, env=dict(os.environ, NO_COLOR="1", COLUMNS="200"))
    hist = cli("history", "--host", "sim", "--json")
    assert hist.returncode == 0, hist.stderr
    assert {r.get("model") for r in json.loads(hist.stdout)} >= {old.name, new.name}
    logs = cli("logs", "--host", "sim", "-n", "5")
    assert logs.returncode == 0, logs.stderr
    bench = cli("bench", "--host", "sim", "-c", "1", "--max-tokens", "8", "--duration", "1",
                "--out", str(tmp_path / "bench"))
    assert bench.returncode == 0, bench.stdout[-1500:] + bench.stderr[-1500:]
    result = json.loads(next((tmp_path / "bench").rglob("result.json")).read_text())
    assert new.name in json.dumps(result)[:5000] and old.name not in json.dumps(result.get("service", {}))
    # stop changes something: it still asks which one
    stop = cli("stop", "--host", "sim", "--yes")
    assert stop.returncode == 2 and f"{old.name} (asleep)" not in stop.stderr, stop.stderr


def test_a_sleep_swap_under_load_drains_the_requests_in_flight_and_aborts_none(sim_host, pair):
    # vLLM's /sleep aborts what runs unless asked to wait (mode=abort by default); vllm-orch sent no
    # mode, so every request in flight at a sleep swap ended with finish_reason "abort".
    import threading
    import time
    import urllib.request

    from orchestrator.host.state import read_history

    e, old, new, manifests = pair
    body = json.dumps({"model": old.served_name, "prompt": "Count slowly.", "max_tokens": 200,
                       "min_tokens": 200}).encode()
    answers: list = []

    def one():
        req = urllib.request.Request(f"http://127.0.0.1:{old.serving.port}/v1/completions", data=body,
                                     method="POST", headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            answers.append(json.loads(r.read())["choices"][0]["finish_reason"])

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)                                       # the requests are in flight
    result = swap(e, new, manifests, sleep_old=True)
    for t in threads:
        t.join(300)
    assert result.ok, result.error
    assert len(answers) == 4 and "abort" not in answers, answers
    slept = read_history(sim_host.host, e)[-1].shown()["sleep"]["slept"][old.name]
    assert slept["aborted"] == 0, slept
    (sleep,) = [a for a in result.plan.actions if a.step == "sleep"]
    assert any("mode=wait" in d for d in sleep.details), sleep.details
