"""Opening one SSH connection: where to (ssh_config), whether to trust it (known_hosts), how to
fail (one ConnectError line naming host and cause, within the connect timeout).

Kept apart from SshHost so the rules that decide trust and error wording are small and testable.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import random
import shlex
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import paramiko

from orchestrator.errors import ConfigError, ConnectError, RefusedError
from orchestrator.host import cancel

ACCEPT_FLAG = "--accept-new-host-key"
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
DEFAULT_SSH_CONFIG = "~/.ssh/config"
SYSTEM_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"


@dataclass(frozen=True)
class Target:
    """Everything needed to reach one host, after ~/.ssh/config has been applied."""

    name: str                      # inventory name, used in messages
    hostname: str                  # what we connect to (resolved from an alias)
    port: int = 22
    user: str = "root"
    identity_files: tuple[str, ...] = ()
    jump: Target | None = None   # ProxyJump: one hop, reached first
    proxy_command: str | None = None   # ProxyCommand (tokens expanded): its stdin/stdout is the link
    known_hosts_file: str = DEFAULT_KNOWN_HOSTS
    accept_new_host_key: bool = False
    connect_timeout: float = 10.0

    @property
    def where(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"

    @property
    def known_hosts_name(self) -> str:
        """How OpenSSH names this host in known_hosts (`[host]:port` unless port 22)."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"


def resolve_target(name: str, address: str, *, port: int | None = None, user: str | None = None,
                   identity_file: str | None = None, known_hosts_file: str | None = None,
                   accept_new_host_key: bool = False, connect_timeout: float = 10.0,
                   ssh_config: str | os.PathLike | None = DEFAULT_SSH_CONFIG) -> Target:
    """Apply ~/.ssh/config to `address` (which may be an alias), like `ssh` does: values given
    explicitly (inventory) win over the config file, which wins over defaults. ProxyCommand is run
    as ssh runs it; ProxyJump takes one hop (which may have its own); more, or both, is exit 2."""
    cfg = _lookup(address, ssh_config)
    ids = [identity_file] if identity_file else cfg.get("identityfile", [])
    jump = None
    proxy_jump, proxy_command = (None if str(cfg.get(k, "none")).lower() == "none" else str(cfg[k]).strip()
                                 for k in ("proxyjump", "proxycommand"))
    if proxy_jump and proxy_command:
        raise ConfigError(f"ssh_config sets both ProxyJump and ProxyCommand for {address}: "
                          f"keep one (OpenSSH would use whichever comes first)", host=name)
    if proxy_jump and ("," in proxy_jump or proxy_jump.startswith("ssh://")):
        raise ConfigError(f"ssh_config's ProxyJump {proxy_jump} for {address}: vllm-orch takes one hop "
                          f"written [user@]host[:port]; give that hop its own ProxyJump in ssh_config instead",
                          host=name)
    if proxy_jump:
        first_hop = proxy_jump
        juser, _, jhost = first_hop.rpartition("@")
        jhost, _, jport = jhost.partition(":")
        jump = resolve_target(f"{name} (jump {first_hop})", jhost, port=int(jport) if jport else None,
                              user=juser or None, known_hosts_file=known_hosts_file,
                              accept_new_host_key=accept_new_host_key,
                              connect_timeout=connect_timeout, ssh_config=ssh_config)
    return Target(
        name=name, hostname=cfg.get("hostname", address),
        port=int(port or cfg.get("port") or 22),
        user=user or cfg.get("user") or os.environ.get("USER") or "root",
        identity_files=tuple(os.path.expanduser(p) for p in ids),
        jump=jump, proxy_command=proxy_command,
        known_hosts_file=os.path.expanduser(known_hosts_file or cfg.get("userknownhostsfile",
                                                                        DEFAULT_KNOWN_HOSTS).split()[0]),
        accept_new_host_key=accept_new_host_key, connect_timeout=connect_timeout)


def _lookup(address: str, ssh_config) -> dict:
    if ssh_config is None:
        return {}
    path = Path(os.path.expanduser(str(ssh_config)))
    if not path.is_file():
        return {}
    return dict(paramiko.SSHConfig.from_path(str(path)).lookup(address))


