"""Figures for sleep swaps (issue 28) on a SIMULATED 8-GPU host (1.5 TiB RAM). Prints, does not assert.

    .venv/bin/python benchmarks/bench_sleep_swap.py [--speed 20] [--cycles 20]

Kimi-K2.5 INT4 <-> Kimi-K2.5 NVFP4 on the same eight GPUs, both with `sleep: {level: 1}`:

  cold        a plain swap (stop, start) between the two, at --speed S: every simulated rate is S
              times the field's, so its downtime x S is the field's
  level 1     `swap --sleep-old` back and forth at speed 1 (the field's rates): the awake one's
              sleep (device -> host copy), the wake (host -> device at 50 GB/s per GPU), the canary
              and the warm-up request, as measured
              (on 1.5 TiB both variants' level-1 pins do not fit: the second to sleep falls back to
              level 2, and its wake reads the checkpoint again, as the plan warns)
  level 2     int4 with `sleep: {level: 2}`: the swap back warms the weights into the page cache while
              the other serves; the wake maps the weights back, reloads them (collective_rpc
              reload_weights) from there and wakes the KV cache, at speed S (the simulated transfers
              x S for the field's)
  canary      the `wake-corrupt` fault: the wake is caught by the canary and rolled back
  cycles      --cycles sleep/wake swaps with the `vram-leak` fault (1000 MiB per sleep): the growth
              each sleep reports, and the cycle whose wake restarts the service cold (past the
              4096 MiB bound) before the GPU runs short for the awake one
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.config.inventory import HostEntry  # noqa: E402
from orchestrator.config.manifest import Manifest  # noqa: E402
from orchestrator.host.local import LocalHost  # noqa: E402
from orchestrator.host.state import read_history  # noqa: E402
from orchestrator.ops.execute import Reporter  # noqa: E402
from orchestrator.ops.swap import run_swap  # noqa: E402
from orchestrator.plan.run import Options  # noqa: E402
from orchestrator.plan.sleep import LEAK_BOUND_MIB  # noqa: E402
from orchestrator.sim import manager  # noqa: E402
from tests.integration.deployhelp import SHIPPED, deploy, free_port  # noqa: E402

FAST = 2000.0


def sleepy(name: str, level: int | None = 1) -> Manifest:
    data = SHIPPED[name].model_dump()
    data["serving"].update(port=free_port(), host="127.0.0.1")
    data["startup"]["budget_seconds"] = 3600
    if level:
        data["sleep"] = {"level": level}
    return Manifest.model_validate(data)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--speed", type=float, default=20.0)
    ap.add_argument("--cycles", type=int, default=20)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-sleep-"))
    os.environ["VLLM_ORCH_STATE_HOME"] = str(tmp / "state")
    home = manager.sim_home()
    manager.up(1, speed=FAST, home=home)
    raw = manager.inventory_hosts(home)["sim"]
    e = HostEntry.model_validate({**raw, "name": "sim"})
    host = LocalHost("sim", env=raw["env"])
    int4, nvfp4 = sleepy("kimi-k25-int4"), sleepy("kimi-k25-nvfp4")
    plain4, plainfp4 = sleepy("kimi-k25-int4", None), sleepy("kimi-k25-nvfp4", None)
    ms = {m.name: m for m in (int4, nvfp4)}
    opts = dict(poll_s=0.05, budget_s=3600, gpu_release_timeout_s=120)

    def swap(target, manifests=ms, **kw):
        r = run_swap(e, target, manifests, Options(**opts, **kw), Reporter(None, quiet=True), False)
        return r

    def speed(s: float) -> None:
        manager.up(1, speed=s, home=home)

    out: dict = {}
    try:
        # the cold swap: plain manifests (no sleep) on the same port pair, at --speed
        assert deploy(e, plain4, poll_s=0.1, budget_s=3600).ok
        speed(a.speed)
        r = swap(plainfp4, {plain4.name: plain4, plainfp4.name: plainfp4})
        assert r.ok, r.error
        out["cold"] = r.extra["downtime_s"] * a.speed
        speed(FAST)
        r = run_swap(e, int4, {**ms, plainfp4.name: plainfp4}, Options(**opts), Reporter(None, quiet=True), False)
        assert r.ok, r.error                                   # int4 with sleep mode serves
        assert swap(nvfp4, sleep_old=True).ok                 # int4 asleep (level 1), nvfp4 serves
        # level 1 at the field's rates: int4 wakes, nvfp4 sleeps; then back
        speed(1.0)
        lvl1 = []
        for target in (int4, nvfp4):
            r = swap(target, sleep_old=True)
            assert r.ok, r.error
            woke = read_history(host, e)[-1].shown()["sleep"]["woke"][target.name]
            lvl1.append((target.name, r.extra["downtime_s"], woke))
            out.setdefault("fallback", []).extend(w for w in r.plan.warnings if "level 2" in w)
        out["level1"] = lvl1
        # level 2 by the manifest: int4 sleeps at level 2; the wake reloads its weights from the page cache
        speed(FAST)
        int4_l2 = sleepy("kimi-k25-int4", 2)
        int4_l2 = Manifest.model_validate({**int4_l2.model_dump(), "serving": int4.model_dump()["serving"]})
        ms2 = {int4.name: int4_l2, nvfp4.name: nvfp4}
        assert swap(int4, sleep_old=True).ok                  # int4 awake, nvfp4 asleep
        r = swap(nvfp4, ms2, sleep_old=True)                   # int4 sleeps at level 2 (its manifest's)
        assert r.ok, r.error
        speed(a.speed)
        r = swap(int4_l2, ms2, sleep_old=True, warm=True)      # wakes int4 from level 2 (its weights warmed first)
        assert r.ok, r.error
        woke2 = read_history(host, e)[-1].shown()["sleep"]["woke"][int4.name]
        slept2 = read_history(host, e)[-1].shown()["sleep"]["slept"][nvfp4.name]
        # field-equivalent: the simulated transfers (the other's sleep, the wake's read) x S, the
        # rest (requests, vllm-orch's own steps) as measured
        scaled = woke2["wake_s"] + slept2["seconds"]
        out["level2"] = (r.extra["downtime_s"], scaled * a.speed + r.extra["downtime_s"] - scaled, woke2)
        speed(FAST)
        # the canary catches a corrupted wake, the rollback brings the other back
        assert swap(nvfp4, sleep_old=True).ok
        manager.add_fault("sim", "wake-corrupt", model=int4.name, home=home)
        r = swap(int4, sleep_old=True)
        out["canary"] = (r.ok, r.error.message if r.error else "", r.extra.get("rollback"))
        # cycles with a leak
        manager.add_fault("sim", "vram-leak", model=nvfp4.name, mib=1000, home=home)
        cycles = []
        for i in range(a.cycles):
            target = int4 if i % 2 == 0 else nvfp4
            r = swap(target, sleep_old=True)
            last = next(h.shown() for h in reversed(read_history(host, e)) if h.operation == "swap")
            slept = (last.get("sleep") or {}).get("slept") or {}
            woke = (last.get("sleep") or {}).get("woke") or {}
            cycles.append((i + 1, target.name, r.ok, slept, woke, r.plan.warnings if r.ok else [str(r.error)]))
        out["cycles"] = cycles
    finally:
        manager.down(home)

    print("SIMULATED 8-GPU host, 1.5 TiB RAM; Kimi-K2.5 INT4 <-> NVFP4 on GPUs 0-7")
    cold = out["cold"]
    print(f"cold swap (stop, start), field-equivalent: downtime {cold:.0f} s ({cold / 60:.1f} min)")
    for name, down, woke in out["level1"]:
        print(f"--sleep-old swap to {name} (speed 1), woken from level {woke['level']}: downtime {down:.2f} s "
              f"(wake {woke['wake_s']:.2f} s, of which reload {woke.get('reload_s', 0):.2f} s; canary "
              f"{woke['canary']}, warm-up {woke['warmup_s']:.2f} s); / cold = {down / cold:.4f} "
              f"(targets at level 1: <= 5 s, <= 0.01)")
    d2, field2, woke2 = out["level2"]
    read_s = 547e9 / 4e9
    print(f"fallback: {out['fallback'][0] if out['fallback'] else 'NONE'}")
    print(f"level {woke2['level']} swap to kimi-k25-int4 (speed {a.speed:g}): downtime {d2:.2f} s, wake "
          f"{woke2['wake_s']:.2f} s (reload {woke2.get('reload_s', 0):.2f} s); "
          f"field-equivalent {field2:.0f} s (the other's sleep and the wake x {a.speed:g}, the rest as measured) "
          f"(target <= the weights' read from the page cache {read_s:.0f} s + 10 s = {read_s + 10:.0f} s)")
    ok, msg, rb = out["canary"]
    print(f"wake-corrupt: swap ok={ok}; {msg[:120]}; rollback {rb}")
    print(f"{a.cycles} sleep/wake swaps with vram-leak (1000 MiB per sleep of kimi-k25-nvfp4; bound {LEAK_BOUND_MIB} MiB):")
    for i, name, ok, slept, woke, said in out["cycles"]:
        s = slept.get("kimi-k25-nvfp4")
        w = woke.get("kimi-k25-nvfp4")
        what = (f"nvfp4 slept keeping {s['gpu_mib']} MiB per GPU, growth {s['growth_mib']} MiB" if s else
                f"nvfp4 woke: {'COLD RESTART: ' + w.get('reason', '') if w and w.get('cold') else 'wake'}" if w else "")
        extra = "; ".join(x for x in said if "nvfp4" in x)
        print(f"  {i:>2} -> {name:<14} ok={ok} {what}" + (f" | {extra}" if extra else ""))


if __name__ == "__main__":
    main()
