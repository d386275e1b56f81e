"""The SIMULATED Hugging Face Hub mirror: stdlib HTTP serving the synthetic repos to the real
huggingface_hub client (point HF_ENDPOINT at it).

    python -m orchestrator.sim.hub --host-dir DIR --port 0 --bind 127.0.0.1 [--scale N]
        [--models-dir models/] [--revision REPO@REV ...] [--token-file F] [--page-size N]

Writes the bound port to <hostdir>/hub.port once listening; serves until SIGTERM. Every request is
logged as one JSON line in <hostdir>/hub-requests.jsonl (method, path, status, range, body bytes
sent, fault) - tests count GETs and bytes from it.

What the client sees (huggingface_hub 2.x, checked against its source):
- GET /api/models/{repo}[/revision/{rev}] (?blobs=true adds size, blobId, lfs{size,sha256,pointerSize})
- GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=&expand= paginated with a Link rel="next"
  header (1000 entries per page, 50 with expand, like the Hub)
- POST /api/models/{repo}/paths-info/{rev} (form or JSON: paths, expand)
- HEAD/GET /{repo}/resolve/{rev}/{path}: 200 (206 for a Range) with ETag, X-Linked-Etag and
  X-Linked-Size (LFS files), X-Repo-Commit, Content-Length, Accept-Ranges. LFS files are served
  directly rather than redirected to a CDN, and no X-Xet-Hash / xetHash is ever sent, so the client
  takes its plain HTTP path.
- Errors with the real X-Error-Code the client maps to exceptions: RepoNotFound (404),
  RevisionNotFound (404), EntryNotFound (404, with X-Repo-Commit), GatedRepo (401 without a token,
  403 with a token that is not the accepted one).
Faults (from <hostdir>/faults.json, see fault_file.py), checked on each /resolve request:
  hub-5xx (one 503), hub-drop (close the connection half way through one LFS body),
  hub-corrupt (flip bytes in one .safetensors body), hub-slow (throttle bodies to `rate_bps`,
  default 2 MB/s; NOT consumed: it lasts until cleared, like a slow link). An entry may add
  "file": GLOB to hit only matching paths (tests use it to drop one chosen shard).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import signal
import socket
import sys
import threading
import time
from base64 import urlsafe_b64decode, urlsafe_b64encode
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

from orchestrator.sim import fault_file
from orchestrator.sim.repos import DEFAULT_SCALE, Catalog, Repo, model_repos_from_manifests, revisions_from_manifests

SIM_TOKEN = "hf_vllmorchSIMULATEDgatedToken0000"   # accepted for gated repos unless --token-file
PORT_FILE = "hub.port"
REQUEST_LOG = "hub-requests.jsonl"
LOG_FILE = "hub.log"
DATE = "2026-01-27T00:00:00.000Z"
SLOW_DEFAULT_BPS = 2_000_000
CHUNK = 1 << 20


class HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


class HubState:
    """Everything a request handler needs; one per mirror."""

    def __init__(self, hostdir: Path, catalog: Catalog, token: str, model_repos: dict[str, str],
                 page_size: int = 1000):
        self.hostdir = hostdir
        self.catalog = catalog
        self.token = token
        self.model_repos = model_repos
        self.page_size = page_size
        self._log_lock = threading.Lock()

    def log(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._log_lock, open(self.hostdir / REQUEST_LOG, "a") as f:
            f.write(line)

    def fault_matches(self, entry: dict, name: str, repo_id: str, path: str = "") -> bool:
        if entry.get("fault") != name:
            return False
        if entry.get("file") and not fnmatch.fnmatch(path, entry["file"]):
            return False
        model = entry.get("model")
        return (model is None or model == repo_id or str(model).lower() == repo_id.split("/")[-1].lower()
                or self.model_repos.get(model) == repo_id)

    def take(self, name: str, repo_id: str, path: str = "", consume: bool = True) -> dict | None:
        return fault_file.take_fault(self.hostdir, lambda e: self.fault_matches(e, name, repo_id, path),
                                     consume=consume)


def parse_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """(start, end_exclusive) for a single 'bytes=' range; None = whole file; 'bad' = 416."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    spec = header[6:].strip()
    start_s, _, end_s = spec.partition("-")
    try:
        if start_s == "":
            n = int(end_s)
            return (max(0, size - n), size) if n > 0 else "bad"
        start = int(start_s)
        end = int(end_s) + 1 if end_s else size
    except ValueError:
        return None
    if start >= size or end <= start:
        return "bad"
    return start, min(end, size)


class HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "vllm-orch-sim-hub/1.0"
    state: HubState   # set on the subclass made by make_server

    # -- plumbing ----------------------------------------------------------------------------------
    def log_message(self, fmt: str, *args) -> None:   # the JSON request log replaces stderr noise
        pass

    def _segments(self) -> tuple[list[str], dict[str, list[str]]]:
        parts = urlsplit(self.path)
        raw = [s for s in parts.path.split("/") if s != ""]
        return raw, parse_qs(parts.query)

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth[7:].strip() if auth.lower().startswith("bearer ") else None

    def _send(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)
        self._record(status, len(body) if self.command != "HEAD" else 0)

    def _json(self, obj, status: int = 200, extra: dict[str, str] | None = None) -> None:
        body = json.dumps(obj).encode()
        self._send(status, {"Content-Type": "application/json; charset=utf-8", **(extra or {})}, body)

    def _error(self, err: HubError) -> None:
        headers = {"X-Error-Message": err.message, "Content-Type": "application/json; charset=utf-8"}
        if err.code:
            headers["X-Error-Code"] = err.code
        if err.commit:
            headers["X-Repo-Commit"] = err.commit
        body = json.dumps({"error": err.message}).encode()
        self._send(err.status, headers, body)

    def _record(self, status: int, sent: int, fault: str | None = None) -> None:
        self.state.log({"t": round(time.time(), 3), "method": self.command, "path": urlsplit(self.path).path,
                        "status": status, "range": self.headers.get("Range"), "bytes": sent, "fault": fault})

    def _repo(self, org: str, name: str) -> Repo:
        repo = self.state.catalog.repo(f"{org}/{name}")
        if repo is None:
            raise HubError(404, "RepoNotFound", "Repository not found")
        return repo

    def _commit(self, repo: Repo, rev: str) -> str:
        commit = self.state.catalog.resolve(repo.repo_id, rev)
        if commit is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return commit

    def _check_gate(self, repo: Repo) -> None:
        if not repo.gated:
            return
        token = self._token()
        if token is None:
            raise HubError(401, "GatedRepo",
                           f"Access to model {repo.repo_id} is restricted. You must have access to it and "
                           "be authenticated to access it. Please log in.")
        if token != self.state.token:
            raise HubError(403, "GatedRepo",
                           f"Access to model {repo.repo_id} is restricted and you are not in the authorized "
                           f"list. Visit https://huggingface.co/{repo.repo_id} to ask for access.")

    # -- verbs -------------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        try:
            seg, query = self._segments()
            if len(seg) >= 3 and seg[0] == "api" and seg[1] == "models":
                self._api(seg[2:], query)
            elif len(seg) >= 5 and seg[2] == "resolve" and self.command in ("GET", "HEAD"):
                self._resolve(seg[0], seg[1], unquote(seg[3]), unquote("/".join(seg[4:])))
            else:
                raise HubError(404, None, "Not Found")
        except HubError as err:
            self._error(err)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    # -- /api/models ------------------------------------------------------------------------------
    def _api(self, seg: list[str], query: dict[str, list[str]]) -> None:
        if len(seg) < 2:
            raise HubError(404, None, "Not Found")
        repo = self._repo(seg[0], seg[1])
        rest = seg[2:]
        if self.command == "POST":
            if len(rest) == 2 and rest[0] == "paths-info":
                return self._paths_info(repo, self._commit(repo, unquote(rest[1])))
            raise HubError(404, None, "Not Found")
        if not rest:
            return self._info(repo, repo.commit, query)
        if rest[0] == "revision" and len(rest) == 2:
            return self._info(repo, self._commit(repo, unquote(rest[1])), query)
        if rest[0] == "tree" and len(rest) >= 2:
            path = unquote("/".join(rest[2:])).strip("/")
            return self._tree(repo, self._commit(repo, unquote(rest[1])), path, query)
        raise HubError(404, None, "Not Found")

    def _info(self, repo: Repo, commit: str, query: dict[str, list[str]]) -> None:
        blobs = _truthy(query.get("blobs"))
        cfg = repo.spec.config
        self._json({
            "_id": commit[:24], "id": repo.repo_id, "modelId": repo.repo_id,
            "author": repo.repo_id.split("/")[0], "sha": commit, "lastModified": DATE, "createdAt": DATE,
            "private": False, "gated": "manual" if repo.gated else False, "disabled": False,
            "downloads": 0, "likes": 0, "library_name": "transformers",
            "tags": ["transformers", "safetensors", cfg.get("model_type", ""), "simulated"],
            "pipeline_tag": "text-generation",
            "config": {"architectures": cfg.get("architectures"), "model_type": cfg.get("model_type")},
            "cardData": {"license": "other", "simulated": True},
            "siblings": [f.sibling(blobs) for f in repo.files.values()],
            "spaces": [], "usedStorage": repo.total_bytes,
        })

    def _entries(self, repo: Repo, commit: str, path: str, recursive: bool, expand: bool) -> list[dict]:
        folders = repo.folders()
        if path and path not in folders:
            if path in repo.files:
                raise HubError(404, "EntryNotFound", f"{path} is not a directory", commit)
            raise HubError(404, "EntryNotFound", f"Entry not found: {path}", commit)
        prefix = path + "/" if path else ""

        def wanted(p: str) -> bool:
            if not p.startswith(prefix):
                return False
            return recursive or "/" not in p[len(prefix):]

        out = [self._folder_entry(repo, commit, f, expand) for f in folders if wanted(f)]
        out += [self._file_entry(f, commit, expand) for p, f in repo.files.items() if wanted(p)]
        return out

    @staticmethod
    def _last_commit(commit: str) -> dict:
        return {"id": commit, "title": "Upload folder using huggingface_hub", "date": DATE}

    def _folder_entry(self, repo: Repo, commit: str, folder: str, expand: bool) -> dict:
        entry = {"type": "directory", "oid": repo.folder_oid(folder), "size": 0, "path": folder}
        if expand:
            entry["lastCommit"] = self._last_commit(commit)
        return entry

    def _file_entry(self, f, commit: str, expand: bool) -> dict:
        entry = f.tree_entry()
        if expand:
            entry["lastCommit"] = self._last_commit(commit)
            entry["securityFileStatus"] = {"status": "safe", "avScan": {"virusFound": False, "virusNames": None},
                                           "pickleImportScan": None}
        return entry

    def _tree(self, repo: Repo, commit: str, path: str, query: dict[str, list[str]]) -> None:
        recursive, expand = _truthy(query.get("recursive")), _truthy(query.get("expand"))
        entries = self._entries(repo, commit, path, recursive, expand)
        page = max(1, self.state.page_size if not expand else min(50, self.state.page_size))
        start = 0
        if query.get("cursor"):
            try:
                start = int(urlsafe_b64decode(query["cursor"][0].encode()).decode())
            except ValueError:
                raise HubError(400, None, "Invalid cursor") from None
        chunk = entries[start:start + page]
        extra = {}
        if start + page < len(entries):
            cursor = urlsafe_b64encode(str(start + page).encode()).decode()
            host = self.headers.get("Host")
            if not host:
                addr = self.server.server_address
                assert isinstance(addr, tuple)      # an IP server: (host, port)
                host = f"127.0.0.1:{addr[1]}"
            base = f"http://{host}{urlsplit(self.path).path}"
            nxt = (f"{base}?recursive={str(recursive).lower()}&expand={str(expand).lower()}"
                   f"&cursor={quote(cursor)}")
            extra["Link"] = f'<{nxt}>; rel="next"'
        self._json(chunk, extra=extra)

    def _paths_info(self, repo: Repo, commit: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length).decode() if length else ""
        if "json" in (self.headers.get("Content-Type") or ""):
            data = json.loads(raw or "{}")
            paths, expand = data.get("paths", []), bool(data.get("expand"))
        else:
            form = parse_qs(raw)
            paths, expand = form.get("paths", []), _truthy(form.get("expand"))
        folders = set(repo.folders())
        out = []
        for p in paths:
            p = p.strip("/")
            if p in repo.files:
                out.append(self._file_entry(repo.files[p], commit, expand))
            elif p in folders:
                out.append(self._folder_entry(repo, commit, p, expand))
        self._json(out)

    # -- /{repo}/resolve/{rev}/{path} -------------------------------------------------------------
    def _resolve(self, org: str, name: str, rev: str, path: str) -> None:
        repo = self._repo(org, name)
        commit = self._commit(repo, rev)
        self._check_gate(repo)
        f = repo.files.get(path)
        if f is None:
            raise HubError(404, "EntryNotFound", f"Entry not found: {path}", commit)
        state = self.state
        if state.take("hub-5xx", repo.repo_id, path):
            self.close_connection = True
            body = b'{"error":"Service Unavailable (SIMULATED hub-5xx)"}'
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Retry-After", "0")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            self._record(503, 0, "hub-5xx")
            return
        headers = {
            "Content-Type": "application/octet-stream",
            "ETag": f'"{f.etag}"',
            "X-Repo-Commit": commit,
            "Accept-Ranges": "bytes",
            "Content-Disposition": f"inline; filename*=UTF-8''{quote(path.split('/')[-1])}; "
                                   f'filename="{path.split("/")[-1]}";',
        }
        if f.lfs:
            headers["X-Linked-Etag"] = f'"{f.sha256}"'
            headers["X-Linked-Size"] = str(f.size)
        rng = parse_range(self.headers.get("Range"), f.size)
        if isinstance(rng, str):        # "bad"
            self._send(416, {"Content-Range": f"bytes */{f.size}", **headers})
            return
        start, end = rng if rng else (0, f.size)
        status = 206 if rng else 200
        if rng:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{f.size}"
        headers["Content-Length"] = str(end - start)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command == "HEAD":
            self._record(status, 0)
            return
        self._body(repo, f, start, end, status)

    def _body(self, repo: Repo, f, start: int, end: int, status: int) -> None:
        state = self.state
        fault = None
        drop_at = corrupt_at = None
        if f.lfs and end - start >= 2 and state.take("hub-drop", repo.repo_id, f.path):
            fault, drop_at = "hub-drop", start + (end - start) // 2
        elif f.path.endswith(".safetensors") and state.take("hub-corrupt", repo.repo_id, f.path):
            fault, corrupt_at = "hub-corrupt", start + (end - start) // 2
        slow = state.take("hub-slow", repo.repo_id, f.path, consume=False)
        rate = float(slow.get("rate_bps") or SLOW_DEFAULT_BPS) if slow else None
        if slow and not fault:
            fault = "hub-slow"
        sent = 0
        began = time.monotonic()
        chunk = 64 * 1024 if rate else CHUNK
        try:
            for piece in f.iter_bytes(start, drop_at if drop_at is not None else end, chunk):
                pos = start + sent
                if corrupt_at is not None and pos <= corrupt_at < pos + len(piece):
                    i = corrupt_at - pos
                    piece = piece[:i] + bytes(b ^ 0xFF for b in piece[i:i + 16]) + piece[i + 16:]
                self.wfile.write(piece)
                sent += len(piece)
                if rate:
                    ahead = sent / rate - (time.monotonic() - began)
                    if ahead > 0:
                        time.sleep(ahead)
            if drop_at is not None:
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        self._record(status, sent, fault)


