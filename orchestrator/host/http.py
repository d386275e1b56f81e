"""The one HTTP/1.1 client of vllm-orch: every request to a server ON a host (readiness gates, the
smoke test, status probes, /metrics) goes through here.

Why over `Host.connect_tcp`: the transport is whatever the host hands out - a socket for a local
host, a paramiko `direct-tcpip` channel over SSH - so a vLLM bound to the host's 127.0.0.1 is
reachable without a port forward. Only `sendall`, `recv`, `settimeout` and `close` are used.

Why h11: framing (Content-Length, chunked, close-delimited bodies, header limits) is done by a
maintained HTTP/1.1 state machine (the one under httpcore/httpx; huggingface_hub already pulls it
in) instead of by hand. We add only the socket loop, the timestamps and the errors.

One request per connection (`Connection: close`): probes are seconds apart and a new SSH channel is
one round trip, so keep-alive would buy nothing but stale-connection states. bench's load generator
is the exception: it keeps its own asyncio client (see orchestrator/bench/client.py) because it
drives hundreds of concurrent streams from one event loop, which a blocking client cannot.

Errors: nothing listening -> `Refused` (also a ConnectionRefusedError); no bytes within `timeout`
-> `HttpTimeout` (also a TimeoutError); a broken or oversized answer -> `BadResponse`. All three
are `HttpError`, so a probe catches one type for "no usable HTTP answer". An API key is sent as
`Authorization: Bearer`, taken as a Secret and revealed only into the request bytes.
"""

from __future__ import annotations

import json as _json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import h11

from orchestrator.host.base import Host
from orchestrator.secret import Secret

MAX_BODY = 64 << 20          # an answer larger than this is not one we asked for
_RECV = 65536


class HttpError(OSError):
    """No usable HTTP answer: the base of Refused, HttpTimeout and BadResponse."""


class Refused(HttpError, ConnectionRefusedError):
    """Nothing listens on the port (yet): vLLM binds its port early but listens only when loaded."""


class HttpTimeout(HttpError, TimeoutError):
    """The connection, or the next bytes of the answer, did not come within the timeout."""


class BadResponse(HttpError):
    """The server closed early, broke HTTP/1.1, or sent more than MAX_BODY."""


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]          # names in lower case
    body: bytes

    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        try:
            return _json.loads(self.body)
        except ValueError as exc:
            raise BadResponse(f"HTTP {self.status}: the body is not JSON ({exc}): "
                              f"{self.text()[:200]!r}") from None


@dataclass
class Stream:
    """A response whose body is read as it arrives; get one from `stream()`."""

    status: int
    headers: dict[str, str]
    _reader: _Reader = field(repr=False)

    def chunks(self) -> Iterator[tuple[float, bytes]]:
        """(arrival time, bytes) per piece of body, the time being time.perf_counter() right
        after the read that delivered it (before any parsing)."""
        while True:
            event = self._reader.next_event()
            if isinstance(event, h11.Data):
                yield self._reader.stamp, bytes(event.data)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return

    def lines(self) -> Iterator[tuple[float, str]]:
        """(arrival time, line without its CR/LF) per line of the body, e.g. SSE `data:` lines;
        a last line without a newline is yielded at the end."""
        buf = b""
        stamp = time.perf_counter()
        for stamp, data in self.chunks():
            buf += data
            *complete, buf = buf.split(b"\n")
            for line in complete:
                yield stamp, line.rstrip(b"\r").decode("utf-8", "replace")
        if buf:
            yield stamp, buf.rstrip(b"\r").decode("utf-8", "replace")

    def read(self) -> bytes:
        """The rest of the body."""
        out = bytearray()
        for _, data in self.chunks():
            out += data
            if len(out) > MAX_BODY:
                raise BadResponse(f"HTTP {self.status}: body larger than {MAX_BODY} bytes")
        return bytes(out)


