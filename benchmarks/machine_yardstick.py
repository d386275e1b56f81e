"""How fast this machine's CPU is, for comparing the suite's figures across machines. Prints figures.

The suite is CPU-bound on 2 cores (docs/figures.md, "Test suite"), so its wall time moves with the
speed of the machine as much as with the code. Two sessions' machines of the same "2-core" kind
differed by about 2x. Run this beside a suite run and quote it with the run's figures, so that a
later run on another machine can tell a change of code from a change of machine.

Each figure is CPU seconds (user + system) of a fresh child process, median of `--runs`; CPU time,
not wall time, so another process on the machine moves it little.

  python benchmarks/machine_yardstick.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

CASES = {
    "a Python loop (sum of 10^7 squares)": "sum(i * i for i in range(10**7))",
    "Python's start alone": "pass",
    "importing huggingface_hub's HfApi (the download script's start)": "from huggingface_hub import HfApi",
    "importing vllm-orch's CLI": "import orchestrator.cli.main",
}


def cpu_of(code: str) -> float:
    before = os.times()
    subprocess.run([sys.executable, "-c", code], check=True)
    after = os.times()
    return (after.children_user - before.children_user) + (after.children_system - before.children_system)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    runs = ap.parse_args().runs
    print(f"{os.cpu_count()} CPUs; {runs} runs each; CPU seconds of a fresh process, median (min-max)")
    for label, code in CASES.items():
        cpu = [cpu_of(code) for _ in range(runs)]
        print(f"  {statistics.median(cpu):6.3f} s  ({min(cpu):.3f}-{max(cpu):.3f})  {label}")


if __name__ == "__main__":
    main()
