"""One error tree. The CLI is the only place that catches these; each carries a user-facing message.

Exit codes (documented in docs/user-guide.md):
  0 ok, 1 failed, 2 bad input, 3 refused by a safety check, 130 interrupted.
"""

from __future__ import annotations


class OrchestratorError(Exception):
    """Base: `str(err)` is the one line shown to the user; `hint` is what to do about it."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None, host: str | None = None,
                 step: str | None = None, details: list[str] | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.host = host
        self.step = step
        self.details = details or []   # extra lines (e.g. the last log lines of a failed start)

    def __str__(self) -> str:
        where = ": ".join(p for p in (self.host, self.step) if p)
        return f"{where}: {self.message}" if where else self.message


class ConfigError(OrchestratorError):
    """A manifest, inventory or command-line value is wrong. Nothing was changed."""

    exit_code = 2


class RefusedError(OrchestratorError):
    """A safety check refused to go on (disk, GPUs, lock, host key...). Nothing unsafe was done."""

    exit_code = 3


class ConnectError(OrchestratorError):
    """A host could not be reached or authenticated."""

    exit_code = 1


class CommandFailed(OrchestratorError):
    """A command on a host exited non-zero where success was required."""

    exit_code = 1


class DeployFailed(OrchestratorError):
    """A step of a plan failed (start-up crash, gate timeout, download error...)."""

    exit_code = 1


class Interrupted(OrchestratorError):
    """Ctrl-C, SIGTERM or SIGHUP stopped an operation part-way; the plan's recovery branch for the
    step it stopped in ran (or was abandoned by a second interrupt)."""

    exit_code = 130
