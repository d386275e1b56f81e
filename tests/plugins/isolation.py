"""What one test may not leave behind in its pytest process, because every later test of the same
worker inherits it: a signal's disposition, the environment, the working directory, the umask
(monkeypatch's setenv and chdir are undone before this check runs).

An ignored SIGTERM survives exec, so every process a later test started ignored it too:
tests/integration/test_unit_probe.py ran the probe's `restart` in-process (it ignores SIGTERM for
the rest of its own process, as it should on a host), and an unrelated test of the same worker took
65 s instead of 5.5 s, each of its two `sleep`s running out a 30 s wait for SIGTERM before the SIGKILL.

A test that leaves one changed fails at its teardown, naming what; it is put back first, so the
tests after it run as they would alone."""

from __future__ import annotations

import os
import signal

import pytest

# Not SIGALRM: pytest-timeout owns it (its guard's handler, reset to the default when a test fails).
WATCHED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE, signal.SIGCHLD, signal.SIGUSR1,
           signal.SIGUSR2)


def _environ() -> dict[str, str]:
    """The environment but pytest's own PYTEST_CURRENT_TEST (it names the phase running)."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


@pytest.fixture(autouse=True)
def _process_left_as_found():
    signals = {sig: signal.getsignal(sig) for sig in WATCHED}
    environ, cwd = _environ(), os.getcwd()
    mask = os.umask(0o022)
    os.umask(mask)
    yield
    left = []
    for sig in WATCHED:
        if signal.getsignal(sig) is not signals[sig]:
            signal.signal(sig, signals[sig])
            left.append(f"{signal.Signals(sig).name}'s handling")
    now = _environ()
    if now != environ:
        names = sorted(k for k in now.keys() | environ.keys() if now.get(k) != environ.get(k))
        for k in names:
            if k in environ:
                os.environ[k] = environ[k]
            else:
                del os.environ[k]
        left.append("the environment (" + ", ".join(names) + ")")
    if os.getcwd() != cwd:
        os.chdir(cwd)
        left.append("the working directory")
    if os.umask(mask) != mask:
        left.append("the umask")
    if left:
        pytest.fail("the test left changed in the pytest process, where every later test (and its "
                    "subprocesses) would inherit it: " + "; ".join(left), pytrace=False)
