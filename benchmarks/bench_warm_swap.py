"""Figures for warm swaps (issue 17) on a SIMULATED host. Prints, does not assert.

    .venv/bin/python benchmarks/bench_warm_swap.py [--speed 20] [--warm-mb-s 10]

Swaps kimi-k25-nvfp4 -> kimi-k25-int4 on one host (1.5 TiB RAM, speed S: every simulated rate is
S times the field's) with Kimi-K2.5 INT4's weights made cold first (posix_fadvise DONTNEED), so the
simulated vLLM loads them from its disk at the field's rate (547 GB in 36 min, 80% of it reading)
unless they are in the page cache:

  cold       no warm-up (--no-warm)
  prefetch   no warm-up, the manifest sets vllm.safetensors_load_strategy: prefetch
  warm       the warm-up before the stop (a probe loop asks the old model throughout)
  partial    600 GiB available: the warm-up stops at its budget
  partial+prefetch
  squeezed   available memory drops mid-warm-up: it stops at its floor

Reported per case: downtime (old stopped -> new ready, wall clock), the load (start -> ready), the
simulated vLLM's own "Loading weights took" (its schedule, no CPU contention) and what the warm-up
did. The warm-up reads the scaled files at --warm-mb-s so that the probe loop has time to run; on a
real host it reads at loading.warm_max_mb_s (the disk is the limit there).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.config.inventory import HostEntry  # noqa: E402
from orchestrator.config.manifest import Manifest  # noqa: E402
from orchestrator.host.local import LocalHost  # noqa: E402
from orchestrator.ops.execute import Reporter  # noqa: E402
from orchestrator.ops.swap import run_swap  # noqa: E402
from orchestrator.plan.run import Options  # noqa: E402
from orchestrator.probe.api import Endpoint, smoke_test  # noqa: E402
from orchestrator.sim import manager, pagecache  # noqa: E402
from tests.integration.deployhelp import deploy, free_port, on_port  # noqa: E402

FAST = 2000.0


class Clock(Reporter):
    def __init__(self):
        super().__init__(None, quiet=True)
        self.at: dict[str, float] = {}

    def step_start(self, index, total, action) -> None:
        self.at[action.step] = time.monotonic()


class Probe(threading.Thread):
    """Streamed chat completions to the serving model, one after the other."""

    def __init__(self, port: int, served: str):
        super().__init__(daemon=True)
        self.ep, self.served = Endpoint(LocalHost("probe"), port, None), served
        self.results: list[tuple[float, bool]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            r = smoke_test(self.ep, self.served, "What is 2+2? Answer with one number.", r"\b4\b", 16, 10)
            self.results.append((time.monotonic(), r.ok))


def with_changes(m: Manifest, vllm: dict | None = None, loading: dict | None = None) -> Manifest:
    data = m.model_dump()
    data["vllm"].update(vllm or {})
    data["loading"].update(loading or {})
    return Manifest.model_validate(data)


def weights_took(e: HostEntry, name: str) -> float | None:
    log = (Path(e.log_dir) / f"vllm-{name}.log").read_text(errors="replace")
    found = re.findall(r"Loading weights took ([\d.]+) seconds", log)
    return float(found[-1]) if found else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--speed", type=float, default=20.0)
    ap.add_argument("--warm-mb-s", type=float, default=10.0)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-warm-"))
    os.environ["VLLM_ORCH_STATE_HOME"] = str(tmp / "state")
    home = manager.sim_home()
    manager.up(1, speed=FAST, home=home)
    raw = manager.inventory_hosts(home)["sim"]
    e = HostEntry.model_validate({**raw, "name": "sim"})
    port = free_port()
    old = on_port("kimi-k25-nvfp4", port, budget_seconds=3600)
    plain = with_changes(on_port("kimi-k25-int4", port, budget_seconds=3600),
                         loading={"warm_max_mb_s": a.warm_mb_s})
    pre = with_changes(plain, vllm={"safetensors_load_strategy": "prefetch"})
    opts = dict(poll_s=0.1, budget_s=3600, gpu_release_timeout_s=60)
    int4_dir = Path(e.models_root) / plain.name

    def swap(target, warm=False, clock=None):
        ms = {old.name: old, plain.name: plain, target.name: target}
        return run_swap(e, target, ms, Options(warm=warm, **opts), clock or Reporter(None, quiet=True), False)

    def back():
        manager.up(1, speed=FAST, home=home)
        r = swap(old)
        assert r.ok, r.error

    rows = []

    def case(label, target, warm=False, available_gib=1472.0, squeeze_gib=None, probe=False):
        back()
        manager.set_memory("sim", available_gib=available_gib, home=home)
        size = pagecache.evict_model(int4_dir)
        manager.up(1, speed=a.speed, home=home)
        clock = Clock()
        prober = Probe(port, old.served_name) if probe else None
        squeezer = None
        if squeeze_gib is not None:
            def squeeze():
                while sum(pagecache.cached(pagecache.model_files(int4_dir)).values()) < 0.3 * size:
                    time.sleep(0.01)
                manager.set_memory("sim", available_gib=squeeze_gib, home=home)
            squeezer = threading.Thread(target=squeeze, daemon=True)
            squeezer.start()
        if prober:
            prober.start()
        r = swap(target, warm, clock)
        if prober:
            prober.stop.set()
            prober.join()
        assert r.ok, r.error
        w = r.extra.get("warm") or {}
        row = {"case": label, "downtime": r.extra["downtime_s"], "load": r.extra["load_s"],
               "weights": weights_took(e, target.name), "warm": w,
               "expected": r.plan.info.get("expected_downtime_s")}
        if prober:
            window = [ok for t, ok in prober.results if clock.at["warm"] <= t <= clock.at["stop"]]
            row["probe"] = (len(window), sum(1 for ok in window if not ok))
        step = next(x for x in r.plan.actions if x.step == "warm")
        floor = re.search(r"--floor (\d+)", " ".join(str(c) for c in step.commands))
        row["floor"] = int(floor.group(1)) if floor else None
        rows.append(row)

    try:
        assert deploy(e, plain, poll_s=0.1, budget_s=600).ok          # downloads kimi-k25-int4
        r = run_swap(e, old, {old.name: old, plain.name: plain}, Options(**opts), Reporter(None, quiet=True), False)
        assert r.ok, r.error
        case("cold (--no-warm)", plain)
        case("vLLM prefetch, no warm-up", pre)
        case("warm-up (1.4 TiB available)", plain, warm=True, probe=True)
        case("warm-up, 600 GiB available", plain, warm=True, available_gib=600)
        case("warm-up, 600 GiB available + vLLM prefetch", pre, warm=True, available_gib=600)
        case("warm-up squeezed to 300 GiB mid-way", plain, warm=True, squeeze_gib=300)
        manager.up(1, speed=FAST, home=home)
        manager.set_memory("sim", available_gib=1472, home=home)
    finally:
        manager.down(home)

    cold = rows[0]
    print(f"SIMULATED host, speed {a.speed:g} (every simulated rate x{a.speed:g}; multiply seconds by "
          f"{a.speed:g} for the field's)")
    print(f"{'case':<44} {'downtime':>9} {'load':>7} {'weights':>8} {'/cold':>6}  warm-up")
    for row in rows:
        w = row["warm"]
        what = (f"{w.get('cached_bytes', 0) / max(w.get('total_bytes', 1), 1):.0%} cached ({w.get('reason')}), "
                f"least headroom {w.get('min_headroom') or 0:,} B >= floor {row['floor'] or 0:,} B: "
                f"{(w.get('min_headroom') or 0) >= (row['floor'] or 0)}" if w else "-")
        if "probe" in row:
            what += f"; probe: {row['probe'][0]} requests during the warm-up, {row['probe'][1]} failed"
        print(f"{row['case']:<44} {row['downtime']:>8.2f}s {row['load']:>6.2f}s {row['weights'] or 0:>7.2f}s "
              f"{row['downtime'] / cold['downtime']:>6.2f}  {what}")
    warm = rows[2]
    print(f"downtime warm / cold: {warm['downtime'] / cold['downtime']:.3f} (target <= 0.25); field-equivalent "
          f"{cold['downtime'] * a.speed / 60:.0f} min -> {warm['downtime'] * a.speed / 60:.0f} min")
    print(f"simulated weights (no CPU contention): cold {cold['weights']:.2f}s, warm {warm['weights']:.2f}s; "
          f"the simulator's model: (547/4000 + 432) / 2162 s = {(547e9 / 4e9 + 0.2 * 547e9 / 253e6) / (547e9 / 253e6):.3f}")
    if warm.get("expected"):
        exp = warm["expected"]
        print(f"the plan expected (manifest rates, real sizes): {exp['cold_s'] / 60:.1f} min cold, "
              f"{exp['warm_s'] / 60:.1f} min warm ({exp['warm_s'] / exp['cold_s']:.3f})")


if __name__ == "__main__":
    main()
