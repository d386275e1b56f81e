"""A 2-node deploy against a 1-node deploy of the same model on the simulator, and how fast a rank
crash fails a 2-node deploy. Prints figures (targets: <= 2 s extra orchestration; <= 3 s from the
crash to the deploy failing with the node named).

    python benchmarks/bench_multinode.py [--runs 3] [--speed 2000]

Two SIMULATED process hosts (sim, sim-2) in a scratch state home. The models: kimi-k25-int4 (TP8 on
one host) and kimi-k25-int4-2node (TP8 x PP2 on sim + sim-2), both already downloaded before the
timed runs (a deploy after a stop: the weights are there, the plan still verifies them). What a
deploy spends that is vLLM's own (the ready step: its load and the gates) differs with the layout
(each node loads half the weights), and kimi-k25-int4 states a throughput the perf step measures for
a few seconds (the 2-node manifest states none), so the orchestration is the rest: total - ready -
perf - download.

The crash: `sim fault sim-2 rank-crash-loading` (a rank on the worker dies loading its weights, as a
CUDA illegal memory access); measured from the moment the simulated rank fires it (the simulator's
faults-fired.jsonl) to the moment the deploy's ready step fails naming sim-2, and to the end of the
deploy (its recovery stopped both nodes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--speed", type=float, default=2000.0)
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-multinode-"))
    os.environ["VLLM_ORCH_STATE_HOME"] = str(scratch / "state")

    from orchestrator.config.inventory import HostEntry
    from orchestrator.config.manifest import load_all
    from orchestrator.host.local import LocalHost
    from orchestrator.ops.deploy import run_deploy
    from orchestrator.ops.execute import Reporter
    from orchestrator.ops.stop import stop_model
    from orchestrator.paths import shipped_dir
    from orchestrator.plan.run import Options
    from orchestrator.sim import manager
    from orchestrator.sim.fault_file import add_fault

    models, _ = load_all(shipped_dir("models"))
    one, two = models["kimi-k25-int4"], models["kimi-k25-int4-2node"]
    home = manager.sim_home()
    manager.up(2, speed=args.speed, home=home)
    inv = manager.inventory_hosts(home)
    sim, sim2 = (HostEntry.model_validate({**inv[n], "name": n}) for n in ("sim", "sim-2"))
    opts = Options()                                     # the CLI's defaults (poll every 0.5 s)

    class Clock(Reporter):
        """Quiet, but notes when each step ended (wall clock)."""

        def __init__(self):
            super().__init__(None, quiet=True)
            self.ended: dict[str, float] = {}

        def step_end(self, res):
            self.ended[res.step] = time.time()
            super().step_end(res)

    def stop_all(name: str, entries) -> None:
        for e in entries:
            stop_model(LocalHost(e.name, env=e.env), e, name, release_timeout=30)

    def deploy_one():
        return run_deploy(sim, one, opts, Clock(), False)

    def deploy_two(reporter=None):
        return run_deploy([sim, sim2], two, opts, reporter or Clock(), False)

    def parts(result) -> tuple[float, float, float]:
        """(total, vLLM's own time: the ready step and the throughput measurement, orchestration)."""
        steps = result.outcome.timings()
        served = sum(v for k, v in steps.items() if k.split("[")[0] in ("ready", "perf"))
        download = steps.get("download", 0.0)
        return result.seconds, served, result.seconds - served - download

    try:
        for deploy, name, entries in ((deploy_one, one.name, [sim]), (deploy_two, two.name, [sim, sim2])):
            first = deploy()                             # downloads; not timed
            assert first.ok, first.error
            stop_all(name, entries)
        figures: dict[str, list[tuple[float, float, float]]] = {"1 node ": [], "2 nodes": []}
        for _ in range(args.runs):
            for label, deploy, name, entries in (("1 node ", deploy_one, one.name, [sim]),
                                                 ("2 nodes", deploy_two, two.name, [sim, sim2])):
                res = deploy()
                assert res.ok, res.error
                figures[label].append(parts(res))
                stop_all(name, entries)
        print(f"deploy after a stop (weights present), median of {args.runs}, simulator speed {args.speed:g}:")
        med = {}
        for label, rows in figures.items():
            total, ready, orch = (statistics.median(col) for col in zip(*rows, strict=True))
            med[label] = orch
            print(f"  {label}: total {total:5.2f} s, vLLM's own (ready: load + gates; perf) {ready:5.2f} s, "
                  f"orchestration {orch:5.2f} s  (runs: {', '.join(f'{t:.2f}' for t, _, _ in rows)})")
        print(f"  extra orchestration of 2 nodes over 1: {med['2 nodes'] - med['1 node ']:+.2f} s (target <= 2 s)")

        crash, done = [], []
        fired_log = manager.host_dir("sim-2", home) / "logs" / "faults-fired.jsonl"
        for _ in range(args.runs):
            add_fault(manager.host_dir("sim-2", home), "rank-crash-loading")
            before = len(fired_log.read_text().splitlines()) if fired_log.exists() else 0
            clock = Clock()
            res = deploy_two(clock)
            ended = time.time()
            assert not res.ok and res.error is not None and res.error.host == "sim-2", res.error
            fired = [json.loads(line) for line in fired_log.read_text().splitlines()[before:]]
            at = min(f["at"] for f in fired if f["fault"] == "rank-crash-loading")
            crash.append(clock.ended["ready[sim]"] - at)
            done.append(ended - at)
            stop_all(two.name, [sim, sim2])
        print(f"rank crash on sim-2 while loading -> ready step failed naming sim-2: median "
              f"{statistics.median(crash):.2f} s, max {max(crash):.2f} s (target <= 3 s); -> deploy over "
              f"(both nodes stopped): median {statistics.median(done):.2f} s")
        print(f"  error: {res.error}")
    finally:
        manager.down(home)


if __name__ == "__main__":
    main()