# -- host keys -------------------------------------------------------------------------------------
def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's format: SHA256:<base64 of the sha256 of the key blob, without padding>."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown key: refuse naming its fingerprint, or (accept-new) append it to known_hosts.
    A changed key never reaches this policy: paramiko raises BadHostKeyException for it."""

    def __init__(self, target: Target):
        self.target = target

    def missing_host_key(self, client, hostname, key):
        t = self.target
        if not t.accept_new_host_key:
            raise RefusedError(
                f"unknown host key for {t.known_hosts_name}: {key.get_name()} {fingerprint(key)}",
                host=t.name,
                hint=f"check the fingerprint out of band, then rerun with {ACCEPT_FLAG} to add it "
                     f"to {t.known_hosts_file}")
        append_known_host(t.known_hosts_file, t.known_hosts_name, key)


def append_known_host(path: str, host_entry: str, key: paramiko.PKey) -> None:
    p = Path(path)
    p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    line = f"{host_entry} {key.get_name()} {key.get_base64()}\n"
    needs_newline = p.is_file() and p.stat().st_size and not p.read_bytes().endswith(b"\n")
    fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(("\n" if needs_newline else "") + line)


# -- connecting ------------------------------------------------------------------------------------
class _Transient(Exception):
    """A failure worth one more try (server dropped us during the handshake)."""


def connect(target: Target, *, attempts: int = 3) -> paramiko.SSHClient:
    """A connected, authenticated client, or ConnectError/RefusedError. Retries, with jitter, only
    the failures that a retry can fix, and never past the connect timeout."""
    deadline = time.monotonic() + target.connect_timeout
    for attempt in range(attempts):
        try:
            return _connect_once(target, deadline)
        except _Transient as exc:
            pause = min(0.2 * 2 ** attempt * random.uniform(0.5, 1.5), deadline - time.monotonic())
            if attempt == attempts - 1 or pause <= 0:
                raise ConnectError(f"cannot connect to {target.where}: {exc}", host=target.name)
            cancel.sleep(pause)
    raise AssertionError("unreachable")


def _connect_once(target: Target, deadline: float) -> paramiko.SSHClient:
    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ConnectError(f"cannot connect to {target.where}: timed out after "
                               f"{target.connect_timeout:g} s", host=target.name)
        return remaining

    fail = lambda cause: ConnectError(f"cannot connect to {target.where}: {cause}",  # noqa: E731
                                      host=target.name)
    jump_client: paramiko.SSHClient | None = None
    client: paramiko.SSHClient | None = None
    sock: Any = None
    try:
        if target.proxy_command is not None:
            # As OpenSSH runs it: by the shell, exec'd (ssh_config(5), ProxyCommand); paramiko's
            # ProxyCommand splits the line itself and runs no shell.
            sock = paramiko.ProxyCommand("/bin/sh -c " + shlex.quote("exec " + target.proxy_command))
        elif target.jump is not None:
            jump_client = _connect_once(replace(target.jump, connect_timeout=target.connect_timeout),
                                        deadline)
            hop = jump_client.get_transport()
            if hop is None:
                raise fail("the jump host's connection has no transport")
            sock = hop.open_channel(
                "direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0), timeout=left())
        else:
            sock = socket.create_connection((target.hostname, target.port), timeout=left())
            detect_dead_link(sock)
        client = paramiko.SSHClient()
        if Path(SYSTEM_KNOWN_HOSTS).is_file():          # read-only, like OpenSSH
            client.load_system_host_keys(SYSTEM_KNOWN_HOSTS)
        kh = Path(target.known_hosts_file)
        if kh.is_file():
            client.load_host_keys(str(kh))
        client.set_missing_host_key_policy(_HostKeyPolicy(target))
        remaining = left()
        # The ignores below hold only where types-paramiko is installed (paramiko itself is untyped):
        # paramiko takes a list of key files where the stubs say str; SSHClient has no slot for the hop.
        client.connect(target.hostname, port=target.port, username=target.user, sock=sock,
                       key_filename=list(target.identity_files) or None,  # type: ignore[arg-type, unused-ignore]
                       timeout=remaining, banner_timeout=remaining, auth_timeout=remaining,
                       channel_timeout=remaining, allow_agent=True,
                       look_for_keys=not target.identity_files)
        client._vllm_orch_jump = jump_client  # type: ignore[attr-defined, unused-ignore]  # the hop lives as long as the client
        return client
    except (ConnectError, RefusedError):
        _close(client, jump_client, sock)
        raise
    except paramiko.BadHostKeyException as exc:
        _close(client, jump_client, sock)
        raise RefusedError(
            f"HOST KEY CHANGED for {target.known_hosts_name}: it now presents "
            f"{exc.key.get_name()} {fingerprint(exc.key)}, known_hosts has "
            f"{exc.expected_key.get_name()} {fingerprint(exc.expected_key)} - someone may be "
            f"intercepting the connection", host=target.name,
            hint=f"if the host was reinstalled, remove its line from {target.known_hosts_file} "
                 f"(ssh-keygen -R '{target.known_hosts_name}') and verify the new key")
    except Exception as exc:  # noqa: BLE001 - every other failure becomes one readable line
        exited = _proxy_exit_status(sock) if target.proxy_command is not None else None
        _close(client, jump_client, sock)
        if exited is not None:
            # A ProxyCommand that ended is the cause, whatever paramiko saw first (EOF, or a
            # banner timeout on a busy machine).
            raise fail(f"ssh_config's ProxyCommand exited with status {exited} "
                       f"({target.proxy_command})") from None
        if time.monotonic() >= deadline or isinstance(exc, (socket.timeout, TimeoutError)):
            raise fail(f"timed out after {target.connect_timeout:g} s"
                       + (" (through ssh_config's ProxyCommand)" if target.proxy_command else "")) from None
        if _is_transient(exc):
            raise _Transient(_cause(exc, target)) from None
        raise fail(_cause(exc, target)) from None


def _proxy_exit_status(sock: Any) -> int | None:
    """The ProxyCommand's exit status if it has ended (waited for up to 0.2 s), else None."""
    process = getattr(sock, "process", None)
    if process is None:
        return None
    try:
        return process.wait(timeout=0.2)
    except Exception:  # noqa: BLE001 - still running (or not ours to wait for): not the cause
        return None


