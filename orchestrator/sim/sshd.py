"""A real OpenSSH sshd as a plain daemon (no service manager), for tests and simulated SSH hosts.

Own config, host key and authorized key in one folder; listens on 127.0.0.1 (or an address in a
network namespace the caller made). It needs the openssh-server package; a root sshd also needs
/run/sshd (privilege separation directory), which is created here.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"


@dataclass
class Sshd:
    address: str
    port: int
    user: str
    identity_file: str        # private key authorized for `user`
    known_hosts_file: str     # holds the daemon's host key, so connections are verified
    host_key_pub: str         # "ssh-ed25519 AAAA..." (for tests that build their own known_hosts)
    pid: int
    folder: str
    log_file: str

    def inventory(self) -> dict:
        """The inventory fields an SSH host entry needs to reach this daemon."""
        return {"address": self.address, "port": self.port, "user": self.user,
                "identity_file": self.identity_file, "known_hosts_file": self.known_hosts_file}


def available() -> str | None:
    """None when a daemon can be started here, else the reason why not (for test skips)."""
    if not os.path.exists(SSHD):
        return f"{SSHD} not found (apt-get install openssh-server)"
    if not shutil.which("ssh-keygen"):
        return "ssh-keygen not found (apt-get install openssh-client)"
    return None


def free_port(address: str = "") -> int:
    """A TCP port nothing listens on at `address`; by default on ANY address, which is what a port
    for a service needs: it binds 0.0.0.0 (vLLM's default), so a port free only on 127.0.0.1 may be
    taken on another address (a test worker's systemd test hosts serve their Hub mirror on their
    bridge address, and a free-on-loopback pick once handed a multi-node test that very port, which
    the deploy rightly refused as a foreign holder). The one copy: the tests and benchmarks call it."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def keygen(path: Path, comment: str = "vllm-orch") -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, capture_output=True)


def start(folder: Path, *, address: str = "127.0.0.1", port: int | None = None,
          netns: str | None = None, timeout: float = 5.0) -> Sshd:
    """Start sshd with everything it needs in `folder`; return once it accepts connections."""
    reason = available()
    if reason:
        raise RuntimeError(reason)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    for key in ("host_ed25519", "client_ed25519"):
        if not (folder / key).exists():
            keygen(folder / key)
    (folder / "authorized_keys").write_text((folder / "client_ed25519.pub").read_text())
    port = port or free_port(address)
    config = folder / "sshd_config"
    config.write_text("\n".join([
        f"Port {port}", f"ListenAddress {address}", f"HostKey {folder / 'host_ed25519'}",
        f"AuthorizedKeysFile {folder / 'authorized_keys'}", f"PidFile {folder / 'sshd.pid'}",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
        "StrictModes no", "PermitRootLogin prohibit-password", "UseDNS no",
        "AllowTcpForwarding yes", "Subsystem sftp internal-sftp", ""]))
    host_pub = (folder / "host_ed25519.pub").read_text().split()
    entry = address if port == 22 else f"[{address}]:{port}"
    (folder / "known_hosts").write_text(f"{entry} {host_pub[0]} {host_pub[1]}\n")
    log = folder / "sshd.log"
    argv = [SSHD, "-D", "-f", str(config), "-E", str(log)]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited {proc.returncode}: "
                               + (log.read_text()[-500:] if log.exists() else ""))
        try:
            socket.create_connection((address, port), timeout=0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"sshd did not listen on {address}:{port} within {timeout} s")
            time.sleep(0.01)
    import pwd
    return Sshd(address=address, port=port, user=pwd.getpwuid(os.geteuid()).pw_name,
                identity_file=str(folder / "client_ed25519"),
                known_hosts_file=str(folder / "known_hosts"),
                host_key_pub=f"{host_pub[0]} {host_pub[1]}", pid=proc.pid, folder=str(folder),
                log_file=str(log))


def stop(info: Sshd, timeout: float = 5.0) -> None:
    """Stop the daemon we started (by its PID) and the sessions it forked (same process group)."""
    try:
        os.killpg(info.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(info.pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            if not Path(f"/proc/{info.pid}").exists():
                return
        time.sleep(0.02)
    os.killpg(info.pid, signal.SIGKILL)
