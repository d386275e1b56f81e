"""Secret files (the env file with HF_TOKEN / VLLM_API_KEY, the Hub token file) are mode 0600 from
their first byte on every transport, and never staged in a world-readable place: a watcher polls the
target folder and /tmp while a large file is written and records every mode it sees."""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time
from pathlib import Path

import pytest

from orchestrator.host.local import LocalHost
from orchestrator.host.ssh import SshHost

# Big enough to watch it being written: a local write of 48 MiB still takes a few milliseconds; SSH
# (paramiko, the watcher's polling thread beside it) moves 4 MiB in a second or more. The SSH puts
# once sent 48 MiB too: 40 s of both cores per test, for nothing more seen.
PAYLOAD = b"HF_TOKEN=hf_" + b"x" * (48 << 20) + b"\n"
SSH_PAYLOAD = b"HF_TOKEN=hf_" + b"x" * (4 << 20) + b"\n"


class Watcher:
    """Every (path, mode) seen in `folders` while running."""

    def __init__(self, *folders: Path):
        self.folders, self.seen, self.stop = folders, set(), threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.stop.is_set():
            for folder in self.folders:
                try:
                    for entry in os.scandir(folder):
                        if folder == Path("/tmp") and not entry.name.startswith(".vllm-orch"):
                            continue
                        try:
                            self.seen.add((entry.path, stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode)))
                        except FileNotFoundError:
                            pass
                except FileNotFoundError:
                    pass
            # Let the other threads run (paramiko's transport thread on a busy machine) without
            # sleeping: a local write of the file is over in milliseconds, and 1 ms sleeps missed it.
            time.sleep(0)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def check(seen: set, target: Path) -> None:
    temps = [(p, m) for p, m in seen if p != str(target)]
    assert temps, "the watcher never saw the file being written: the test proves nothing"
    assert all(m & 0o077 == 0 for _, m in seen), sorted(seen)
    assert not [p for p, _ in seen if os.path.dirname(p) == "/tmp"], sorted(seen)     # nothing staged in /tmp


def put_watched(host, target: Path, payload: bytes = PAYLOAD) -> set:
    target.parent.mkdir(parents=True, exist_ok=True)
    with Watcher(target.parent, Path("/tmp")) as w:
        host.put(str(target), payload, 0o600)
    assert target.stat().st_size == len(payload) and stat.S_IMODE(target.stat().st_mode) == 0o600
    return w.seen


def ssh(sshd_local, sudo: bool) -> SshHost:
    return SshHost("sshd-local", sshd_local.address, port=sshd_local.port, user=sshd_local.user,
                   identity_file=sshd_local.identity_file, known_hosts_file=sshd_local.known_hosts_file,
                   connect_timeout=5, ssh_config=None, sudo=sudo)


def test_ssh_put_is_0600_from_the_first_byte(sshd_local, tmp_path):
    with ssh(sshd_local, sudo=False) as host:
        target = tmp_path / "etc" / "m.env"
        check(put_watched(host, target, SSH_PAYLOAD), target)


@pytest.mark.skipif(not shutil.which("sudo") or os.geteuid() != 0, reason="needs passwordless sudo (root)")
def test_ssh_put_with_sudo_stages_nothing_in_tmp(sshd_local, tmp_path):
    with ssh(sshd_local, sudo=True) as host:
        target = tmp_path / "etc" / "m.env"
        check(put_watched(host, target, SSH_PAYLOAD), target)


def test_local_put_is_0600_and_never_writes_through_a_planted_link(tmp_path):
    host = LocalHost("local")
    target = tmp_path / "etc" / "m.env"
    check(put_watched(host, target), target)
    # Someone who can write the folder plants a link where a predictable temp name would be.
    stolen = tmp_path / "stolen"
    for name in (f".m.env.tmp{os.getpid()}", ".m.env.tmp"):
        (target.parent / name).symlink_to(stolen)
    host.put(str(target), b"HF_TOKEN=hf_secret\n", 0o600)
    assert not stolen.exists() and target.read_bytes() == b"HF_TOKEN=hf_secret\n"


@pytest.mark.skipif(not shutil.which("sudo") or os.geteuid() != 0, reason="needs passwordless sudo (root)")
def test_local_put_with_sudo_goes_through_sudo(tmp_path):
    """`sudo: true` on a local host: files are written by sudo like every command, not by the
    controller's own user."""
    host = LocalHost("local", sudo=True)
    seen = []
    original = host.run

    def spy(cmd, **kw):
        seen.append(host.wrap(cmd, kw.get("env"), kw.get("sudo")))
        return original(cmd, **kw)

    host.run = spy
    target = tmp_path / "etc" / "m.env"
    host.put(str(target), b"A=1\n", 0o600)
    assert target.read_bytes() == b"A=1\n" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert seen and seen[0].startswith("sudo -n ")
