"""SshHost: a remote machine over one paramiko connection, opened lazily and reused for the run.

Every operation is a channel on the same Transport, so several threads may run commands at once
(paramiko multiplexes channels; only the SFTP session is serialised by a lock). Commands are sent
as the same shell text LocalHost runs (`Host.wrap`), so a plan reads the same for both.
"""

from __future__ import annotations

import logging
import select
import shlex
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

import paramiko

from orchestrator.errors import ConnectError
from orchestrator.host import cancel
from orchestrator.host.base import Command, Host, Result, Spawned, blocks, printable
from orchestrator.host.ssh_connect import Target, close_quietly, connect, resolve_target

# paramiko logs refused tunnels ("Secsh channel N open FAILED") while a server is still loading;
# those are expected and reported by the probes themselves.
logging.getLogger("paramiko").setLevel(logging.CRITICAL)

TIMED_OUT = 124           # like coreutils `timeout` and LocalHost
_GET_MISSING = 44         # exit code of the sudo `get` script when the file does not exist
# The login shell reports its PID (= its process group) first on stderr, so that a timed-out
# command can be killed with its children: sshd's "signal" request is ignored for root logins.
_PID_MARK = b"@vllm-orch-pgid "
KILL_MARK_WAIT_S = 10.0


class SshHost(Host):
    def __init__(self, name: str, address: str, *, port: int | None = None, user: str | None = None,
                 identity_file: str | None = None, sudo: bool = False,
                 env: Mapping[str, str] | None = None, known_hosts_file: str | None = None,
                 accept_new_host_key: bool = False, connect_timeout: float = 10.0,
                 ssh_config: str | None = "~/.ssh/config"):
        super().__init__(name, sudo=sudo, env=env)
        self.target: Target = resolve_target(
            name, address, port=port, user=user, identity_file=identity_file,
            known_hosts_file=known_hosts_file,
            accept_new_host_key=accept_new_host_key, connect_timeout=connect_timeout,
            ssh_config=ssh_config)
        self.connects = 0              # how many times a connection was opened (1 per run, ideally)
        self._client: paramiko.SSHClient | None = None
        self._sftp: paramiko.SFTPClient | None = None
        self._lock = threading.Lock()       # guards _client
        self._sftp_lock = threading.Lock()  # SFTPClient is not safe for concurrent requests

    @classmethod
    def from_inventory(cls, name: str, entry: Mapping, *, accept_new_host_key: bool = False,
                       connect_timeout: float | None = None) -> SshHost:
        """Build from an inventory entry (a dict; keys this class does not use are ignored)."""
        return cls(name, entry["address"], port=entry.get("port"), user=entry.get("user"),
                   identity_file=entry.get("identity_file"), sudo=bool(entry.get("sudo", False)),
                   env=entry.get("env"), known_hosts_file=entry.get("known_hosts_file"),
                   accept_new_host_key=accept_new_host_key,
                   connect_timeout=connect_timeout or float(entry.get("connect_timeout", 10.0)))

    # -- connection ------------------------------------------------------------------------------
    def transport(self) -> paramiko.Transport:
        """The live Transport, connecting on first use (and again if the connection died)."""
        with self._lock:
            t = self._client.get_transport() if self._client else None
            if t is None or not t.is_active():
                self._drop()
                self._client = connect(self.target)
                self.connects += 1
                t = self._client.get_transport()
                if t is None:
                    raise ConnectError(f"{self.target.where}: the SSH connection has no transport", host=self.name)
                t.set_keepalive(30)
            return t

    def _drop(self) -> None:
        """Forget the connection, closing what is left of it: on a connection that has died, paramiko's
        close of the SFTP channel raises EOFError (seen leaving a swap cut off from its host through
        its session's close), and there is nothing left to close then."""
        sftp, client, self._sftp, self._client = self._sftp, self._client, None, None
        for part in (sftp, client, getattr(client, "_vllm_orch_jump", None)):
            if part is not None:
                close_quietly(part)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _session(self, timeout: float) -> paramiko.Channel:
        t = self.transport()
        try:
            return t.open_session(timeout=min(timeout, self.target.connect_timeout))
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise ConnectError(f"lost the connection to {self.target.where}: {exc}",
                               host=self.name) from None

    # -- commands --------------------------------------------------------------------------------
    def run(self, cmd: Command, *, timeout: float = 60.0, input: bytes | BinaryIO | None = None,
            env: Mapping[str, str] | None = None, sudo: bool | None = None) -> Result:
        started = time.monotonic()
        code, out, err = self._exec(self.wrap(cmd, env, sudo), timeout, input, None,
                                    self.sudo if sudo is None else sudo)
        self._count(started)
        return Result(printable(cmd), code, out.decode(errors="replace"),
                      err.decode(errors="replace"), time.monotonic() - started)

    def stream(self, cmd: Command, *, on_line: Callable[[str], None], timeout: float = 3600.0,
               input: bytes | None = None, env: Mapping[str, str] | None = None,
               sudo: bool | None = None) -> Result:
        started = time.monotonic()
        lines: list[str] = []
        pending = bytearray()

        def feed(chunk: bytes) -> None:
            pending.extend(chunk)
            while (nl := pending.find(b"\n")) >= 0:
                line = pending[:nl].decode(errors="replace")
                del pending[:nl + 1]
                lines.append(line)
                on_line(line)

        code, _, err = self._exec(self.wrap(cmd, env, sudo), timeout, input, feed,
                                  self.sudo if sudo is None else sudo)
        if pending:
            lines.append(pending.decode(errors="replace"))
            on_line(lines[-1])
        self._count(started)
        return Result(printable(cmd), code, "\n".join(lines), err.decode(errors="replace"),
                      time.monotonic() - started)

    def _kill_group(self, chan: paramiko.Channel, err: bytearray, sudo: bool) -> None:
        """Kill the process group of a command whose stderr begins with its PID mark. The mark is the
        command's first output, but a cancel (or a timeout) can come before it has arrived: then wait
        for it (up to KILL_MARK_WAIT_S), or the command and its children would run on after their
        channel closed (seen on a loaded machine: a Ctrl-C 0.5 s after the start left both sleeps)."""
        pgid, _ = _strip_mark(err)
        deadline = time.monotonic() + KILL_MARK_WAIT_S
        while pgid is None and time.monotonic() < deadline and not chan.closed:
            if chan.recv_stderr_ready():
                err.extend(chan.recv_stderr(65536))
                pgid, _ = _strip_mark(err)
            elif chan.exit_status_ready():
                break                                    # it ended without a mark: nothing to kill
            else:
                time.sleep(0.02)
        if pgid:
            kill = f"kill -KILL -- -{pgid}"
            self._exec(f"sudo -n {kill}" if sudo else kill, 10, None, None, bound=False, cancellable=False)

    def _exec(self, text: str, timeout: float, input: bytes | BinaryIO | None,
              on_stdout: Callable[[bytes], None] | None,
              sudo: bool = False, bound: bool = True, cancellable: bool = True) -> tuple[int, bytes, bytes]:
        """Run shell text on one channel; stdout goes to on_stdout as it arrives (or is kept).
        On timeout, or when the operation is cancelled (host/cancel.py: Ctrl-C), the command's whole
        process group is killed (with sudo when it ran so) and its channel closed; `bound` also puts
        it under the host's `timeout`, so it ends even if we are gone (see bounded)."""
        chan = self._session(timeout)
        out, err = bytearray(), bytearray()
        deadline = time.monotonic() + timeout
        try:
            chan.exec_command(f'echo "{_PID_MARK.decode()}$$" >&2; {bounded(text, timeout) if bound else text}')
            token = cancel.current() if cancellable else None
            for block in blocks(input):
                if token is not None and token.requested:      # Ctrl-C in a long upload
                    self._kill_group(chan, err, sudo)
                    raise KeyboardInterrupt
                chan.sendall(block)
            chan.shutdown_write()
            while True:
                if token is not None and token.requested:      # Ctrl-C (host/cancel.py): end the command,
                    self._kill_group(chan, err, sudo)                # then its channel (below)
                    raise KeyboardInterrupt
                while chan.recv_ready():
                    chunk = chan.recv(65536)
                    on_stdout(chunk) if on_stdout else out.extend(chunk)
                while chan.recv_stderr_ready():
                    err.extend(chan.recv_stderr(65536))
                if chan.exit_status_ready() and chan.eof_received \
                        and not chan.recv_ready() and not chan.recv_stderr_ready():
                    status = chan.recv_exit_status()
                    if status == -1 and not _alive(chan.get_transport()):
                        # EOF came, then the connection died before sshd's exit status: paramiko
                        # closed the channel with -1 (a command killed by a signal also reads -1,
                        # but on a live connection)
                        raise EOFError("the connection died before the command's exit status")
                    return status, bytes(out), _strip_mark(err)[1]
                if chan.closed and not chan.eof_received and not chan.recv_ready() and not chan.recv_stderr_ready():
                    # sshd sends EOF (then the exit status) before it closes a command's channel, so
                    # a closed channel with EOF ends above (paramiko counts a closed channel's exit
                    # status as ready). One closed without EOF was closed by paramiko when the
                    # connection died, with exit status -1: never read that as the command's own end.
                    raise EOFError("the channel closed before the command ended")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._kill_group(chan, err, sudo)
                    return TIMED_OUT, bytes(out), _strip_mark(err)[1] + \
                        f"\n(timed out after {timeout:g} s)".encode()
                select.select([chan], [], [], min(remaining, 0.5))
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise ConnectError(f"lost the connection to {self.target.where}: {exc}",
                               host=self.name) from None
        finally:
            close_quietly(chan)     # on a connection that died unnoticed, close() raised EOFError over
                                    # the lost connection (a swap cut off from its host, under load)

    # -- files -----------------------------------------------------------------------------------
    def sftp(self) -> paramiko.SFTPClient:
        transport = self.transport()
        channel = self._sftp.get_channel() if self._sftp is not None else None
        if self._sftp is None or channel is None or channel.closed:
            self._sftp = paramiko.SFTPClient.from_transport(transport)
            if self._sftp is None:
                raise ConnectError(f"{self.target.where}: cannot open an SFTP session", host=self.name)
        return self._sftp

    def put(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write atomically through the shell (with sudo when the host says so): the bytes go on
        stdin to a 0600 mktemp file beside the target, then chmod and rename (Host.put_command).
        Not SFTP: its open() creates the file with the server's default mode (0644) before any chmod,
        and with sudo it needed a staging copy in /tmp."""
        self._put(path, data, len(data), mode)

    def put_file(self, path: str, local: Path, mode: int = 0o644) -> None:
        with open(local, "rb") as source:
            self._put(path, source, local.stat().st_size, mode)

    def _put(self, path: str, data: bytes | BinaryIO, size: int, mode: int) -> None:
        started = time.monotonic()
        # A minute, and a second per MB: an engine's wheels are GBs (a fixed minute cut a 48 MB
        # file short on a busy machine, and would cut every CUDA torch wheel short).
        timeout = 60 + size / 1e6
        code, out, err = self._exec(self.wrap(self.put_command(path, mode), None, None), timeout, data, None,
                                    self.sudo)
        if code != 0:
            raise OSError(f"{self.name}: cannot write {path}{' with sudo' if self.sudo else ''}: "
                          f"{(err or out).decode(errors='replace').strip()}")
        self._count(started)

    def get(self, path: str) -> bytes | None:
        started = time.monotonic()
        try:
            if self.sudo:
                q = shlex.quote(path)
                code, out, err = self._exec(
                    f"sudo -n sh -c {shlex.quote(f'[ -e {q} ] || exit {_GET_MISSING}; cat {q}')}",
                    60, None, None)
                if code == _GET_MISSING:
                    return None
                if code != 0:
                    raise OSError(f"{self.name}: cannot read {path}: "
                                  f"{err.decode(errors='replace').strip()}")
                return out
            with self._sftp_lock:
                try:
                    with self.sftp().open(path, "rb") as f:
                        f.prefetch()
                        return f.read()
                except FileNotFoundError:
                    return None
                except (paramiko.SSHException, EOFError) as exc:
                    # An SFTP session on a dead link ("Server connection dropped"): a lost connection,
                    # as run() says it, so the run's recovery and the lock's guard know it for one
                    # (paramiko's own exception escaped a swap's rollback). The next call reopens.
                    self._sftp = None
                    raise ConnectError(f"lost the connection to {self.target.where}: "
                                       f"{exc or type(exc).__name__}", host=self.name) from None
        finally:
            self._count(started)

    # -- long-lived commands (the host lock) -------------------------------------------------------
    def spawn(self, cmd: Command, *, env: Mapping[str, str] | None = None,
              sudo: bool | None = None) -> Spawned:
        """Run cmd on its own channel; its stdin stays open until close(). If this process dies the
        connection drops, the remote command reads EOF and exits (that releases the lock)."""
        started = time.monotonic()
        chan = self._session(self.target.connect_timeout)   # a dead link: ConnectError, not paramiko's own
        chan.set_combine_stderr(True)
        try:
            chan.exec_command(self.wrap(cmd, env, sudo))
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise ConnectError(f"lost the connection to {self.target.where}: {exc or type(exc).__name__}",
                               host=self.name) from None
        self._count(started)
        return _SshSpawned(chan)

    # -- tunnels ---------------------------------------------------------------------------------
    def connect_tcp(self, port: int, address: str = "127.0.0.1", timeout: float = 5.0):
        """A `direct-tcpip` channel to address:port as seen from the host (so a server bound to
        the host's 127.0.0.1 is reachable). Refused on the far side -> ConnectionRefusedError,
        like a local socket."""
        started = time.monotonic()
        try:
            chan = self.transport().open_channel("direct-tcpip", (address, port),
                                                 ("127.0.0.1", 0), timeout=timeout)
            chan.settimeout(timeout)
            return chan
        except paramiko.ChannelException as exc:
            raise ConnectionRefusedError(
                f"{self.name}: {address}:{port} on the host refused the connection "
                f"({exc.text})") from None
        except (paramiko.SSHException, EOFError, OSError) as exc:
            if not _alive(self._client.get_transport() if self._client else None):
                raise ConnectError(f"lost the connection to {self.target.where}: {exc or type(exc).__name__}",
                                   host=self.name) from None
            raise TimeoutError(f"{self.name}: tunnel to {address}:{port}: {exc}") from None
        finally:
            self._count(started)


def _alive(t: paramiko.Transport | None) -> bool:
    return t is not None and t.is_active()


class _SshSpawned(Spawned):
    def __init__(self, chan: paramiko.Channel):
        self.chan = chan
        self.buf = b""

    def readline(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.chan.settimeout(remaining)
            try:
                data = self.chan.recv(4096)
            except Exception:   # socket.timeout
                return None
            if not data:
                if self.buf:
                    line, self.buf = self.buf, b""
                    return line.decode(errors="replace")
                return None
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode(errors="replace")

    def alive(self) -> bool:
        transport = self.chan.get_transport()
        return (not self.chan.closed and not self.chan.exit_status_ready() and not self.chan.eof_received
                and transport is not None and transport.is_active())

    def ping(self) -> None:
        try:
            self.chan.sendall(b"\n")
        except Exception as exc:        # paramiko raises its own errors for a closed channel
            raise OSError(f"the lock channel is closed: {exc}") from None

    def close(self) -> None:
        try:
            self.chan.shutdown_write()
            self.chan.close()
        except Exception:
            pass


def bounded(text: str, timeout: float) -> str:
    """The command under coreutils `timeout` on the host, so it cannot outlive its budget when the
    controller is gone (no pty: sshd sends no SIGHUP when the connection drops). `exec` keeps the
    login shell's PID: `timeout` leads the same process group, which a controller-side timeout
    kills (see _exec)."""
    return f"exec timeout -k 10 {max(1, int(timeout) + 5)} sh -c {shlex.quote(text)}"


def _strip_mark(err: bytearray) -> tuple[int | None, bytes]:
    """(the remote shell's PID, stderr without our marker line)."""
    if err.startswith(_PID_MARK) and b"\n" in err:
        line, _, rest = bytes(err).partition(b"\n")
        return int(line[len(_PID_MARK):]), rest
    return None, bytes(err)
