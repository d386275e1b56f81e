"""LocalHost: this machine, without SSH. Commands run through `sh -c` exactly as SshHost sends them."""

from __future__ import annotations

import os
import queue
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

from orchestrator.host import cancel
from orchestrator.host.base import Command, Host, Result, Spawned, blocks, printable


class LocalSpawned(Spawned):
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode(errors="replace").rstrip("\n"))
        self.lines.put(None)

    def readline(self, timeout: float) -> str | None:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ping(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _feed(pipe, data: bytes | BinaryIO) -> None:
    try:
        for block in blocks(data):
            pipe.write(block)
        pipe.close()
    except OSError:          # the command exited without reading all of it
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    """End a command and what it started (its own session: its process group), on timeout or Ctrl-C."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:                 # gone already, or another user's (sudo): the shell at least
        proc.kill()


class LocalHost(Host):
    def run(self, cmd: Command, *, timeout: float = 60.0, input: bytes | BinaryIO | None = None,
            env: Mapping[str, str] | None = None, sudo: bool | None = None) -> Result:
        started = time.monotonic()
        text = self.wrap(cmd, env, sudo)
        # bytes go through a pipe; a file (Host.put_file) is the command's stdin itself: the kernel
        # streams it, nothing of it is held here
        data: bytes | None = None
        stdin: int | BinaryIO = subprocess.DEVNULL
        if isinstance(input, (bytes, bytearray)):
            data, stdin = bytes(input), subprocess.PIPE
        elif input is not None:
            stdin = input
        proc = subprocess.Popen(["sh", "-c", text], stdin=stdin,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        with cancel.on_cancel(lambda: _kill_group(proc)):     # Ctrl-C ends the command (host/cancel.py)
            try:
                out, err = proc.communicate(data, timeout=timeout)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                out, err = proc.communicate()
                code, err = 124, err + b"\n(timed out)"
        self._count(started)
        cancel.check()
        return Result(printable(cmd), code, out.decode(errors="replace"),
                      err.decode(errors="replace"), time.monotonic() - started)

    def stream(self, cmd: Command, *, on_line: Callable[[str], None], timeout: float = 3600.0,
               input: bytes | None = None, env: Mapping[str, str] | None = None,
               sudo: bool | None = None) -> Result:
        started = time.monotonic()
        proc = subprocess.Popen(["sh", "-c", self.wrap(cmd, env, sudo)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL)
        if input is not None:
            threading.Thread(target=_feed, args=(proc.stdin, input), daemon=True).start()
        err_chunks: list[bytes] = []
        assert proc.stdout is not None and proc.stderr is not None
        stderr = proc.stderr
        t = threading.Thread(target=lambda: err_chunks.append(stderr.read()), daemon=True)
        t.start()
        timer = threading.Timer(timeout, _kill_group, (proc,))
        timer.start()
        out_lines = []
        try:
            with cancel.on_cancel(lambda: _kill_group(proc)):     # Ctrl-C ends the command (host/cancel.py)
                for raw in proc.stdout:
                    line = raw.decode(errors="replace").rstrip("\n")
                    out_lines.append(line)
                    on_line(line)
                code = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        t.join(5)
        self._count(started)
        cancel.check()
        return Result(printable(cmd), code, "\n".join(out_lines),
                      b"".join(err_chunks).decode(errors="replace"), time.monotonic() - started)

    def spawn(self, cmd: Command, *, env: Mapping[str, str] | None = None,
              sudo: bool | None = None) -> Spawned:
        started = time.monotonic()
        proc = subprocess.Popen(["sh", "-c", self.wrap(cmd, env, sudo)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._count(started)
        return LocalSpawned(proc)

    def put(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Atomic write: a new 0600 temp file beside the target (O_EXCL | O_NOFOLLOW, a random name:
        a link planted at a guessable name is never written through), chmod, rename. With sudo the
        shell does it (Host.put_command), like every other command on this host."""
        self._put(path, data, mode)

    def put_file(self, path: str, local: Path, mode: int = 0o644) -> None:
        with open(local, "rb") as source:
            self._put(path, source, mode, timeout=60 + local.stat().st_size / 1e6)

    def _put(self, path: str, data: bytes | BinaryIO, mode: int, timeout: float = 60.0) -> None:
        if self.sudo:
            self.run(self.put_command(path, mode), input=data, timeout=timeout).check(self.name, f"write {path}")
            return
        started = time.monotonic()
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{secrets.token_hex(6)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                for block in blocks(data):
                    f.write(block)
            os.chmod(tmp, mode)
            os.replace(tmp, p)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._count(started)

    def get(self, path: str) -> bytes | None:
        started = time.monotonic()
        try:
            return Path(path).read_bytes()
        except FileNotFoundError:
            return None
        finally:
            self._count(started)

    def connect_tcp(self, port: int, address: str = "127.0.0.1", timeout: float = 5.0):
        started = time.monotonic()
        try:
            return socket.create_connection((address, port), timeout=timeout)
        finally:
            self._count(started)
