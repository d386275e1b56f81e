"""The Host interface every step talks to. Commands are printable data: argv lists, never
strings glued with spaces; a Secret inside an argv prints as *** and is revealed only at exec time.

    host.run(["df", "-B1", "/models"], timeout=10) -> Result(exit_code, stdout, stderr, duration)
    host.run(Script("set -e; ..."))                  -> runs through `sh -c`
    host.stream(argv, on_line=cb)                    -> like run, calls cb for each stdout line as it comes
    host.put(path, data, mode) / host.get(path)      -> write / read a file (get: None when missing)
    host.connect_tcp(port)                           -> a socket-like object connected to 127.0.0.1:port
                                                        *on the host* (a tunnel over SSH for SshHost)
"""

from __future__ import annotations

import posixpath
import shlex
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from orchestrator.errors import CommandFailed
from orchestrator.secret import Secret, reveal

PUT_CHUNK = 1 << 20          # put_file's block: what a streamed upload holds in memory at a time


def blocks(source: bytes | BinaryIO | None):
    """What goes to a command's stdin, block by block: bytes as they are, a binary file read in
    PUT_CHUNK blocks (never whole: see Host.put_file)."""
    if source is None:
        return
    if isinstance(source, (bytes, bytearray)):
        if source:
            yield source
        return
    while block := source.read(PUT_CHUNK):
        yield block


@dataclass(frozen=True)
class Script:
    """Shell text run with `sh -c` (use for pipelines; quote every value with shlex.quote)."""

    text: str
    display: str | None = None      # what plans show instead of text (e.g. for embedded scripts)

    def __str__(self) -> str:
        return self.display or self.text


Arg = str | Secret
Command = Sequence[Arg] | Script


def printable(cmd: Command) -> str:
    """The command as a user reads it in a plan: shell-quoted, secrets as ***."""
    if isinstance(cmd, Script):
        return cmd.display or cmd.text
    return " ".join("***" if isinstance(a, Secret) else shlex.quote(str(a)) for a in cmd)


def shell_text(cmd: Command) -> str:
    """The command as a shell must receive it (secrets revealed). Never print this."""
    if isinstance(cmd, Script):
        return cmd.text
    return " ".join(shlex.quote(reveal(a)) for a in cmd)


@dataclass
class Result:
    cmd: str                      # printable form
    exit_code: int
    stdout: str = ""
    stderr: str = ""
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def check(self, host: str = "", what: str = "") -> Result:
        if not self.ok:
            tail = (self.stderr or self.stdout).strip().splitlines()[-5:]
            raise CommandFailed(
                f"{what or self.cmd} exited {self.exit_code}" + (f": {tail[-1]}" if tail else ""),
                host=host or None, details=tail)
        return self


class Spawned(ABC):
    """A running command started by Host.spawn."""

    @abstractmethod
    def readline(self, timeout: float) -> str | None:
        """The next stdout line (without newline), or None at EOF or after timeout seconds."""

    @abstractmethod
    def close(self) -> None:
        """Close stdin and release the command (it exits on EOF)."""

    @abstractmethod
    def alive(self) -> bool:
        """The command still runs and its stdin is still ours (False once the connection dropped)."""

    @abstractmethod
    def ping(self) -> None:
        """Send one newline on its stdin (a heartbeat); raises OSError when that is impossible."""


@dataclass
class HostStats:
    round_trips: int = 0          # commands run + files moved + tunnels opened
    seconds: float = 0.0
    # status probes a service from two threads over one connection: counts must not be lost
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)


