"""The gateway under load (issue 41): a SIMULATED host, keyed minimax-m25 services, `vllm-orch gateway
up`, and the real OpenAI client (AsyncOpenAI, its default retries) streaming at concurrency C.

  1. overhead: the same load direct to the service and through the gateway, one after the other, at
     each concurrency of --overhead: time to first token p50/p99, completed streams per second,
     HAProxy's CPU seconds per 1k tokens.
  2. ten operations in a row under load: C streams of `minimax-m2.5` while the CLI runs, on the same
     host, a staged swap, a warm swap, a swap that fails and rolls back, `regen --restart`, a stop
     and a deploy of another service of the host (minimax-b, GPUs 4-7), and four sleep swaps (there
     and back, twice) between the two manifests that serve that name (GPUs 0-3, two loopback ports).
     Every request's outcome (whole / cut / error, as the client saw it, after its retries) and its
     wait (send to last chunk), p50/p99, in all and per operation.

    .venv/bin/python benchmarks/bench_gateway.py [--concurrency 32] [--overhead 32,128] [--seconds 10]

Figures from this 2-core machine are in docs/figures.md ("The gateway"). The client runs on the
same 2 cores as HAProxy and the simulated vLLM, so the overhead figures are an upper bound.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai  # noqa: E402
import psutil  # noqa: E402
import yaml  # noqa: E402

from orchestrator.config.manifest import Manifest  # noqa: E402
from orchestrator.sim import manager  # noqa: E402
from tests.integration.deployhelp import free_port, tuned, write_models  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GW_KEY = "bench-gateway-key-0123456789"
SERVICE_KEY = "bench-service-key-0123456789"
MODEL = "minimax-m2.5"


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


async def load(base_url: str, key: str, concurrency: int, stop: threading.Event, out: dict, tokens: int = 32) -> None:
    """C streams of MODEL until `stop`; each request's (end time, outcome, wait, ttft) into out["requests"]."""
    c = openai.AsyncOpenAI(base_url=base_url, api_key=key, timeout=120)

    async def one() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            first = None
            try:
                s = await c.chat.completions.create(model=MODEL, max_tokens=tokens, stream=True,
                                                    messages=[{"role": "user", "content": "hi"}],
                                                    extra_body={"ignore_eos": True})
                last = None
                async for ch in s:
                    if first is None:
                        first = time.monotonic() - t0
                    last = ch
                whole = last is not None and last.choices and last.choices[0].finish_reason == "length"
                outcome = "whole" if whole else "cut"
                out["tokens"] += tokens
            except openai.APIError as exc:
                outcome = f"{type(exc).__name__}: {str(exc)[:100]}"
            end = time.monotonic()
            out["requests"].append((end, outcome, end - t0, first))

    await asyncio.gather(*(one() for _ in range(concurrency)))
    await c.close()


def run_load(base_url: str, key: str, concurrency: int, seconds: float | None, until: threading.Event | None = None):
    out: dict = {"requests": [], "tokens": 0}
    stop = until or threading.Event()
    if seconds is not None:
        threading.Timer(seconds, stop.set).start()
    t0 = time.monotonic()
    asyncio.run(load(base_url, key, concurrency, stop, out))
    out["seconds"] = time.monotonic() - t0
    return out


def outcomes(requests: list) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, outcome, _, _ in requests:
        out[outcome] = out.get(outcome, 0) + 1
    return out


def haproxy_cpu() -> float:
    return sum(sum(p.cpu_times()[:2]) for p in psutil.process_iter(["name"]) if p.info["name"] == "haproxy")


def sleepy(name: str, **serving) -> Manifest:
    """A shipped manifest, keyed, sleep-capable (level 1, loopback), on a free port."""
    m = tuned(name, serving={"secret_env": ["VLLM_API_KEY"], "host": "127.0.0.1", **serving})
    data = m.model_dump()
    data["sleep"] = {"level": 1}
    return Manifest.model_validate(data)


