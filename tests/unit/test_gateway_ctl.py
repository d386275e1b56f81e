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


def test_a_drain_stops_waiting_for_requests_whose_port_nothing_listens_on(tmp_path, monkeypatch, capsys):
    """`idle BACKEND TIMEOUT HOST:PORT`: requests counted in flight to a port that refuses connections
    only wait for it (a start that failed): the drain returns at once, saying so; to a port that
    listens it waits its bound."""
    import json

    ctl = _ctl()
    monkeypatch.setattr(ctl, "workers", lambda run_dir: [{"pid": 1, "reloads": 0}])
    monkeypatch.setattr(ctl, "backends", lambda run_dir, pids: {"svc_a": {"inflight": 3, "queued": 1}})
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()                                        # nothing listens there now
    assert ctl.refused(f"127.0.0.1:{port}")
    assert ctl.main(["idle", str(tmp_path), "svc_a", "30", f"127.0.0.1:{port}"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["closed"] is True and answer["left"] == 4 and answer["waited_s"] < 5, answer
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(8)
    target = f"127.0.0.1:{listening.getsockname()[1]}"
    assert not ctl.refused(target)
    assert ctl.main(["idle", str(tmp_path), "svc_a", "1.2", target]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["closed"] is False and answer["left"] == 4 and answer["waited_s"] >= 1.2, answer
    listening.close()
    assert not ctl.refused("127.0.0.1:not-a-port")      # a malformed target proves nothing
