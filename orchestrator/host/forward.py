"""forward_local: a local TCP port that reaches a port on a Host (an SSH tunnel for SshHost).

    local_port, close = forward_local(host, 8000)   # http://127.0.0.1:<local_port> now reaches
    ...                                             # 127.0.0.1:8000 on the host
    close()

Listens on 127.0.0.1:0; each accepted connection is piped to `host.connect_tcp(remote_port)` by two
threads. Works with any Host: LocalHost returns a real socket, SshHost a paramiko Channel - only
sendall/recv/close/settimeout are used on it. Why threads: paramiko channels are not selectable
file descriptors usable by asyncio, and the traffic (one benchmark) is modest.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

BUF = 256 * 1024


def _pump(src, dst, done: threading.Event) -> None:
    try:
        while True:
            data = src.recv(BUF)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    except Exception:   # paramiko raises its own exception types on a dead transport
        pass
    finally:
        done.set()
        for s in (src, dst):
            try:
                s.close()
            except Exception:
                pass


def forward_local(host, remote_port: int) -> tuple[int, Callable[[], None]]:
    """Start forwarding; returns (local port, closer). The closer stops listening and closes pipes."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(512)
    stopping = threading.Event()
    open_pairs: list[tuple] = []
    lock = threading.Lock()

    def serve_one(client: socket.socket) -> None:
        try:
            remote = host.connect_tcp(remote_port)
        except Exception:
            client.close()
            return
        try:
            remote.settimeout(None)
        except Exception:
            pass
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with lock:
            open_pairs.append((client, remote))
        done = threading.Event()
        threading.Thread(target=_pump, args=(client, remote, done), daemon=True).start()
        _pump(remote, client, done)

    def accept_loop() -> None:
        while not stopping.is_set():
            try:
                client, _ = lsock.accept()
            except OSError:
                break
            threading.Thread(target=serve_one, args=(client,), daemon=True,
                             name=f"forward-{remote_port}").start()

    threading.Thread(target=accept_loop, daemon=True, name=f"forward-accept-{remote_port}").start()

    def close() -> None:
        stopping.set()
        try:
            lsock.shutdown(socket.SHUT_RDWR)     # wakes the blocked accept() on Linux
        except OSError:
            pass
        try:
            lsock.close()
        except OSError:
            pass
        with lock:
            pairs = list(open_pairs)
        for a, b in pairs:
            for s in (a, b):
                try:
                    s.close()
                except Exception:
                    pass

    return lsock.getsockname()[1], close
