"""Cooperative cancellation (orchestrator/host/cancel.py): an interrupt stops a run at its next
check (between steps, in a wait, in a host command), its recovery runs, a second interrupt abandons
the recovery; a fleet's hosts each stop by themselves; nothing is raised into a thread from outside
(no PyThreadState_SetAsyncExc anywhere in the product)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from orchestrator.config.inventory import HostEntry
from orchestrator.errors import Interrupted
from orchestrator.host import cancel
from orchestrator.host.local import LocalHost
from orchestrator.ops.execute import Reporter, run_plan
from orchestrator.ops.fleet import HostOutcome, run_fleet
from orchestrator.plan.model import Action, Plan
from orchestrator.plan.run import Options, RunEnv

PRODUCT = Path(__file__).parents[2] / "orchestrator"


def later(seconds: float, fn) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(seconds), fn()), daemon=True)
    t.start()
    return t


def test_no_async_exceptions_in_the_product():
    offenders = [p for p in PRODUCT.rglob("*.py") if "SetAsyncExc" in p.read_text()]
    assert offenders == []


def test_a_wait_and_a_local_command_end_at_once_when_cancelled():
    with cancel.cancellation() as token:
        later(0.3, token.cancel)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            cancel.sleep(30)
        assert time.monotonic() - t0 < 10
    with cancel.cancellation() as token:
        host = LocalHost("h")
        later(0.3, token.cancel)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            host.run(["sleep", "30"], timeout=60)       # the command is killed, not waited for
        assert time.monotonic() - t0 < 10
        with pytest.raises(KeyboardInterrupt):
            host.stream(["sh", "-c", "echo one; sleep 30"], on_line=lambda line: None)
    assert cancel.current() is None
    assert LocalHost("h").run(["true"]).ok                 # outside an operation nothing is cancelled


def test_the_executor_runs_the_recovery_of_the_interrupted_step_and_a_second_interrupt_abandons_it():
    ran: list[str] = []

    def step(name: str, wait: float = 0.0):
        def run(env):
            ran.append(name)
            if wait:
                cancel.sleep(wait)
            return name
        return Action(name, name, run=run)

    def plan(recovery_wait: float) -> Plan:
        p = Plan("t", "h", "m")
        first = p.add(step("start"))
        p.add(step("ready", wait=30))
        p.add(step("record"))
        p.recover(first, "roll back", [step("stop"), step("start old", wait=recovery_wait), step("ready old")])
        return p

    env = RunEnv(LocalHost("h"), HostEntry(name="h", address="h"), Options())
    with cancel.cancellation() as token:
        later(0.3, token.cancel)
        out = run_plan(plan(0), env, Reporter(None, quiet=True))
        cancel.check()                  # answered: what the operation does after its plan (records) still runs
    assert isinstance(out.error, Interrupted) and out.recovery is not None and out.recovery.ok
    assert ran == ["start", "ready", "stop", "start old", "ready old"]      # not record; the rollback ran whole
    ran.clear()
    with cancel.cancellation() as token:
        later(0.3, token.cancel)
        later(0.8, token.cancel)                         # again, during the rollback's long step
        out = run_plan(plan(30), env, Reporter(None, quiet=True))
    assert out.recovery is not None and not out.recovery.ok and "abandoned" in str(out.recovery.error)
    assert ran == ["start", "ready", "stop", "start old"]


def test_one_hosts_recovery_does_not_answer_the_interrupt_for_the_others():
    """A fleet's hosts share its token; each answers it for itself: a host that is already in its
    recovery does not let another host's next step run."""
    order: list[str] = []
    in_recovery = threading.Event()

    def one(entry, _reporter):
        try:
            while True:
                cancel.sleep(0.01)
        except KeyboardInterrupt:
            if entry.name == "h1":
                cancel.current().tolerate()          # h1's recovery starts at once...
                in_recovery.set()
                cancel.sleep(0.3)                    # ...and runs while h2 still checks
                order.append("h1 recovered")
            else:
                in_recovery.wait(5)
                with pytest.raises(KeyboardInterrupt):
                    cancel.check()                   # h2 has not answered it: its next step stops too
                order.append("h2 stopped")
            return HostOutcome(130, "interrupted")

    with cancel.cancellation() as token:
        later(0.3, token.cancel)
        rows = run_fleet([HostEntry(name=f"h{i}", address="x") for i in (1, 2)], one, parallel=2)
    assert sorted(order) == ["h1 recovered", "h2 stopped"] and [r.code for r in rows] == [130, 130]


def test_main_in_process_puts_the_callers_signal_handlers_back():
    """main() installs its cancelling handlers for the command's run only: called in-process (a test,
    a wrapper), it leaves the caller's handlers as they were, even when the command fails."""
    import signal

    import pytest

    from orchestrator.cli.main import main

    def mine(signum, frame):
        pass

    saved = {sig: signal.signal(sig, mine) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for argv in (["--help"], ["no-such-command"]):
            with pytest.raises(SystemExit):
                main(argv)
            assert all(signal.getsignal(sig) is mine for sig in saved), argv
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