def _truthy(values: list[str] | None) -> bool:
    return values is not None and len(values) > 0 and values[0].lower() in ("1", "true", "yes")


class HubServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64
    state: HubState   # set by make_server


def make_server(hostdir: str | Path, *, port: int = 0, bind: str = "127.0.0.1", scale: int = DEFAULT_SCALE,
                revisions: Sequence[tuple[str, str]] = (), model_repos: dict[str, str] | None = None,
                token: str = SIM_TOKEN, page_size: int = 1000) -> HubServer:
    """A bound (not yet serving) mirror; tests may run it in a thread, `main` runs it as a process."""
    hostdir = Path(hostdir)
    hostdir.mkdir(parents=True, exist_ok=True)
    state = HubState(hostdir, Catalog(scale, revisions), token, dict(model_repos or {}), page_size)
    handler = type("BoundHubHandler", (HubHandler,), {"state": state})
    server = HubServer((bind, port), handler)
    server.state = state
    return server


def write_port(hostdir: Path, port: int) -> None:
    tmp = hostdir / f".{PORT_FILE}.tmp"
    tmp.write_text(f"{port}\n")
    os.replace(tmp, hostdir / PORT_FILE)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.sim.hub",
                                 description="SIMULATED Hugging Face Hub mirror (synthetic repos).")
    ap.add_argument("--host-dir", required=True, type=Path)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--bind", default="127.0.0.1")
    ap.add_argument("--scale", type=int, default=DEFAULT_SCALE)
    ap.add_argument("--models-dir", type=Path, default=None,
                    help="manifests whose source.repo@source.revision must resolve (default: shipped models/)")
    ap.add_argument("--revision", action="append", default=[], metavar="REPO@REV",
                    help="an extra revision that resolves (repeatable)")
    ap.add_argument("--token-file", type=Path, default=None,
                    help="file holding the token accepted for gated repos (default: the built-in sim token)")
    ap.add_argument("--page-size", type=int, default=1000)
    args = ap.parse_args(argv)

    models_dir = args.models_dir
    if models_dir is None:
        from orchestrator.paths import shipped_dir
        models_dir = shipped_dir("models")
    revisions = revisions_from_manifests(models_dir) if models_dir.is_dir() else []
    model_repos = model_repos_from_manifests(models_dir) if models_dir.is_dir() else {}
    for item in args.revision:
        repo, _, rev = item.rpartition("@")
        if repo and rev:
            revisions.append((repo, rev))
    token = args.token_file.read_text().strip() if args.token_file else SIM_TOKEN

    server = make_server(args.host_dir, port=args.port, bind=args.bind, scale=args.scale,
                         revisions=revisions, model_repos=model_repos, token=token, page_size=args.page_size)
    hostdir = args.host_dir

    def stop(signum, frame):
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    port = server.server_address[1]
    with open(hostdir / LOG_FILE, "a") as log:
        log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} SIMULATED hub mirror pid {os.getpid()} listening on "
                  f"http://{args.bind}:{port} scale {args.scale} repos {', '.join(server.state.catalog.repo_ids())}\n")
    write_port(hostdir, port)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        try:
            if (hostdir / PORT_FILE).read_text().strip() == str(port):
                (hostdir / PORT_FILE).unlink()
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