def request(host: Host, port: int, method: str, path: str, *, json: Any = None,
            body: bytes | None = None, headers: dict[str, str] | None = None,
            api_key: Secret | None = None, timeout: float = 5.0,
            address: str = "127.0.0.1") -> Response:
    """One request, the whole answer read. `json` is sent as the JSON body; `timeout` bounds the
    connect and every wait for the next bytes (not the whole exchange)."""
    with stream(host, port, method, path, json=json, body=body, headers=headers,
                api_key=api_key, timeout=timeout, address=address) as s:
        return Response(s.status, s.headers, s.read())


@contextmanager
def stream(host: Host, port: int, method: str, path: str, *, json: Any = None,
           body: bytes | None = None, headers: dict[str, str] | None = None,
           api_key: Secret | None = None, timeout: float = 5.0,
           address: str = "127.0.0.1") -> Iterator[Stream]:
    """Send a request and yield the response once its head arrived; the body is read through
    Stream.lines()/chunks()/read(). The connection is closed when the block ends."""
    if json is not None:
        body = _json.dumps(json).encode()
    head = [("Host", f"{address}:{port}"), ("User-Agent", "vllm-orch"), ("Accept", "*/*"),
            ("Connection", "close")]
    if body is not None:
        head += [("Content-Length", str(len(body)))]
        if json is not None:
            head += [("Content-Type", "application/json")]
    head += list((headers or {}).items())
    if api_key:
        head += [("Authorization", f"Bearer {api_key.reveal()}")]
    sock = _connect(host, port, address, timeout)
    try:
        reader = _Reader(sock, timeout, f"{address}:{port}{path}")
        reader.send(h11.Request(method=method, target=path, headers=head))
        if body:
            reader.send(h11.Data(data=body))
        reader.send(h11.EndOfMessage())
        event = reader.next_event()
        while isinstance(event, h11.InformationalResponse):     # 100 Continue and friends
            event = reader.next_event()
        if not isinstance(event, h11.Response):
            raise BadResponse(f"{reader.where}: the server closed the connection without answering")
        hdrs = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
        yield Stream(event.status_code, hdrs, reader)
    finally:
        try:
            sock.close()
        except Exception:   # closing a dead channel may raise anything; the answer is what counts
            pass


def _connect(host: Host, port: int, address: str, timeout: float):
    where = f"{host.name}: {address}:{port}"
    try:
        sock = host.connect_tcp(port, address, timeout=timeout)
    except ConnectionRefusedError as exc:
        raise Refused(f"{where}: connection refused ({exc})") from None
    except TimeoutError as exc:
        raise HttpTimeout(f"{where}: no connection within {timeout:g}s ({exc})") from None
    except OSError as exc:
        raise HttpError(f"{where}: cannot connect: {exc}") from None
    try:
        sock.settimeout(timeout)
    except OSError:
        pass
    return sock


class _Reader:
    """The h11 client state machine fed from a socket-like object; `stamp` is the perf_counter of
    the last read, i.e. when the bytes of the events handed out since then arrived."""

    def __init__(self, sock, timeout: float, where: str):
        self.sock, self.timeout, self.where = sock, timeout, where
        self.conn = h11.Connection(h11.CLIENT)
        self.stamp = time.perf_counter()
        self.received = 0

    def send(self, event) -> None:
        data = self.conn.send(event)
        if data:
            try:
                self.sock.sendall(data)
            except TimeoutError:
                raise HttpTimeout(f"{self.where}: sending timed out after {self.timeout:g}s") from None
            except OSError as exc:
                raise BadResponse(f"{self.where}: connection lost while sending: {exc}") from None

    def next_event(self):
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise BadResponse(f"{self.where}: not a valid HTTP/1.1 answer: {exc}") from None
            if event is not h11.NEED_DATA:
                return event
            try:
                data = self.sock.recv(_RECV)
            except TimeoutError:
                raise HttpTimeout(f"{self.where}: no answer within {self.timeout:g}s") from None
            except OSError as exc:
                raise BadResponse(f"{self.where}: connection lost: {exc}") from None
            self.stamp = time.perf_counter()
            self.received += len(data)
            if self.received > MAX_BODY:
                raise BadResponse(f"{self.where}: answer larger than {MAX_BODY} bytes")
            self.conn.receive_data(data)
