"""Warm swaps on a SIMULATED host, measured on the real page cache: the host reports its RAM scaled
like its files and follows its live workers; the simulated vLLM loads cached weights at the RAM
rate and the rest from its disk (and prefetches like vLLM 0.33 when told to); a swap's warm-up
reads the new weights while the old model keeps answering, stops at the memory budget or when
available memory falls, and the load after it reads from RAM. Timing asserts are loose bounds
(a busy machine only adds time); the figures are printed by benchmarks/bench_warm_swap.py."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.config.inventory import HostEntry
from orchestrator.host.facts import gather
from orchestrator.host.local import LocalHost
from orchestrator.host.state import read_history
from orchestrator.ops.execute import Reporter
from orchestrator.ops.stop import stop_model
from orchestrator.ops.swap import run_swap
from orchestrator.plan.warm import budget_for
from orchestrator.probe.api import Endpoint, health
from orchestrator.sim import manager, pagecache

from .deployhelp import deploy, free_port, on_port, opts
from .test_sim_server import KIMI_ARGV, SimServer

GIB = 1 << 30
SCALE = manager.DEFAULT_SCALE
# The kernel may drop a clean page of the page cache at any moment (seen: one 4 KiB page of the first
# weight file, in about one run in three on a busy 2-core machine). "All cached" therefore means all
# but a few pages: exact page counts would make these tests depend on reclaim, not on our code.
RECLAIM_SLACK = 16 * 4096


def all_cached(cached: int, total: int) -> bool:
    return total - RECLAIM_SLACK <= cached <= total


def weights_took(log: str) -> float:
    return float(re.findall(r"Loading weights took ([\d.]+) seconds", log)[-1])


def model_dir(sim_host, name: str, shards: int = 16, shard_bytes: int = 256 << 10, total: float = 547e9) -> Path:
    """A Kimi-like folder with shards big enough to be read piece by piece."""
    d = sim_host.dir / "models" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"_name_or_path": "moonshotai/Kimi-K2.5", "auto_map": {}}))
    files = [f"model-{i:05d}-of-{shards:06d}.safetensors" for i in range(1, shards + 1)]
    for f in files:
        (d / f).write_bytes(os.urandom(shard_bytes))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": int(total)}, "weight_map": {f"w{i}": f for i, f in enumerate(files)}}))
    return d


def test_the_simulated_host_reports_scaled_ram_that_follows_its_live_workers(sim_host):
    meminfo = sim_host.entry["meminfo"]
    assert meminfo == str(sim_host.dir / "meminfo")
    facts = gather(sim_host.host, HostEntry.model_validate({**sim_host.entry, "name": "sim"}))
    assert facts.memory is not None and facts.memory.total == 1536 * GIB // SCALE // 1024 * 1024
    idle = facts.memory.available
    assert idle == 1472 * GIB // SCALE // 1024 * 1024
    d = model_dir(sim_host, "kimi-k25-int4")
    with SimServer(sim_host, [str(d), *KIMI_ARGV]) as srv:
        srv.wait_ready(timeout=60)
        serving = gather(sim_host.host, HostEntry.model_validate({**sim_host.entry, "name": "sim"})).memory
        assert serving is not None and idle - serving.available == pytest.approx(8 * 12 * GIB / SCALE, abs=8192)
        assert f"Available RAM: {serving.available / GIB:.2f} GiB" in srv.log or "Available RAM: 0.1" in srv.log
    after = Path(meminfo).read_text()
    assert f"MemAvailable:   {idle // 1024:>8} kB" in after          # the stop gave the memory back
    manager.set_memory("sim", available_gib=600, home=sim_host.home)
    assert f"{600 * GIB // SCALE // 1024:>8} kB" in Path(meminfo).read_text()


def test_the_simulated_load_follows_the_real_page_cache_and_prefetches_like_vllm(sim_host):
    d = model_dir(sim_host, "kimi-k25-int4")
    files = pagecache.model_files(d)
    took = {}
    for case, extra in (("cold", []), ("cached", []), ("prefetch", ["--safetensors-load-strategy", "prefetch"])):
        if case != "cached":
            pagecache.evict(files)
        now, size = sum(pagecache.cached(files).values()), sum(p.stat().st_size for p in files)
        assert all_cached(now, size) if case == "cached" else now == 0
        with SimServer(sim_host, [str(d), *KIMI_ARGV, *extra]) as srv:
            srv.wait_ready(timeout=60)
            took[case] = weights_took(srv.log)
            log = srv.log
        left = pagecache.cached(files)
        assert all_cached(sum(left.values()), size), (case, left)  # what mmap leaves
        assert "Filesystem type for checkpoints: " in log
        if case == "prefetch":
            assert "Prefetching checkpoint files into page cache started (in background, num_threads=8" in log
            assert "Prefetching checkpoint files into page cache finished in" in log
        else:
            assert "Auto-prefetch is disabled because the filesystem" in log
    # 547 GB at speed 2000: ~0.87 s from the simulated disk, ~0.07 s from the page cache
    assert took["cold"] > 3 * took["cached"], took
    # prefetch reads the same disk during the load: it cannot beat the disk (a lower bound only)
    assert took["prefetch"] > 0.5 * took["cold"], took


class StepClock(Reporter):
    """A quiet reporter that remembers when each step started and ended (monotonic)."""

    def __init__(self):
        super().__init__(None, quiet=True)
        self.times: dict[str, list[float]] = {}

    def step_start(self, index, total, action) -> None:
        self.times[action.step] = [time.monotonic()]

    def step_end(self, res) -> None:
        if res.step in self.times:
            self.times[res.step].append(time.monotonic())


class Probe(threading.Thread):
    """Asks the serving model's /health in a loop and keeps (time, status)."""

    def __init__(self, host, port: int):
        super().__init__(daemon=True)
        self.ep, self.seen, self.done = Endpoint(host, port, None), [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.seen.append((time.monotonic(), health(self.ep, timeout=5)))
            time.sleep(0.02)


@pytest.fixture
def slow_host(tmp_path, monkeypatch):
    """A SIMULATED host loading at 300x the field's rate (Kimi: ~8.6 s cold weights, ~0.6 s cached)."""
    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path / "state"))
    home = manager.sim_home()
    manager.up(1, speed=300, home=home)
    try:
        raw = yaml.safe_load(manager.inventory_file(home).read_text())["hosts"]["sim"]
        yield HostEntry.model_validate({**raw, "name": "sim"}), home
    finally:
        manager.down(home)


