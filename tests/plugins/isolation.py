"""What one test may not leave behind in its pytest process, because every later test of the same
worker inherits it: a signal's disposition. An ignored SIGTERM survives exec, so every process a
later test starts ignored it too: a `sleep` stopped with SIGTERM then ran out its 30 s wait before
the SIGKILL (tests/integration/test_unit_probe.py called the probe's `restart` in-process, which
ignores SIGTERM for its own lifetime; one unrelated test of the same worker took 65 s instead of 5).

A test that leaves one changed fails at its teardown, naming the signal; the disposition is put back
first, so the tests after it run as they would alone."""

from __future__ import annotations

import signal

import pytest

WATCHED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE, signal.SIGCHLD, signal.SIGUSR1,
           signal.SIGUSR2, signal.SIGALRM)


@pytest.fixture(autouse=True)
def _signals_left_as_found():
    before = {sig: signal.getsignal(sig) for sig in WATCHED}
    yield
    changed = [sig for sig in WATCHED if signal.getsignal(sig) is not before[sig]]
    for sig in changed:
        signal.signal(sig, before[sig])
    if changed:
        pytest.fail("the test left these signals' handling changed in the pytest process (every later "
                    "test's subprocesses would inherit an ignored one): "
                    + ", ".join(signal.Signals(s).name for s in changed), pytrace=False)
