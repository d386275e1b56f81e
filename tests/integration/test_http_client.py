"""The one HTTP client (orchestrator/host/http.py) against real servers on this machine, reached
directly (LocalHost) and through a real SSH direct-tcpip channel (sshd on loopback): JSON bodies,
content-length, chunked and close-delimited answers, SSE lines with arrival times, timeouts,
refused connections, broken answers, and the API key."""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from orchestrator.host import http
from orchestrator.host.local import LocalHost
from orchestrator.secret import Secret
from orchestrator.sim import sshd as sshd_mod

KEY = "k-7f3a9c"


class RawHandler(socketserver.StreamRequestHandler):
    """Answers with hand-written bytes so each framing case is exactly what the test says."""

    def handle(self):
        request_line = self.rfile.readline().decode()
        if not request_line:
            return
        method, path, _ = request_line.split()
        headers = {}
        while True:
            line = self.rfile.readline().decode()
            if line in ("\r\n", "\n", ""):
                break
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        body = self.rfile.read(int(headers.get("content-length", 0) or 0))
        w = self.wfile
        if path == "/echo":
            out = json.dumps({"method": method, "headers": headers,
                              "json": json.loads(body) if body else None}).encode()
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(out), out))
        elif path == "/chunked":
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for piece in (b"alpha\nbe", b"ta\r\ngam", b"ma"):
                w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            w.write(b"0\r\n\r\n")
        elif path == "/sse":
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")
            w.flush()
            for i in range(3):
                data = b'data: {"n": %d}\n\n' % i
                w.write(b"%x\r\n%s\r\n" % (len(data), data))
                w.flush()
                time.sleep(0.25)
            w.write(b"6\r\ndata: \r\n8\r\n[DONE]\n\n\r\n0\r\n\r\n")
        elif path == "/close-delimited":
            w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        elif path == "/stall":
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12")
            w.flush()
            time.sleep(3)
        elif path == "/short":
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        elif path == "/garbage":
            w.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        elif path == "/silent":
            time.sleep(3)


class StdlibHandler(BaseHTTPRequestHandler):
    """The standard library's server: HTTP/1.0 answers with Content-Length."""

    def do_GET(self):
        body = b"# TYPE x gauge\nx 1.0\n"
        self.send_response(401 if self.headers.get("Authorization") != f"Bearer {KEY}" else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def raw_port():
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), RawHandler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def stdlib_port():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), StdlibHandler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


@pytest.fixture(params=["local", "ssh"])
def host(request):
    if request.param == "local":
        yield LocalHost("local")
    else:
        yield request.getfixturevalue("ssh_host")


def test_json_request_with_api_key(host, raw_port):
    r = http.request(host, raw_port, "POST", "/echo", json={"a": [1, 2]}, api_key=Secret(KEY),
                     headers={"X-Extra": "yes"})
    assert r.status == 200 and r.headers["content-type"] == "application/json"
    echoed = r.json()
    assert echoed["method"] == "POST" and echoed["json"] == {"a": [1, 2]}
    assert echoed["headers"]["authorization"] == f"Bearer {KEY}"
    assert echoed["headers"]["content-type"] == "application/json"
    assert echoed["headers"]["x-extra"] == "yes"
    assert echoed["headers"]["host"] == f"127.0.0.1:{raw_port}"
    no_key = http.request(host, raw_port, "GET", "/echo").json()
    assert "authorization" not in no_key["headers"] and no_key["json"] is None


def test_chunked_body_is_reassembled_and_split_into_lines(host, raw_port):
    assert http.request(host, raw_port, "GET", "/chunked").body == b"alpha\nbeta\r\ngamma"
    with http.stream(host, raw_port, "GET", "/chunked") as s:
        assert [line for _, line in s.lines()] == ["alpha", "beta", "gamma"]


def test_close_delimited_body(host, raw_port):
    assert http.request(host, raw_port, "GET", "/close-delimited").text() == "until the end"


def test_sse_lines_carry_their_arrival_time(host, raw_port):
    t0 = time.perf_counter()
    with http.stream(host, raw_port, "POST", "/sse", json={"stream": True}, timeout=10) as s:
        assert s.status == 200 and s.headers["content-type"] == "text/event-stream"
        lines = [(t, line) for t, line in s.lines() if line]
    assert [line for _, line in lines] == ['data: {"n": 0}', 'data: {"n": 1}', 'data: {"n": 2}',
                                            "data: [DONE]"]
    stamps = [t for t, _ in lines]
    assert stamps == sorted(stamps) and stamps[0] >= t0
    # the server sleeps 0.25 s between events, so the third cannot arrive before t0 + 0.5 s (sleeps
    # only get longer); how far apart the stamps are depends on how promptly a busy machine reads
    # them (a stalled reader stamps two lines together), so that gap is not asserted
    assert stamps[2] - t0 >= 0.5


def test_stdlib_server_and_status_codes(host, stdlib_port):
    assert http.request(host, stdlib_port, "GET", "/metrics").status == 401
    r = http.request(host, stdlib_port, "GET", "/metrics", api_key=Secret(KEY))
    assert (r.status, r.text()) == (200, "# TYPE x gauge\nx 1.0\n")


def test_refused_is_one_exception_type(host):
    port = sshd_mod.free_port()
    with pytest.raises(http.Refused) as err:
        http.request(host, port, "GET", "/health", api_key=Secret(KEY))
    assert isinstance(err.value, ConnectionRefusedError) and isinstance(err.value, http.HttpError)
    assert KEY not in str(err.value)


def test_timeouts(host, raw_port):
    t = time.monotonic()
    with pytest.raises(http.HttpTimeout) as err:
        http.request(host, raw_port, "GET", "/silent", timeout=0.5)
    assert isinstance(err.value, TimeoutError)
    with pytest.raises(http.HttpTimeout):              # head came, the body stalls
        http.request(host, raw_port, "GET", "/stall", timeout=0.5)
    assert time.monotonic() - t < 5.5                  # neither waited for the server's 3 s


def test_broken_answers(host, raw_port):
    with pytest.raises(http.BadResponse, match="not a valid HTTP/1.1 answer"):
        http.request(host, raw_port, "GET", "/garbage")
    with pytest.raises(http.BadResponse):
        http.request(host, raw_port, "GET", "/short")
    with pytest.raises(http.BadResponse, match="not JSON"):
        http.request(host, raw_port, "GET", "/close-delimited").json()


def test_a_listening_socket_that_closes_at_once_is_a_bad_response(host):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def close_all():
        for _ in range(2):
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=close_all, daemon=True).start()
    try:
        with pytest.raises(http.HttpError):
            http.request(host, srv.getsockname()[1], "GET", "/health", timeout=3)
    finally:
        srv.close()