def swapped(e, m, manifests, **kw):
    clock = StepClock()
    return run_swap(e, m, manifests, opts(**kw), clock, False), clock


def test_a_warm_swap_reads_while_the_old_model_serves_and_loads_from_ram(slow_host):
    e, _home = slow_host
    port = free_port()
    old, new = on_port("kimi-k25-int4", port), on_port("kimi-k25-nvfp4", port)
    manifests = {old.name: old, new.name: new}
    assert deploy(e, old).ok
    assert swapped(e, new, manifests)[0].ok and swapped(e, old, manifests)[0].ok    # nvfp4 downloaded
    new_dir = Path(e.models_root) / new.name
    pagecache.evict_model(new_dir)
    cold, _ = swapped(e, new, manifests)                                            # --no-warm
    assert cold.ok and "warm" not in cold.extra and "warming is off" in cold.plan.text()
    assert swapped(e, old, manifests)[0].ok
    size = pagecache.evict_model(new_dir)
    probe = Probe(LocalHost("sim"), port)
    probe.start()
    try:
        warm, clock = swapped(e, new, manifests, warm=True)
    finally:
        probe.done.set()
        probe.join()
    assert warm.ok, warm.error
    steps = [a.step for a in warm.plan.actions]
    assert steps.index("warm") == steps.index("stop") - 1
    w = warm.extra["warm"]
    assert w["reason"] == "complete" and w["warmed_bytes"] == w["total_bytes"] == size
    assert all_cached(w["cached_bytes"], size)
    start, end = clock.times["warm"][0], clock.times["stop"][0]
    during = [status for t, status in probe.seen if start <= t <= end]
    assert during and all(status == 200 for status in during), during       # the old model kept answering
    assert warm.extra["weights_s"] < cold.extra["weights_s"] / 2, (warm.extra, cold.extra)
    assert warm.extra["downtime_s"] < cold.extra["downtime_s"]
    rec = read_history(LocalHost("sim"), e)[-1].shown()
    assert rec["warm"]["reason"] == "complete" and rec["expected_s"]["warm_s"] < rec["expected_s"]["cold_s"]


@pytest.mark.long
def test_the_warm_up_stops_at_its_budget_and_when_memory_falls(slow_host):
    e, home = slow_host
    port = free_port()
    old = on_port("kimi-k25-int4", port)
    new = on_port("kimi-k25-nvfp4", port)
    slow = new.model_copy(update={"loading": new.loading.model_copy(update={"warm_max_mb_s": 15.0})})
    manifests = {old.name: old, new.name: slow}
    assert deploy(e, old).ok
    assert swapped(e, slow, manifests)[0].ok and swapped(e, old, manifests)[0].ok
    new_dir = Path(e.models_root) / new.name
    # 600 GiB available with kimi-k25-int4 serving (96 GiB): the budget is ~66% of nvfp4's files
    manager.set_memory("sim", available_gib=600, home=home)
    pagecache.evict_model(new_dir)
    first, _ = swapped(e, slow, manifests, warm=True)
    w = first.extra["warm"]
    assert first.ok and w["reason"] == "budget" and 0.5 * w["total_bytes"] < w["cached_bytes"] < w["total_bytes"]
    assert swapped(e, old, manifests)[0].ok
    manager.set_memory("sim", available_gib=1472, home=home)
    size = pagecache.evict_model(new_dir)
    facts = gather(LocalHost("sim", env=e.env), e)
    b = budget_for(facts.memory, slow, e)
    assert b is not None and b.budget > size                      # everything would fit ...

    def squeeze():                                                # ... until memory runs short
        while sum(pagecache.cached(pagecache.model_files(new_dir)).values()) < 0.2 * size:
            time.sleep(0.02)
        manager.set_memory("sim", available_gib=300, home=home)

    t = threading.Thread(target=squeeze, daemon=True)
    t.start()
    second, _ = swapped(e, slow, manifests, warm=True)
    t.join(timeout=30)
    w = second.extra["warm"]
    assert second.ok, second.error
    assert w["reason"] == "memory" and 0.2 * size <= w["cached_bytes"] < size
    assert w["min_headroom"] >= b.floor                           # never under the floor it was given


def test_deploy_warm_after_a_stop(slow_host):
    e, _home = slow_host
    m = on_port("kimi-k25-int4")
    assert deploy(e, m).ok
    host = LocalHost("sim", env=e.env)
    stop_model(host, e, m.name, release_timeout=30, poll=0.1)
    size = pagecache.evict_model(Path(e.models_root) / m.name)
    r = deploy(e, m, warm=True)
    assert r.ok, r.error
    steps = [a.step for a in r.plan.actions]
    assert steps.index("warm") == steps.index("start") - 1
    rec = read_history(host, e)[-1].shown()
    assert rec["warm"]["warmed_bytes"] == size and rec["warm"]["reason"] == "complete"
    assert rec["expected_s"]["warm_s"] < rec["expected_s"]["cold_s"]