def variant(m: Manifest, name: str, **serving) -> Manifest:
    data = m.model_dump()
    data.update(name=name)
    data["serving"].update(port=free_port(), **serving)
    return Manifest.model_validate(data)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=32, help="streams during the ten operations")
    ap.add_argument("--overhead", default="32,128", help="concurrencies of the direct / gateway comparison")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each overhead run")
    args = ap.parse_args()
    if not shutil.which("haproxy") and not Path("/usr/sbin/haproxy").exists():
        raise SystemExit("needs haproxy (apt-get install haproxy)")
    tmp = Path(tempfile.mkdtemp(prefix="bench-gw-"))
    state_home = tmp / "state"
    env = dict(os.environ, VLLM_ORCH_STATE_HOME=str(state_home), VLLM_API_KEY=SERVICE_KEY,
               VLLM_ORCH_GATEWAY_KEYS=GW_KEY, VLLM_ORCH_MODELS=str(tmp / "models"))
    os.environ.update(env)
    home = manager.sim_home()
    manager.up(1, speed=2000.0, home=home)
    run_dir = tempfile.mkdtemp(prefix="gw-", dir="/tmp")
    port = free_port()

    def cli(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *argv], env=env, cwd=str(REPO),
                              capture_output=True, text=True, timeout=timeout)

    try:
        c = sleepy("minimax-m25")                                     # GPUs 0-3, served minimax-m2.5
        c2 = variant(c, "minimax-m25-b")                              # the same served name, another port
        bad = variant(c, "minimax-m25-bad")                           # its start fails (fault below)
        d = variant(c, "minimax-b", gpu_ids=[4, 5, 6, 7], served_model_name="minimax-b")
        write_models(tmp / "models", [c, c2, bad, d])
        inventory = state_home / "hosts.d" / "sim.yaml"
        data = yaml.safe_load(inventory.read_text())
        data["hosts"]["sim"]["gateway"] = {"port": port, "run_dir": run_dir, "hold_seconds": 60, "drain_seconds": 30}
        inventory.write_text(yaml.safe_dump(data))
        for name in (c.name, d.name):
            r = cli("deploy", name, "--host", "sim")
            assert r.returncode == 0, r.stdout + r.stderr
        r = cli("gateway", "up", "--host", "sim")
        assert r.returncode == 0, r.stdout + r.stderr
        url = f"http://127.0.0.1:{port}/v1"
        print(r.stdout.strip())
        direct = f"http://127.0.0.1:{c.serving.port}/v1"

        # 1. overhead
        for conc in [int(x) for x in args.overhead.split(",") if x]:
            dr = run_load(direct, SERVICE_KEY, conc, args.seconds)
            cpu0 = haproxy_cpu()
            g = run_load(url, GW_KEY, conc, args.seconds)
            cpu = haproxy_cpu() - cpu0
            ttft = {}
            for name, res in (("direct", dr), ("gateway", g)):
                firsts = [f for _, o, _, f in res["requests"] if o == "whole" and f is not None]
                ttft[name] = firsts
                print(f"{name:8s} C={conc}: {len(firsts)} streams in {res['seconds']:.1f} s "
                      f"({len(firsts) / res['seconds']:.1f}/s), TTFT p50 {pct(firsts, .5) * 1000:.1f} ms "
                      f"p99 {pct(firsts, .99) * 1000:.1f} ms, outcomes {outcomes(res['requests'])}")
            print(f"C={conc} added TTFT: p50 {(pct(ttft['gateway'], .5) - pct(ttft['direct'], .5)) * 1000:+.1f} ms, "
                  f"p99 {(pct(ttft['gateway'], .99) - pct(ttft['direct'], .99)) * 1000:+.1f} ms; throughput ratio "
                  f"{(len(ttft['gateway']) / g['seconds']) / (len(ttft['direct']) / dr['seconds']):.3f}; "
                  f"HAProxy CPU {cpu / max(g['tokens'], 1) * 1000 * 1000:.1f} ms per 1k tokens streamed")

        # 2. ten operations in a row under load
        def regen_restart() -> list[str]:
            changed = c.model_dump(exclude={"name"})
            changed["vllm"]["max_num_seqs"] = (c.vllm.max_num_seqs or 64) + 1       # new unit: a restart
            (tmp / "models" / f"{c.name}.yaml").write_text(yaml.safe_dump(changed, sort_keys=False))
            return ["regen", "--host", "sim", "--restart"]

        def failing_swap() -> list[str]:
            # its start dies as vLLM does when other processes hold GPU memory
            manager.add_fault("sim", "crash-gpu-memory", model=bad.name, home=home)
            return swap(bad, c)()

        def swap(new: Manifest, old: Manifest, *flags: str):
            return lambda: ["swap", new.name, "--host", "sim", "--replace", old.name, *flags]

        ops = [
            ("staged swap", swap(c2, c, "--no-warm"), 0),
            ("warm swap", swap(c, c2), 0),
            ("failed swap, rolled back", failing_swap, 1),
            ("regen --restart", regen_restart, 0),
            ("stop another service", lambda: ["stop", d.name, "--host", "sim"], 0),
            ("deploy another service", lambda: ["deploy", d.name, "--host", "sim"], 0),
            ("sleep swap", swap(c2, c, "--sleep-old", "--port", str(c2.serving.port)), 0),
            ("sleep swap back (wake)", swap(c, c2, "--sleep-old"), 0),
            ("sleep swap (wake)", swap(c2, c, "--sleep-old"), 0),
            ("sleep swap back (wake)", swap(c, c2, "--sleep-old"), 0),
        ]
        stop = threading.Event()
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(run_load(url, GW_KEY, args.concurrency, None, stop)))
        t.start()
        time.sleep(2)
        windows = []
        bad_ops = 0
        for label, argv, want in ops:
            words = argv()
            t0 = time.monotonic()
            r = cli(*words)
            t1 = time.monotonic()
            windows.append((label, t0, t1))
            (tmp / f"op{len(windows):02d}.log").write_text(r.stdout + r.stderr)
            ok = (r.returncode == 0) == (want == 0)
            warned = [line.strip() for line in r.stdout.splitlines() if "the gateway could not" in line]
            if warned:                  # its gateway step failed (the operation itself goes on)
                ok = False
                print(f"{label}: {warned[0][:300]}")
            if not ok:
                bad_ops += 1
                print(f"{label}: exit {r.returncode}, expected {'0' if want == 0 else 'non-zero'}\n"
                      f"{(r.stdout + r.stderr)[-1500:]}")
            print(f"  {label:26s} {' '.join(words)}: exit {r.returncode} in {t1 - t0:.1f} s", flush=True)
        time.sleep(2)
        stop.set()
        t.join(180)
        reqs = result["requests"]
        total = outcomes(reqs)
        failed = sum(v for k, v in total.items() if k != "whole")
        waits = [w for _, o, w, _ in reqs if o == "whole"]
        print(f"\n10 operations under C={args.concurrency} streams of {MODEL}: {len(reqs)} requests, outcomes {total}, "
              f"failed {failed}; wait p50 {pct(waits, .5):.2f} s p99 {pct(waits, .99):.2f} s max {max(waits):.2f} s")
        print(f"  {'operation (and until the next)':32s} {'took':>6s} {'requests':>9s} {'failed':>7s} {'wait p50':>9s} "
              f"{'p99':>7s} {'max':>7s}")
        for i, (label, t0, t1) in enumerate(windows):
            until = windows[i + 1][1] if i + 1 < len(windows) else float("inf")
            inside = [q for q in reqs if t0 <= q[0] < until]          # ended while it ran, or before the next
            w = [q[2] for q in inside if q[1] == "whole"]
            print(f"  {label:32s} {t1 - t0:5.1f}s {len(inside):9d} {sum(q[1] != 'whole' for q in inside):7d} "
                  f"{pct(w, .5):8.2f}s {pct(w, .99):6.2f}s {max(w, default=float('nan')):6.2f}s")
        print(f"each operation's output: {tmp}/opNN.log")
        cli("gateway", "down", "--host", "sim")
        return 0 if failed == 0 and bad_ops == 0 else 1
    finally:
        manager.down(home)
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
