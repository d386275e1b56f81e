"""A minimal asyncio HTTP/1.1 client: one keep-alive connection per concurrent stream.

Built on asyncio's transport/protocol layer rather than StreamReader: `data_received` runs in the
same loop callback that read the socket, so the arrival timestamp (`perf_counter_ns`) is taken before
any task switch, buffering or JSON parsing, and there is no per-read Future/Task overhead. No pool
limit exists: each worker owns its connection (aiohttp's default of 100 would queue requests at C=128).
Reads are as large as the kernel hands over (asyncio reads up to 256 KiB per call).

Why not the shared client (orchestrator/host/http.py): that one is blocking, one request per
connection over Host.connect_tcp, made for probes seconds apart. The load generator drives up to
hundreds of concurrent keep-alive streams from one event loop at 100k tok/s, stamping every read
before any parsing; a blocking request - even a /metrics scrape - would stall every stream's
timestamps. So bench keeps this asyncio client for its requests, and shares the *reading* of the
answers instead: /v1/models through probe.api.model_ids, /metrics through probe/metrics.py.
"""

from __future__ import annotations

import asyncio
import socket
import ssl as _ssl
from dataclasses import dataclass
from time import perf_counter_ns
from urllib.parse import urlsplit

from orchestrator.bench.wire import ResponseParser


@dataclass(frozen=True)
class Endpoint:
    """Where requests go: parsed once from the base URL."""

    scheme: str
    host: str
    port: int
    prefix: str          # path before /v1, without trailing slash

    @classmethod
    def parse(cls, base_url: str) -> Endpoint:
        u = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        if u.scheme not in ("http", "https"):
            raise ValueError(f"unsupported URL scheme {u.scheme!r} in {base_url!r}")
        prefix = u.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[:-3]
        port = u.port or (443 if u.scheme == "https" else 80)
        return cls(u.scheme, u.hostname or "127.0.0.1", port, prefix)

    @property
    def chat_path(self) -> str:
        return f"{self.prefix}/v1/chat/completions"

    def url(self, path: str) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.prefix}{path}"

    @property
    def host_header(self) -> str:
        return self.host if self.port in (80, 443) else f"{self.host}:{self.port}"


def build_post(ep: Endpoint, path: str, body: bytes, api_key: str | None = None) -> bytes:
    """The full request bytes, built once per prompt during setup (not on the hot path)."""
    head = [f"POST {path} HTTP/1.1", f"Host: {ep.host_header}", "Content-Type: application/json",
            "Accept: text/event-stream", f"Content-Length: {len(body)}", "User-Agent: vllm-orch-bench"]
    if api_key:
        head.append(f"Authorization: Bearer {api_key}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class Connection(asyncio.Protocol):
    """One TCP (or TLS) connection; one request at a time."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.pending: list[tuple[int, bytes]] = []
        self.scheduled = False
        self.transport: asyncio.Transport | None = None
        self.parser: ResponseParser | None = None
        self.waiter: asyncio.Future | None = None
        self.closed = False
        self.error: str | None = None

    # -- protocol callbacks ------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        # Stamp and stash only. Parsing waits for a call_soon callback, which asyncio runs after
        # every socket that was ready in this loop iteration has been read and stamped: when 128
        # streams receive a token at the same instant, the 128th stamp is not delayed by 127 parses.
        self.pending.append((perf_counter_ns(), data))
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self.process)

    def process(self) -> None:
        self.scheduled = False
        pending, self.pending = self.pending, []
        p = self.parser
        if p is None or p.complete:
            return                      # stray bytes between requests: ignored
        for ts, data in pending:
            try:
                p.feed(data, ts)
            except Exception as exc:    # a malformed response: this request fails, conn closes
                self._resolve(f"bad response: {exc}")
                self.close()
                return
            if p.complete:
                self._resolve(None)
                return

    def eof_received(self):
        self.process()
        p = self.parser
        if p is not None and not p.complete:
            p.eof(perf_counter_ns())
            self._resolve(None if p.complete else "disconnect: the server closed the stream")
        return False

    def connection_lost(self, exc) -> None:
        self.process()
        self.closed = True
        self._resolve(f"disconnect: {exc}" if exc else "disconnect: connection closed")

    def _resolve(self, error: str | None) -> None:
        w = self.waiter
        if w is not None and not w.done():
            self.error = error
            w.set_result(None)

    # -- use ------------------------------------------------------------------------------------
    async def send(self, raw: bytes, parser: ResponseParser) -> str | None:
        """Write the request and wait for the end of the response; returns an error or None."""
        self.parser = parser
        self.error = None
        self.waiter = asyncio.get_running_loop().create_future()
        assert self.transport is not None            # connected: connect() returns after connection_made
        self.transport.write(raw)
        await self.waiter
        if not parser.keep_alive:
            self.close()
        return self.error

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


async def connect(ep: Endpoint, timeout: float = 10.0) -> Connection:
    loop = asyncio.get_running_loop()
    ctx = _ssl.create_default_context() if ep.scheme == "https" else None
    _, conn = await asyncio.wait_for(
        loop.create_connection(Connection, ep.host, ep.port, ssl=ctx), timeout)
    return conn


class Session:
    """Plain (non-streaming) requests over one keep-alive connection, reconnecting when the server
    closes it: /metrics, /v1/models, /version, and the many small /tokenize calls of prompt sizing.

        async with Session(ep, api_key) as s:
            status, body = await s.request("POST", "/tokenize", {"prompt": "..."})
    """

    def __init__(self, ep: Endpoint, api_key: str | None = None, timeout: float = 10.0):
        self.ep, self.api_key, self.timeout = ep, api_key, timeout
        self.conn: Connection | None = None

    async def request(self, method: str, path: str, obj=None, close: bool = False) -> tuple[int, bytes]:
        """(status, body); path is below the endpoint's prefix; obj is sent as a JSON body."""
        import json

        ep = self.ep
        body = b"" if obj is None else json.dumps(obj).encode()
        head = [f"{method} {ep.prefix}{path} HTTP/1.1", f"Host: {ep.host_header}", "Accept: */*",
                "User-Agent: vllm-orch-bench"]
        if obj is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        if self.api_key:
            head.append(f"Authorization: Bearer {self.api_key}")
        if close:
            head.append("Connection: close")
        raw = ("\r\n".join(head) + "\r\n\r\n").encode() + body
        if self.conn is None or self.conn.closed:
            self.conn = await connect(ep, self.timeout)
        parser = ResponseParser()
        try:
            err = await asyncio.wait_for(self.conn.send(raw, parser), self.timeout)
        except BaseException:
            self.close()
            raise
        if err and not parser.complete:
            self.close()
            raise ConnectionError(err)
        return parser.status, bytes(parser.body)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


async def http_get(ep: Endpoint, path: str, timeout: float = 10.0,
                   api_key: str | None = None) -> tuple[int, bytes]:
    """A one-off GET (for /metrics, /v1/models, /version); returns (status, body)."""
    async with Session(ep, api_key, timeout) as s:
        return await s.request("GET", path, close=True)
