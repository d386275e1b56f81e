"""The state-machine test's shorter run against a SIMULATED host (the fake-host run is
tests/unit/test_state_machine.py): random deploy, swap, stop, regen and gc of minimax-m25 as two
services (its own and mm-b) on random GPUs and ports, with a readiness failure now and then (the
simulator's crash-gpu-memory fault), through the product's operations (ops/*.py) as the CLI runs
them. After every step the host itself is asked (its facts: nvidia-smi's processes and whose they
are, the services' states, the records) whether:
  - no two running services share a GPU (by their processes) or a port;
  - every running service has a record, every record an installed unit, and a running service's
    record names the GPUs its processes are on;
  - a refused command changed nothing;
  - a failed swap left the old or the new service serving.
Figures (runs, steps, seconds) are printed with -s.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from orchestrator.config.placement import Request
from orchestrator.errors import ConfigError, RefusedError
from orchestrator.host.facts import gather
from orchestrator.host.ownership import SERVICE
from orchestrator.ops.execute import Reporter
from orchestrator.ops.regen import run_regen
from orchestrator.ops.stop import gc_plan, run_gc, stop_model
from orchestrator.plan.inputs import LockFacts
from orchestrator.sim import manager

from .deployhelp import deploy, entry, free_port, opts, swap, tuned

MM = "minimax-m25"
STATS = {"runs": 0, "steps": 0, "ok": 0}


def make_machine(sim_host):
    e = entry(sim_host)
    ports = [free_port(), free_port(), free_port()]
    m = tuned(MM, ports[0], startup={"budget_seconds": 60})
    manifests = {MM: m}

    class SimOperations(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            STATS["runs"] += 1

        def snapshot(self) -> tuple:
            f = gather(sim_host.host, e)
            return (sorted(f.running()), {n: r.dump() for n, r in f.records.items()},
                    {n: r.dump() for n, r in f.installed.items()})

        def arm(self, fault: str | None) -> None:
            if fault:
                manager.add_fault("sim", fault, home=sim_host.home)

        def disarm(self) -> None:
            from orchestrator.sim.fault_file import clear_faults

            clear_faults(manager.host_dir("sim", sim_host.home))

        def refused_changes_nothing(self, before: tuple, result_or_error) -> None:
            err = result_or_error if isinstance(result_or_error, Exception) else result_or_error.error
            if isinstance(err, (ConfigError, RefusedError)):
                assert self.snapshot() == before, f"a refused command changed the host: {err}"

        @rule(name=st.sampled_from([MM, "mm-b"]), gpus=st.sampled_from([None, "0-3", "4-7"]),
              port=st.sampled_from([None, 1, 2]), fault=st.sampled_from([None, None, "crash-gpu-memory"]))
        def deploy(self, name, gpus, port, fault) -> None:
            STATS["steps"] += 1
            before = self.snapshot()
            self.arm(fault)
            try:
                res = deploy(e, m, request=Request.parse(m, name if name != MM else None, gpus,
                                                         ports[port] if port else None))
            except (ConfigError, RefusedError) as exc:
                res = exc
            self.disarm()
            self.refused_changes_nothing(before, res)
            STATS["ok"] += not isinstance(res, Exception) and res.ok

        @rule(name=st.sampled_from([MM, "mm-b"]), replace=st.sampled_from([None, MM, "mm-b"]),
              fault=st.sampled_from([None, "crash-gpu-memory"]))
        def swap(self, name, replace, fault) -> None:
            STATS["steps"] += 1
            before = self.snapshot()
            old = replace if replace is not None else (before[0][0] if len(before[0]) == 1 else None)
            self.arm(fault)
            try:
                res = swap(e, m, manifests, request=Request(name if name != MM else None), replace=replace)
            except (ConfigError, RefusedError) as exc:
                res = exc
            self.disarm()
            self.refused_changes_nothing(before, res)
            STATS["ok"] += not isinstance(res, Exception) and res.ok
            if old is not None and old != name and old in before[0]:
                running = gather(sim_host.host, e).running()
                assert old in running or name in running, f"after a swap from {old} to {name} neither serves"

        @rule(name=st.sampled_from([MM, "mm-b"]))
        def stop(self, name) -> None:
            STATS["steps"] += 1
            try:
                stop_model(sim_host.host, e, name, release_timeout=30, poll=0.1)
            except RefusedError:
                pass                                 # not installed

        @rule(restart=st.booleans())
        def regen(self, restart) -> None:
            STATS["steps"] += 1
            before = self.snapshot()
            res = run_regen(e, manifests, opts(), Reporter(None, quiet=True), dry_run=False, restart=restart)
            self.refused_changes_nothing(before, res)

        @rule()
        def gc(self) -> None:
            STATS["steps"] += 1
            run_gc(sim_host.host, e, gc_plan(sim_host.host, e, LockFacts(held=True)))

        @invariant()
        def the_host_agrees(self) -> None:
            f = gather(sim_host.host, e)
            owners: dict[int, set[str]] = {}
            for p in f.procs:
                if p.kind == SERVICE and p.gpu_index is not None and p.model:
                    owners.setdefault(p.gpu_index, set()).add(p.model)
            assert all(len(o) == 1 for o in owners.values()), f"services share a GPU: {owners}"
            running = set(f.running())
            ports = [r.port for n, r in f.records.items() if n in running]
            assert len(ports) == len(set(ports)), f"running services share a port: {ports}"
            if f.half_swap is not None:
                return
            for name in running:
                rec = f.record(name)
                assert rec is not None, f"{name} runs without a record"
                on = sorted(g for g, o in owners.items() if name in o)
                assert not on or on == sorted(rec.gpus), f"{name}'s record says GPUs {rec.gpus}, it runs on {on}"
            for name in f.records:
                assert name in f.installed, f"{name} is recorded, not installed"

        def teardown(self) -> None:
            for name in sorted(gather(sim_host.host, e).installed):
                stop_model(sim_host.host, e, name, release_timeout=30, poll=0.1)

    return SimOperations


@pytest.mark.long
def test_random_operations_on_a_simulated_host_keep_the_invariants(sim_host):
    t0 = time.monotonic()
    run_state_machine_as_test(make_machine(sim_host), settings=settings(
        max_examples=5, stateful_step_count=10, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck)))
    print(f"\nstate machine (simulated host): {STATS['runs']} runs, {STATS['steps']} steps ({STATS['ok']} deploys "
          f"and swaps that served), {time.monotonic() - t0:.1f} s")
    assert STATS["ok"] >= 3                     # the run did real work, not only refusals


pytestmark = pytest.mark.timeout(600)
