"""host/remote/gateway_ctl.py's master-CLI client against a stand-in master socket that does what
HAProxy's master does on a reload: it resets a connection it had accepted (it re-executes itself)."""

from __future__ import annotations

import importlib.util
import socket
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _ctl():
    spec = importlib.util.spec_from_file_location("gateway_ctl", REPO / "orchestrator/host/remote/gateway_ctl.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _master(path: str, resets: int, answer: bytes, seen: list[bytes]) -> threading.Thread:
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(8)

    def serve():
        for n in range(resets + 1):
            conn, _ = server.accept()
            if n < resets:              # closed with the command unread: the client's recv is reset
                conn.close()
                continue
            data = b""
            while not data.endswith(b"\n"):
                data += conn.recv(1024)
            seen.append(data)
            conn.sendall(answer)
            conn.close()
        server.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def test_a_reset_connection_is_asked_again_and_a_reset_reload_is_not_sent_twice(tmp_path):
    ctl = _ctl()
    seen: list[bytes] = []
    t = _master(str(tmp_path / "master.sock"), 2, b"# workers\n4242 worker 0\n", seen)
    assert ctl.cli(str(tmp_path), "show proc") == "# workers\n4242 worker 0\n"
    t.join(5)
    assert seen == [b"show proc\n"]                    # asked a third time, answered once
    (tmp_path / "master.sock").unlink()
    seen.clear()
    t = _master(str(tmp_path / "master.sock"), 1, b"", seen)
    assert ctl.cli(str(tmp_path), "reload") == ""      # reset after it was sent: not sent again
    assert seen == []
