"""The executor (orchestrator.ops.execute) with actions that fail, are interrupted, or are no-ops
whose bookkeeping fails: which recovery branch runs, what the outcome says."""

from __future__ import annotations

from orchestrator.config.inventory import HostEntry
from orchestrator.errors import CommandFailed, Interrupted
from orchestrator.ops.execute import Reporter, run_plan
from orchestrator.plan.model import Action, Plan
from orchestrator.plan.run import Options, RunEnv

ENTRY = HostEntry(name="h", address="h.example")


def plan_with(steps: list[Action], recovery: list[Action]) -> Plan:
    plan = Plan("swap", "h", "a -> b")
    for a in steps:
        plan.add(a)
    plan.recover(steps[1], "roll back", recovery)
    return plan


def act(name: str, ran: list[str], effect=None, noop: bool = False) -> Action:
    def run(env):
        ran.append(name)
        if effect is not None:
            raise effect
        return f"{name} done"
    return Action(name, name, run=run, noop=noop)


def run(plan: Plan):
    return run_plan(plan, RunEnv(None, ENTRY, Options()), Reporter(None, quiet=True))


def test_ctrl_c_in_a_step_runs_the_recovery_covering_it_and_ends_interrupted():
    ran: list[str] = []
    plan = plan_with([act("download", ran), act("stop", ran), act("ready", ran, KeyboardInterrupt()),
                      act("record", ran)], [act("rollback", ran)])
    out = run(plan)
    assert ran == ["download", "stop", "ready", "rollback"]
    assert isinstance(out.error, Interrupted) and out.error.exit_code == 130 and out.error.step == "ready"
    assert out.recovery is not None and out.recovery.ok
    assert [r.status for r in out.results] == ["done", "done", "failed", "not-run"]
    assert out.results[2].result == "interrupted"


def test_ctrl_c_before_the_recovered_range_runs_nothing_else():
    ran: list[str] = []
    plan = plan_with([act("download", ran, KeyboardInterrupt()), act("stop", ran)], [act("rollback", ran)])
    out = run(plan)
    assert ran == ["download"] and out.recovery is None and isinstance(out.error, Interrupted)


def test_a_second_ctrl_c_abandons_the_recovery():
    ran: list[str] = []
    plan = plan_with([act("download", ran), act("stop", ran), act("ready", ran, KeyboardInterrupt())],
                     [act("stop new", ran), act("start old", ran, KeyboardInterrupt()), act("ready old", ran)])
    out = run(plan)
    assert ran == ["download", "stop", "ready", "stop new", "start old"]
    assert not out.recovery.ok and "abandoned" in str(out.recovery.error)
    assert "roll back: FAILED" in out.error.details[-1]


def test_a_no_op_whose_bookkeeping_fails_fails_its_step():
    ran: list[str] = []
    plan = plan_with([act("download", ran), act("stop", ran),
                      act("start", ran, CommandFailed("journalctl exited 1"), noop=True)], [act("rollback", ran)])
    out = run(plan)
    assert ran == ["download", "stop", "start", "rollback"] and out.results[2].status == "failed"
    assert "journalctl exited 1" in str(out.error)