def _is_transient(exc: Exception) -> bool:
    """Reset or closed during the handshake (sshd MaxStartups, a restarting daemon)."""
    if isinstance(exc, (ConnectionResetError, EOFError)):
        return True
    return isinstance(exc, paramiko.SSHException) and "banner" in str(exc).lower() \
        and "timeout" not in str(exc).lower()


def _cause(exc: Exception, target: Target) -> str:
    if isinstance(exc, socket.gaierror):
        return f"name {target.hostname!r} does not resolve ({exc.strerror})"
    if isinstance(exc, paramiko.ChannelException):
        return f"the jump host could not open a connection to it ({exc.text})"
    if isinstance(exc, OSError) and exc.errno in (errno.ECONNREFUSED,):
        return "connection refused (is sshd running and listening on that port?)"
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "no route to host"
    if isinstance(exc, paramiko.AuthenticationException):
        tried = ", ".join(target.identity_files) or "SSH agent and ~/.ssh/id_* keys"
        return f"authentication failed for user {target.user!r} (tried: {tried})"
    if isinstance(exc, paramiko.ProxyCommandFailure):
        return f"ssh_config's ProxyCommand failed: {exc}"
    if isinstance(exc, paramiko.SSHException):
        return f"SSH handshake failed: {exc}" + (" (through ssh_config's ProxyCommand)" if target.proxy_command else "")
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[0].lower() + exc.strerror[1:]
    return f"{type(exc).__name__}: {exc}"


# A link that dies without a TCP reset (a cable, a VPN, a host that lost power) would otherwise leave
# a command waiting until its own timeout, up to an hour for a load: keepalive probes after 15 s of
# silence (every 5 s, 3 missed) and a 30 s bound on unacknowledged data end the connection in about
# 30 s, and the run then reconnects or reports the host out of reach.
KEEPALIVE = {"TCP_KEEPIDLE": 15, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}
USER_TIMEOUT_MS = 30_000


def detect_dead_link(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in KEEPALIVE.items():
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
    except OSError:
        pass                     # not a TCP socket (a test double): nothing to tune


def _close(client, jump_client, sock=None) -> None:
    """What a failed connect made; the connect's own error is the one to report."""
    for c in (client, sock, jump_client):
        if c is not None:
            close_quietly(c)


def close_quietly(part: paramiko.Channel | paramiko.SFTPClient | paramiko.SSHClient | socket.socket) -> None:
    """Close a channel, an SFTP session, a client or a socket. On a connection that has died before
    paramiko noticed, close() sends its message on a dead socket and raises EOFError (or OSError,
    SSHException); there is nothing left to close then, and the caller's own error (a lost
    connection, a failed connect) is the one to report."""
    try:
        part.close()
    except (paramiko.SSHException, EOFError, OSError):
        pass
