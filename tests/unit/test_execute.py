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


def test_an_action_naming_a_node_runs_with_that_nodes_env_after_that_nodes_guard():
    """A multi-node plan: `start[b]` runs with node b's env, after b's lock guard; a step over all
    nodes (node None) proves every node's lock first; a failure names the node it ran on."""
    guarded: list[str] = []
    seen: list[tuple[str, str]] = []

    def env_of(name: str) -> RunEnv:
        return RunEnv(None, HostEntry(name=name, address=f"{name}.example"), Options(),
                      guard=lambda: guarded.append(name) or None)

    nodes = {"a": env_of("a"), "b": env_of("b")}
    top = nodes["a"]
    top.nodes = nodes

    def on(step: str, node: str | None, fail: bool = False) -> Action:
        def run(env):
            seen.append((step, env.entry.name))
            if fail:
                raise CommandFailed("no such unit")
            return None
        return Action(step, step, run=run, node=node)

    plan = Plan("deploy", "a, b", "m")
    for a in (on("download", None), on("start", "b"), on("start", "a"), on("record", "b", fail=True)):
        plan.add(a)
    plan.recover(plan.actions[1], "stop on every node", [on("stop", "b"), on("stop", "a")])
    out = run_plan(plan, top, Reporter(None, quiet=True))
    assert seen == [("download", "a"), ("start", "b"), ("start", "a"), ("record", "b"), ("stop", "b"), ("stop", "a")]
    assert guarded == ["a", "b", "b", "a", "b", "b", "a"]
    assert out.error is not None and out.error.host == "b" and str(out.error).startswith("b: record:")
    assert [r.step for r in out.results] == ["download", "start[b]", "start[a]", "record[b]"]
    assert "start[b]" in plan.text() and " download  " in plan.text()