class Host(ABC):
    """A machine we run commands on. Implementations: LocalHost, SshHost."""

    name: str
    sudo: bool = False
    env: Mapping[str, str]
    # Connections opened so far (SshHost: 1 per run, one more after each drop; LocalHost: 0). A
    # rise across a wait says the connection dropped meanwhile, even when no command failed.
    connects: int = 0

    def __init__(self, name: str, *, sudo: bool = False, env: Mapping[str, str] | None = None):
        self.name = name
        self.sudo = sudo
        self.env = dict(env or {})
        self.stats = HostStats()

    # -- the interface -------------------------------------------------------------------------
    @abstractmethod
    def run(self, cmd: Command, *, timeout: float = 60.0, input: bytes | BinaryIO | None = None,
            env: Mapping[str, str] | None = None, sudo: bool | None = None) -> Result:
        """Run to the end; `input` (bytes, or a binary file read in blocks) is written to stdin."""

    @abstractmethod
    def stream(self, cmd: Command, *, on_line: Callable[[str], None], timeout: float = 3600.0,
               input: bytes | None = None, env: Mapping[str, str] | None = None,
               sudo: bool | None = None) -> Result:
        """Run, calling on_line(line) for each stdout line as it arrives. stderr is collected;
        `input` is written to stdin, which is then closed."""

    @abstractmethod
    def put(self, path: str, data: bytes, mode: int = 0o644) -> None: ...

    def put_file(self, path: str, local: Path, mode: int = 0o644) -> None:
        """put() of a local file's content, for files too big to hold in memory (an engine's wheels
        are GBs): LocalHost and SshHost stream it in PUT_CHUNK blocks, atomically as put() does."""
        self.put(path, local.read_bytes(), mode)

    @abstractmethod
    def get(self, path: str) -> bytes | None: ...

    @abstractmethod
    def connect_tcp(self, port: int, address: str = "127.0.0.1", timeout: float = 5.0):
        """A connected socket-like object (sendall/recv/makefile/settimeout/close)."""

    def spawn(self, cmd: Command, *, env: Mapping[str, str] | None = None,
              sudo: bool | None = None) -> Spawned:
        """Start a long-lived command whose stdin stays open until Spawned.close(): when this
        process dies (or the SSH connection drops) the command sees EOF. Used for the host lock."""
        raise NotImplementedError(f"{type(self).__name__} cannot spawn processes")

    def close(self) -> None:  # noqa: B027 - closing is optional: LocalHost holds nothing open
        """Release the connection (SshHost); a no-op where there is none."""

    # -- helpers shared by implementations -------------------------------------------------------
    def wrap(self, cmd: Command, env: Mapping[str, str] | None, sudo: bool | None) -> str:
        """The full shell text for cmd: env assignments, optional sudo, then the command."""
        merged = {**self.env, **(env or {})}
        text = shell_text(cmd)
        if isinstance(cmd, Script):
            text = "sh -c " + shlex.quote(text)
        if merged:
            text = "env " + " ".join(shlex.quote(f"{k}={v}") for k, v in merged.items()) + " " + text
        if self.sudo if sudo is None else sudo:
            text = "sudo -n " + text
        return text

    def put_command(self, path: str, mode: int, owner: str | None = None) -> Script:
        """Shell text that writes its stdin to `path` atomically, readable by nobody else until it is
        complete: a mktemp file (0600 from its first byte) beside the target, chmod, rename. Nothing
        is staged elsewhere (a /tmp copy would be a second place for a secret to leak from).
        `owner`: when root writes it, the file is given to that user (`chown -h`: never through a
        link) before it is moved in place."""
        q = shlex.quote
        folder, name = posixpath.split(path)
        folder = folder or "."
        chown = f"{{ [ \"$(id -u)\" != 0 ] || chown -h {q(owner)} \"$t\"; }} && " if owner else ""
        return Script(
            f"mkdir -p {q(folder)} && umask 077 && t=$(mktemp {q(folder)}/.{q(name)}.XXXXXXXX) || exit 1; "
            f"if cat > \"$t\" && chmod {mode:o} \"$t\" && {chown}mv -f \"$t\" {q(path)}; then exit 0; fi; "
            f"rc=$?; rm -f \"$t\"; exit $rc",
            display=f"install -m {mode:04o}{f' -o {owner}' if owner else ''} <data> {q(path)}")

    def _count(self, started: float) -> None:
        with self.stats.lock:
            self.stats.round_trips += 1
            self.stats.seconds += time.monotonic() - started

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
