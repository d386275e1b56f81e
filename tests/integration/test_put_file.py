"""Host.put_file streams a local file (an engine's wheels are GBs: a CUDA torch wheel alone is
about 1 GB): on every transport the content and the mode arrive whole, while the controller never
holds more than a few blocks of it (tracemalloc's peak, well under the file's size)."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tracemalloc

import pytest

from orchestrator.host.base import PUT_CHUNK
from orchestrator.host.local import LocalHost
from tests.integration.test_secret_files import ssh

SIZE = 40 << 20
SUDO = pytest.mark.skipif(not shutil.which("sudo") or os.geteuid() != 0, reason="needs passwordless sudo (root)")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    path = tmp_path_factory.mktemp("wheelhouse") / "torch-2.9.0-cp311-cp311-linux_x86_64.whl"
    with open(path, "wb") as f:
        for i in range(SIZE // (1 << 20)):
            f.write(hashlib.sha256(str(i).encode()).digest() * (1 << 15))     # 1 MiB, not all zeros
    return path


def streamed(host, wheel, target) -> int:
    """put_file, and the peak of Python memory it allocated."""
    tracemalloc.start()
    try:
        host.put_file(str(target), wheel, 0o644)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert target.read_bytes() == wheel.read_bytes()
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert not [p for p in target.parent.iterdir() if p != target]        # no temp file left behind
    return peak


def test_local_put_file_streams(wheel, tmp_path):
    peak = streamed(LocalHost("local"), wheel, tmp_path / "wh" / wheel.name)
    assert peak < 4 * PUT_CHUNK < SIZE, peak


@SUDO
def test_local_put_file_with_sudo_streams(wheel, tmp_path):
    peak = streamed(LocalHost("local", sudo=True), wheel, tmp_path / "wh" / wheel.name)
    assert peak < 4 * PUT_CHUNK < SIZE, peak


@pytest.mark.parametrize("sudo", [False, pytest.param(True, marks=SUDO)])
def test_ssh_put_file_streams(sshd_local, wheel, tmp_path, sudo):
    with ssh(sshd_local, sudo=sudo) as host:
        peak = streamed(host, wheel, tmp_path / "wh" / wheel.name)
    assert peak < 8 * PUT_CHUNK < SIZE, peak
