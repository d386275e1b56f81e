#!/usr/bin/env python3
"""Serve one verified model folder to the other hosts of a fleet, for download once per fleet. Runs
ON THE HOST that holds it (stdlib only, Python >= 3.9), started by vllm-orch and ended by it: it
exits when its stdin closes (vllm-orch closes it, or the SSH connection that started it drops).

    python serve_weights.py '{"dir": D, "bind": ADDR, "token_file": F, "rate_bps": N}'

Prints one JSON line {"event": "listening", "port": P} (stdout), then serves
GET /<file> (and `Range: bytes=N-`) with `Authorization: Bearer <token>` (the token file, removed
once read) for the files of D's complete .vllm-orch/verified.json only: nothing else of the host,
no listing, no link followed (O_NOFOLLOW, every part of the path a real folder). What the other host
receives is not trusted for being ours: its download checks every file's sha256 against the Hub's own
listing and fetches from the Hub what differs. `rate_bps`: at most this many bytes per second over
all clients (the LAN the host's service also answers on); 0: unlimited.
"""

from __future__ import annotations

import hmac
import json
import os
import stat
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CHUNK = 1 << 20
RECORD = os.path.join(".vllm-orch", "verified.json")


class Bucket:
    """A token bucket shared by every connection: `rate` bytes per second (0: no limit)."""

    def __init__(self, rate: int):
        self.rate, self.lock, self.free_at = rate, threading.Lock(), time.monotonic()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self.lock:
            now = time.monotonic()
            self.free_at = max(self.free_at, now) + n / self.rate
            wait = self.free_at - now - n / self.rate
        if wait > 0:
            time.sleep(wait)


def served_files(folder: str) -> dict:
    """name -> size of the files the folder's complete record lists (else {}: nothing is served)."""
    try:
        fd = os.open(os.path.join(folder, RECORD), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd) as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return {}
            rec = json.loads(f.read(64 << 20))
    except (OSError, ValueError):
        return {}
    if not isinstance(rec, dict) or not rec.get("complete") or not isinstance(rec.get("files"), dict):
        return {}
    out = {}
    for name, entry in rec["files"].items():
        parts = name.split("/") if isinstance(name, str) else [""]
        if any(p in ("", ".", "..") for p in parts) or name.startswith((".vllm-orch/", ".cache/")):
            continue
        if isinstance(entry, dict) and isinstance(entry.get("size"), int):
            out[name] = entry["size"]
    return out


def open_inside(folder: str, name: str) -> int:
    """An fd of folder/name, every part a real folder, the file itself not a link."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        parts = name.split("/")
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)


def handler(folder: str, files: dict, token: str, bucket: Bucket):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):   # requests are not logged: a path names a model's file only
            pass

        def _fail(self, code: int, text: str) -> None:
            body = (text + "\n").encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802 - http.server's name
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), ("Bearer " + token).encode()):
                return self._fail(401, "unauthorized")
            name = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path.lstrip("/"))
            if name not in files:
                return self._fail(404, "not served")
            start = 0
            ranged = self.headers.get("Range", "")
            if ranged.startswith("bytes=") and ranged.endswith("-") and ranged[6:-1].isdigit():
                start = int(ranged[6:-1])
            try:
                fd = open_inside(folder, name)
            except OSError:
                return self._fail(404, "not served")
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_size != files[name]:
                    return self._fail(409, "changed since it was verified")
                if start > st.st_size:
                    return self._fail(416, "range not satisfiable")
                self.send_response(206 if start else 200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(st.st_size - start))
                if start:
                    self.send_header("Content-Range", "bytes %d-%d/%d" % (start, st.st_size - 1, st.st_size))
                self.end_headers()
                f.seek(start)
                for block in iter(lambda: f.read(CHUNK), b""):
                    bucket.take(len(block))
                    self.wfile.write(block)

    return Handler


def main(argv: list) -> int:
    try:
        args = json.loads(argv[1])
        folder, bind = args["dir"], args.get("bind") or "0.0.0.0"
        with open(args["token_file"]) as f:
            token = f.read().strip()
        os.unlink(args["token_file"])
    except (IndexError, KeyError, ValueError, OSError) as exc:
        print(json.dumps({"event": "error", "message": "bad request: %s" % exc}), flush=True)
        return 2
    files = served_files(folder)
    if not files or len(token) < 32:
        print(json.dumps({"event": "error", "message": "%s holds no complete verified record" % folder}), flush=True)
        return 1
    server = ThreadingHTTPServer((bind, 0), handler(folder, files, token, Bucket(int(args.get("rate_bps") or 0))))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(json.dumps({"event": "listening", "port": server.server_address[1], "files": len(files)}), flush=True)
    try:
        while sys.stdin.readline():      # a heartbeat line, or EOF: vllm-orch is done (or gone)
            pass
    except KeyboardInterrupt:
        pass
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
