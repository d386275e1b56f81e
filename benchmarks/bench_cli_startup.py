"""How fast `vllm-orch --help` and `vllm-orch models` answer (target: under 0.3 s). Prints figures.

  python benchmarks/bench_cli_startup.py [--runs 10]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def timed(args: list[str], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    runs = ap.parse_args().runs
    for args in (["--help"], ["models"], ["validate"]):
        t = timed(args, runs)
        print(f"vllm-orch {' '.join(args):<10} median {statistics.median(t) * 1000:5.0f} ms, "
              f"max {max(t) * 1000:5.0f} ms over {runs} runs")
    heavy = subprocess.run([sys.executable, "-X", "importtime", "-m", "orchestrator.cli.main", "models"],
                           capture_output=True, text=True).stderr
    loaded = [m for m in ("paramiko", "huggingface_hub", "matplotlib", "psutil", "jinja2") if f" {m}\n" in heavy
              or f"| {m}" in heavy]
    print(f"heavy modules imported by `vllm-orch models`: {', '.join(loaded) or 'none'}")


if __name__ == "__main__":
    main()
