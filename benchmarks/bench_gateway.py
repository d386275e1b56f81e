"""The gateway under load (issue 41): a SIMULATED host, a keyed kimi-k25-int4, `vllm-orch gateway up`,
and the real OpenAI client (AsyncOpenAI, its default retries) streaming at concurrency C.

  1. overhead: the same load direct to the service and through the gateway, one after the other:
     time to first token p50/p99, completed streams per second, HAProxy's CPU seconds per 1k tokens.
  2. swaps under load: C streams of `kimi-k2.5` while the host swaps N times between its two
     manifests of that served name (kimi-k25-int4 <-> kimi-k25-int4-dcp8, staged, one port): every
     request's outcome (whole / cut / error as the client saw it) and its wait, p50/p99.

    .venv/bin/python benchmarks/bench_gateway.py [--concurrency 32] [--swaps 10] [--seconds 10]

Figures from this 2-core machine are in docs/figures.md ("The gateway"). The client runs on the
same 2 cores as HAProxy and the simulated vLLM, so the overhead figures are an upper bound.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai  # noqa: E402
import psutil  # noqa: E402

from orchestrator.config.inventory import HostEntry  # noqa: E402
from orchestrator.ops import gateway as og  # noqa: E402
from orchestrator.sim import manager  # noqa: E402
from tests.integration.deployhelp import deploy, free_port, swap, tuned  # noqa: E402

GW_KEY = "bench-gateway-key-0123456789"
SERVICE_KEY = "bench-service-key-0123456789"


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


async def load(base_url: str, key: str, concurrency: int, stop: threading.Event, out: dict, tokens: int = 32) -> None:
    c = openai.AsyncOpenAI(base_url=base_url, api_key=key, timeout=120)

    async def one() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            first = None
            try:
                s = await c.chat.completions.create(model="kimi-k2.5", max_tokens=tokens, stream=True,
                                                    messages=[{"role": "user", "content": "hi"}],
                                                    extra_body={"ignore_eos": True})
                n = 0
                last = None
                async for ch in s:
                    if first is None:
                        first = time.monotonic() - t0
                    n += 1
                    last = ch
                whole = last is not None and last.choices and last.choices[0].finish_reason == "length"
                out["outcomes"][("whole" if whole else "cut")] = out["outcomes"].get("whole" if whole else "cut", 0) + 1
                out["ttft"].append(first or 0.0)
                out["wait"].append(time.monotonic() - t0)
                out["tokens"] += tokens
            except openai.APIError as exc:
                name = type(exc).__name__
                out["outcomes"][name] = out["outcomes"].get(name, 0) + 1

    await asyncio.gather(*(one() for _ in range(concurrency)))


def run_load(base_url: str, key: str, concurrency: int, seconds: float | None, until: threading.Event | None = None):
    out: dict = {"outcomes": {}, "ttft": [], "wait": [], "tokens": 0}
    stop = until or threading.Event()
    if seconds is not None:
        threading.Timer(seconds, stop.set).start()
    t0 = time.monotonic()
    asyncio.run(load(base_url, key, concurrency, stop, out))
    out["seconds"] = time.monotonic() - t0
    return out


def haproxy_cpu() -> float:
    return sum(sum(p.cpu_times()[:2]) for p in psutil.process_iter(["name"]) if p.info["name"] == "haproxy")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--swaps", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    if not shutil.which("haproxy") and not Path("/usr/sbin/haproxy").exists():
        raise SystemExit("needs haproxy (apt-get install haproxy)")
    tmp = Path(tempfile.mkdtemp(prefix="bench-gw-"))
    os.environ.update(VLLM_ORCH_STATE_HOME=str(tmp / "state"), VLLM_API_KEY=SERVICE_KEY,
                      VLLM_ORCH_GATEWAY_KEYS=GW_KEY)
    home = manager.sim_home()
    manager.up(1, speed=2000.0, home=home)
    try:
        keyed = {"secret_env": ["VLLM_API_KEY"]}
        a = tuned("kimi-k25-int4", serving=keyed)
        b = tuned("kimi-k25-int4-dcp8", a.serving.port, serving=keyed)
        port = free_port()
        run_dir = tempfile.mkdtemp(prefix="gw-", dir="/tmp")
        raw = manager.inventory_hosts(home)["sim"]
        entry = HostEntry.model_validate({**raw, "name": "sim", "gateway": {"port": port, "run_dir": run_dir,
                                                                            "hold_seconds": 30}})
        assert deploy(entry, a).ok
        up = og.up(entry)
        print(f"gateway {up.url} -> {[r['target'] for r in up.routes]}")
        direct = f"http://127.0.0.1:{a.serving.port}/v1"
        # 1. overhead
        d = run_load(direct, SERVICE_KEY, args.concurrency, args.seconds)
        cpu0 = haproxy_cpu()
        g = run_load(up.url, GW_KEY, args.concurrency, args.seconds)
        cpu = haproxy_cpu() - cpu0
        for name, r in (("direct", d), ("gateway", g)):
            print(f"{name:8s} C={args.concurrency}: {len(r['ttft'])} streams in {r['seconds']:.1f} s "
                  f"({len(r['ttft']) / r['seconds']:.1f}/s), TTFT p50 {pct(r['ttft'], .5) * 1000:.1f} ms "
                  f"p99 {pct(r['ttft'], .99) * 1000:.1f} ms, outcomes {r['outcomes']}")
        print(f"added TTFT: p50 {(pct(g['ttft'], .5) - pct(d['ttft'], .5)) * 1000:+.1f} ms, "
              f"p99 {(pct(g['ttft'], .99) - pct(d['ttft'], .99)) * 1000:+.1f} ms; throughput ratio "
              f"{(len(g['ttft']) / g['seconds']) / (len(d['ttft']) / d['seconds']):.3f}; HAProxy CPU "
              f"{cpu / max(g['tokens'], 1) * 1000 * 1000:.1f} ms per 1k tokens streamed")
        # 2. swaps under load
        stop = threading.Event()
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(run_load(up.url, GW_KEY, args.concurrency, None, stop)))
        t.start()
        time.sleep(2)
        manifests = {a.name: a, b.name: b}
        downtimes = []
        for i in range(args.swaps):
            target = b if i % 2 == 0 else a
            r = swap(entry, target, manifests)
            if not r.ok:
                print(f"swap {i + 1} to {target.name} FAILED: {r.error}")
            downtimes.append(r.extra.get("downtime_s") or 0.0)
        time.sleep(2)
        stop.set()
        t.join(120)
        outcomes = result["outcomes"]
        failed = sum(v for k, v in outcomes.items() if k != "whole")
        print(f"{args.swaps} staged swaps under C={args.concurrency} streams: {sum(outcomes.values())} requests, "
              f"outcomes {outcomes}, failed {failed}; wait p50 {pct(result['wait'], .5):.2f} s p99 "
              f"{pct(result['wait'], .99):.2f} s max {max(result['wait']):.2f} s; swap downtime (old stopped -> new "
              f"ready) mean {sum(downtimes) / len(downtimes):.2f} s")
        og.down(entry)
        return 0 if failed == 0 else 1
    finally:
        manager.down(home)


if __name__ == "__main__":
    sys.exit(main())
