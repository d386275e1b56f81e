"""Cooperative cancellation: Ctrl-C, SIGTERM and SIGHUP during an operation set a token that the
operation checks between steps and inside every wait (readiness, GPU release, a service's start,
a download or warm-up streaming its progress); a command running on a host is ended by its own
connection (a local process is killed; an SSH command's process group is killed and its channel
closed). Nothing is raised into a thread from outside: each host's run stops at a point of its
own choosing, as a KeyboardInterrupt, which the executor turns into a failure of the running step
(its recovery branch runs: a swap's rollback). No exception is ever raised into another thread.

The token is process-wide, as signals are: `cancellation()` makes one current for an operation
(one, or one per host of a fleet run: they share it, so an interrupt reaches every host), and the
CLI's signal handler cancels it (`request`). A first cancel stops the operation; once its
recovery has started (`tolerate`), only a further cancel stops the recovery too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class CancelToken:
    def __init__(self) -> None:
        # re-entrant: the signal handler that cancels runs in the main thread, which may hold it
        self._cond = threading.Condition(threading.RLock())
        self._count = 0                          # cancels so far
        # cancels already answered, per thread: a run's recovery runs anyway (each host of a fleet
        # runs in its own thread and answers for itself)
        self._answered = threading.local()
        self._hooks: list[Callable[[], None]] = []

    def cancel(self) -> None:
        """Ask the operation to stop; what it waits on that cannot check (a command on a host) is
        ended by its hook."""
        with self._cond:
            self._count += 1
            hooks = list(self._hooks)
            self._cond.notify_all()
        for hook in hooks:
            try:
                hook()
            except Exception:       # a hook ends a command that may have ended already
                pass

    @property
    def requested(self) -> bool:
        """A cancel that this thread's run has not answered yet."""
        return self._count > getattr(self._answered, "count", 0)

    @property
    def count(self) -> int:
        return self._count

    def check(self) -> None:
        """Raise KeyboardInterrupt when a cancel is requested (a point where stopping is safe)."""
        if self.requested:
            raise KeyboardInterrupt

    def sleep(self, seconds: float) -> None:
        """time.sleep that ends early, raising KeyboardInterrupt, when a cancel is requested."""
        with self._cond:
            self._cond.wait_for(lambda: self.requested, timeout=max(seconds, 0.0))
        self.check()

    def tolerate(self) -> None:
        """The cancels so far are answered in this thread (its run's recovery runs): only a further
        one stops it."""
        with self._cond:
            self._answered.count = self._count

    @contextmanager
    def on_cancel(self, hook: Callable[[], None]) -> Iterator[None]:
        """While the block runs, a cancel also calls hook (it ends what the block waits on)."""
        with self._cond:
            self._hooks.append(hook)
            pending = self.requested
        try:
            if pending:
                hook()
            yield
        finally:
            with self._cond:
                self._hooks.remove(hook)


_current: list[CancelToken] = []
_lock = threading.RLock()            # re-entrant for the signal handler (see CancelToken._cond)


def current() -> CancelToken | None:
    """The running operation's token (None: no operation is running)."""
    with _lock:
        return _current[-1] if _current else None


@contextmanager
def cancellation() -> Iterator[CancelToken]:
    """The token of an operation: the current one when an outer operation runs (a fleet's hosts
    share the fleet's), else a new one, current until the operation ends."""
    outer = current()
    if outer is not None:
        yield outer
        return
    token = CancelToken()
    with _lock:
        _current.append(token)
    try:
        yield token
    finally:
        with _lock:
            _current.remove(token)


def request() -> bool:
    """Cancel the running operation (the CLI's SIGINT/SIGTERM/SIGHUP handler); False when none runs."""
    token = current()
    if token is None:
        return False
    token.cancel()
    return True


def check() -> None:
    token = current()
    if token is not None:
        token.check()


def sleep(seconds: float) -> None:
    """Wait `seconds`, ending early (KeyboardInterrupt) when the running operation is cancelled."""
    token = current()
    if token is None:
        import time

        time.sleep(seconds)
    else:
        token.sleep(seconds)


@contextmanager
def on_cancel(hook: Callable[[], None]) -> Iterator[None]:
    token = current()
    if token is None:
        yield
    else:
        with token.on_cancel(hook):
            yield
