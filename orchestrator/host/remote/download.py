#!/usr/bin/env python3
"""Download a pinned Hugging Face repo into a local folder, verified, resumable. Runs ON THE HOST with
the host's Python (a vLLM venv has huggingface_hub): Python >= 3.9, huggingface_hub + stdlib only.

    python download.py --repo R --revision REV --local-dir D [--allow P ...] [--ignore P ...]
                       [--workers 8] [--plan-only] [--commit SHA] [--token-file PATH]

--commit: download exactly this commit, the one the plan showed (a branch such as `main` can move
between a plan and its apply; the record still names --revision, and the commit it holds).

Token: HF_TOKEN from the environment, or --token-file (never printed, never on the command line).
stdout carries JSON lines only (stderr is free text):
  {"event":"plan","repo","revision","commit","files","total_bytes","have_bytes","to_fetch_bytes",
   "partial_bytes","to_fetch":[...]}                               (--plan-only stops here)
  {"event":"progress","file","done","size"}                        (<= ~4/s per file)
  {"event":"file","file","size","sha256","status":"ok|refetched|skipped"}
  {"event":"error","kind":"auth|not_found|network|checksum|disk|unsafe","message"[,"file"]}
  {"event":"done","verified":true,"bytes","seconds","files","total_bytes","commit"}
Exit status: 0 done, 1 error (an error event was printed), 2 bad arguments.

Why not snapshot_download: it gives no sha256 check of what was streamed (the Hub's sha256 is only
compared when metadata is missing, and by re-reading the file), no resume across runs in 2.x (each
try is a fresh temporary file), and no machine-readable progress. huggingface_hub is still used for
what it does well: metadata at the pinned revision (model_info(files_metadata=True)), the allow/
ignore filtering (filter_repo_objects), file URLs (hf_hub_url) and headers (build_hf_headers).
Bytes are streamed with urllib so that every shard's sha256 is computed while it arrives, a
partial file resumes with a Range request, and a stall (no byte for --stall-timeout s) is retried.

What "have" means: listed in <local_dir>/.vllm-orch/verified.json with the hub's size and sha256
(git oid for small files) and the file's current size and mtime. Such files are never read again.
Partial data lives in <local_dir>/.cache/huggingface/download/<file>.<etag>.incomplete.

File names from the Hub are untrusted (a compromised mirror behind HF_ENDPOINT is enough, and this
runs as root): a listing with an absolute name, a `..`, `.` or empty part, a backslash, a control
character, or a name inside our bookkeeping folders (.vllm-orch/, .cache/) is refused before
anything is written (kind "unsafe"). Every folder on the way to a file is created here one part at
a time and must be a real folder inside the model folder (a symlink planted in it is refused), and
files are opened with O_NOFOLLOW: nothing is ever written through a link.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import socket
import stat
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import datetime, timezone
from http.client import HTTPException
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

CHUNK = 1 << 20
PROGRESS_INTERVAL = 0.25
RECORD_DIR = ".vllm-orch"
RECORD_FILE = "verified.json"
PARTIAL_DIR = os.path.join(".cache", "huggingface", "download")
BOOKKEEPING = (RECORD_DIR, ".cache")       # ours and huggingface_hub's: never a repo file's place
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

_emit_lock = threading.Lock()
_secrets: list = []


def emit(event: str, **fields) -> None:
    """One JSON line on stdout. Any secret value is replaced by *** (defence in depth)."""
    line = json.dumps(dict(event=event, **fields), separators=(",", ":"))
    for s in _secrets:
        line = line.replace(s, "***")
    with _emit_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class Fail(Exception):
    """A classified, user-facing failure: kind is auth|not_found|network|checksum|disk."""

    def __init__(self, kind: str, message: str, file: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.file = kind, message, file


class Aborted(Exception):
    """Another file failed: stop this one, keep its partial data for the next run."""


# -- names and paths: nothing outside the model folder, nothing through a link ----------------------
def unsafe_name(name) -> str | None:
    """Why a Hub file name cannot be written under the model folder, or None."""
    if not isinstance(name, str) or not name:
        return "an empty name"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "a control character"
    if "\\" in name:
        return "a backslash"
    if name.startswith("/"):
        return "an absolute name"
    parts = name.split("/")
    if ".." in parts:
        return "a `..` part"
    if "." in parts:
        return "a `.` part"
    if "" in parts:
        return "an empty part"
    if parts[0] in BOOKKEEPING:
        return "inside the bookkeeping folder %s/" % parts[0]
    return None


_HEX = re.compile(r"^[0-9a-f]+$")
# The lengths the Hub's hashes have: an LFS file's sha256, a git blob id (sha1, or sha256 in a
# sha256 repository). They name partial files (partial_path): anything else could be a path.
HASH_LENGTHS = {"sha256": (64,), "blob_id": (40, 64)}


def unsafe_hash(f: dict) -> str | None:
    """Why a listed file's sha256 / blob_id is not a hash the Hub would send, or None (absent is fine)."""
    for key, lengths in HASH_LENGTHS.items():
        value = f.get(key)
        if value is not None and not (isinstance(value, str) and len(value) in lengths and _HEX.match(value)):
            return "%s %r is not %s hex digits" % (key, value, " or ".join(str(n) for n in lengths))
    return None


def check_names(files: list) -> None:
    """Every listed name and hash is safe to become a path under the model folder, or Fail("unsafe")."""
    bad = [(f["name"], unsafe_name(f["name"])) for f in files]
    bad = [(n, why) for n, why in bad if why]
    if bad:
        shown = "; ".join("%r (%s)" % (n, why) for n, why in bad[:4])
        raise Fail("unsafe", "the hub lists %d file names that would be written outside the model folder or "
                             "over vllm-orch's records: %s%s" % (len(bad), shown, " ..." if len(bad) > 4 else ""))
    hashes = [(f["name"], unsafe_hash(f)) for f in files]
    hashes = [(n, why) for n, why in hashes if why]
    if hashes:
        shown = "; ".join("%s: %s" % (n, why) for n, why in hashes[:4])
        raise Fail("unsafe", "the hub lists %d files with hashes that are not hashes (they name partial files, "
                             "so they could lead outside the model folder): %s%s"
                   % (len(hashes), shown, " ..." if len(hashes) > 4 else ""))


def safe_dir(local_dir: Path, rel: str) -> Path:
    """local_dir/rel as a real folder, created one part at a time: each existing part must be a
    folder and not a symlink, so the path cannot lead outside the model folder. The model folder
    itself may be a link (an admin's choice, e.g. onto another disk)."""
    os.makedirs(str(local_dir), 0o755, exist_ok=True)
    path = local_dir
    for part in [p for p in rel.split("/") if p]:
        path = path / part
        try:
            st = os.lstat(str(path))
        except FileNotFoundError:
            try:
                os.mkdir(str(path), 0o755)
            except FileExistsError:
                pass
            st = os.lstat(str(path))
        except OSError as exc:
            raise Fail("disk", "cannot read %s: %s" % (path, exc))
        if stat.S_ISLNK(st.st_mode):
            raise Fail("unsafe", "%s is a symlink: refusing to write through it (who planted it?)" % path)
        if not stat.S_ISDIR(st.st_mode):
            raise Fail("unsafe", "%s is not a folder" % path)
    return path


def open_nofollow(path: Path, flags: int, mode: int = 0o644):
    """os.open that never follows a symlink at the last part (ELOOP instead)."""
    return os.open(str(path), flags | NOFOLLOW, mode)


def parent_of(name: str) -> str:
    return name.rsplit("/", 1)[0] if "/" in name else ""


# -- metadata --------------------------------------------------------------------------------------
def classify_hub_error(exc: BaseException) -> Fail | None:
    """Map huggingface_hub / HTTP exceptions to our kinds; None = transient (retry)."""
    try:
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            HfHubHTTPError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:   # huggingface_hub < 0.24
        from huggingface_hub.utils import (
            EntryNotFoundError,
            GatedRepoError,
            HfHubHTTPError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    first = " ".join(lines[:2]) if lines else type(exc).__name__
    if isinstance(exc, GatedRepoError):
        return Fail("auth", "gated repo: the token is missing or has no access (" + first + ")")
    if isinstance(exc, RevisionNotFoundError):
        return Fail("not_found", "revision not found: " + first)
    if isinstance(exc, RepositoryNotFoundError):
        return Fail("not_found", "repository not found (or private without a valid token): " + first)
    if isinstance(exc, EntryNotFoundError):
        return Fail("not_found", first)
    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            return Fail("auth", first)
        if status is not None and (status >= 500 or status in (408, 429)):
            return None
        return Fail("network", first)
    return None


def fetch_metadata(repo: str, revision: str, token: str | None, endpoint: str | None,
                   retries: int, backoff: float) -> tuple:
    """(commit, [file dicts]) at the pinned revision, from one model_info(files_metadata=True)."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token, library_name="vllm-orch")
    attempt = 0
    while True:
        try:
            info = api.model_info(repo, revision=revision, files_metadata=True)
            break
        except Exception as exc:  # noqa: BLE001 - classified below
            fail = classify_hub_error(exc)
            if fail is not None:
                fail.message = "%s@%s: %s" % (repo, revision, fail.message)
                raise fail
            attempt += 1
            if attempt > retries:
                raise Fail("network", "cannot reach the hub: %s: %s" % (type(exc).__name__, exc))
            time.sleep(min(30.0, backoff * 2 ** (attempt - 1)))
    files = []
    for s in info.siblings or []:
        lfs = s.lfs
        files.append({
            "name": s.rfilename,
            "size": s.size if s.size is not None else (lfs.size if lfs else None),
            "sha256": (lfs.sha256 if hasattr(lfs, "sha256") else lfs["sha256"]) if lfs else None,
            "blob_id": s.blob_id,
            "lfs": lfs is not None,
        })
    return info.sha, files


def select(files: list, allow: list | None, ignore: list | None) -> list:
    """The same filtering as snapshot_download (fnmatch, a trailing '/' means the whole folder)."""
    from huggingface_hub.utils import filter_repo_objects

    return list(filter_repo_objects(files, allow_patterns=allow or None, ignore_patterns=ignore or None,
                                    key=lambda f: f["name"]))


# -- our record ------------------------------------------------------------------------------------
class Record:
    """<local_dir>/.vllm-orch/verified.json, updated as files are verified (atomic replace), so an
    interrupted run keeps the files it finished. A big file is recorded at once; small ones at most
    once a second (and on every way out but SIGKILL): each save writes the whole record, and a repo
    of many small files rewrote it once per file. A kill loses at most a second of small files."""

    SAVE_AT_ONCE_BYTES = 64 << 20
    SAVE_EVERY_S = 1.0

    def __init__(self, local_dir: Path, repo: str, revision: str, commit: str):
        self.path = local_dir / RECORD_DIR / RECORD_FILE
        self.lock = threading.Lock()
        data = {}
        try:
            fd = open_nofollow(self.path, os.O_RDONLY)
            with os.fdopen(fd, "rb") as f:
                data = json.loads(f.read().decode())
        except (OSError, ValueError):
            pass
        files = data.get("files") if isinstance(data, dict) and data.get("repo") == repo else None
        self.data: dict[str, Any] = {"repo": repo, "revision": revision, "commit": commit, "complete": False,
                                     "files": files if isinstance(files, dict) else {}, "total_bytes": 0, "verified_at": None}
        self.saved_at, self.dirty = 0.0, False

    def verified(self, local_dir: Path, f: dict) -> bool:
        """Present and verified: recorded with the hub's size/hash, same size and mtime on disk."""
        entry = self.data["files"].get(f["name"])
        if not entry or entry.get("size") != f["size"]:
            return False
        if f["lfs"]:
            if not f["sha256"] or entry.get("sha256") != f["sha256"]:
                return False
        elif f["blob_id"] and entry.get("blob_id") != f["blob_id"]:
            return False
        try:
            st = os.lstat(str(local_dir / f["name"]))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == f["size"] and st.st_mtime_ns == entry.get("mtime_ns")

    def add(self, name: str, entry: dict) -> None:
        with self.lock:
            self.data["files"][name] = entry
            if entry.get("size", 0) >= self.SAVE_AT_ONCE_BYTES or time.monotonic() - self.saved_at >= self.SAVE_EVERY_S:
                self._save()
            else:
                self.dirty = True

    def save(self) -> None:
        with self.lock:
            self._save()

    def flush(self) -> None:
        """What add() has not written yet (a failed or interrupted run keeps its finished files)."""
        with self.lock:
            if self.dirty:
                self._save()

    def finish(self, selected: list, allow: list, ignore: list) -> None:
        """Complete for this selection: the patterns are kept, so another manifest of the same
        commit with other patterns (a shared checkpoint) is planned against the Hub, not trusted."""
        with self.lock:
            self.data["complete"] = True
            self.data["patterns"] = {"allow": list(allow), "ignore": list(ignore)}
            self.data["total_bytes"] = sum(f["size"] for f in selected)
            self.data["verified_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            self._save()

    def _save(self) -> None:
        folder = safe_dir(self.path.parent.parent, RECORD_DIR)
        tmp = folder / (".%s.%d.tmp" % (RECORD_FILE, os.getpid()))
        try:
            os.unlink(str(tmp))                   # a leftover of a killed run with our PID
        except FileNotFoundError:
            pass
        fd = open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.data, indent=1, sort_keys=True) + "\n")
        os.replace(str(tmp), str(self.path))
        self.saved_at, self.dirty = time.monotonic(), False


# -- streaming -------------------------------------------------------------------------------------
class _Redirect(urllib.request.HTTPRedirectHandler):
    """Follow redirects, but never send the token to another host (a CDN's signed URL)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urlsplit(newurl).netloc != urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")
        return new


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A fleet peer answers itself: a redirect from it is refused (its token goes nowhere else)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class Hashers:
    """sha256 of the content, plus the git blob sha1 for small (non-LFS) files."""

    def __init__(self, f: dict):
        self.sha256 = hashlib.sha256()
        self.git = None if f["lfs"] else hashlib.sha1(b"blob %d\0" % f["size"])

    def update(self, data: bytes) -> None:
        self.sha256.update(data)
        if self.git is not None:
            self.git.update(data)


class Downloader:
    def __init__(self, args, commit: str, token: str | None, record: Record, peer_token: str | None = None):
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        self.args = args
        self.local_dir = Path(args.local_dir)
        self.commit = commit
        self.record = record
        self.hf_hub_url = hf_hub_url
        self.headers = dict(build_hf_headers(token=token, library_name="vllm-orch"))
        self.headers["Accept-Encoding"] = "identity"
        self.opener = urllib.request.build_opener(_Redirect)
        self.peer = (args.peer or "").rstrip("/")
        self.peer_headers = {"Authorization": "Bearer %s" % peer_token, "Accept-Encoding": "identity"} \
            if self.peer else {}
        self.peer_opener = urllib.request.build_opener(_NoRedirect)
        self.abort = threading.Event()
        self.fetched = 0
        self.from_peer = 0
        self._fetched_lock = threading.Lock()

    def run_file(self, f: dict) -> str:
        """Download, verify and install one file; returns its status (ok|refetched).

        A failure raises the abort here, in the worker's own thread: set later by the main thread, the
        same worker could already have taken (and finished) the next file of the queue."""
        if self.abort.is_set():
            raise Aborted()
        try:
            return self._run_file(f)
        except Aborted:
            raise
        except BaseException:
            self.abort.set()
            raise

    def _run_file(self, f: dict) -> str:
        final = self.local_dir / f["name"]
        try:
            st = os.lstat(str(final))
        except OSError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_size == f["size"]:
            digest = self._hash_existing(final, f)   # e.g. left by `hf download`: reading beats fetching
            if digest is not None:
                self._install(f, None, digest)
                return "ok"
        if self.peer and f["size"]:
            status = self._from_peer(f)
            if status is not None:
                return status
        refetched = False
        while True:
            part = partial_path(self.local_dir, f)
            hashers, have = self._resume(part, f)
            self._stream(f, part, hashers, have)
            digest = self._check(f, hashers)
            if digest is not None:
                self._install(f, part, digest)
                return "refetched" if refetched else "ok"
            part.unlink()
            if refetched:
                raise Fail("checksum", "%s: sha256 mismatch again after a re-fetch (expected %s)"
                           % (f["name"], f["sha256"] or f["blob_id"]), f["name"])
            refetched = True

    def _from_peer(self, f: dict) -> str | None:
        """The file from the fleet's peer (--peer), checked against the Hub's sha256 like any
        download; None when the peer failed or its bytes differ (the Hub's copy is fetched then)."""
        part = partial_path(self.local_dir, f)
        hashers, have = self._resume(part, f)
        url = "%s/%s" % (self.peer, urllib.parse.quote(f["name"]))
        try:
            self._stream(f, part, hashers, have, url=url, headers=self.peer_headers, opener=self.peer_opener,
                         retries=1)
        except Fail as fail:
            if fail.kind == "disk":
                raise
            if fail.kind == "network":       # unreachable or gone: the other files go to the Hub at once
                self.peer = ""
            print("peer: %s; fetching it from the Hub" % fail.message, file=sys.stderr)
            return None
        digest = self._check(f, hashers)
        if digest is None:
            print("peer: %s differs from the Hub's sha256; fetching it from the Hub" % f["name"], file=sys.stderr)
            part.unlink()
            return None
        with self._fetched_lock:
            self.from_peer += f["size"] - have
        self._install(f, part, digest)
        return "peer"

    def _hash_existing(self, path: Path, f: dict) -> str | None:
        h = Hashers(f)
        try:
            fh = os.fdopen(open_nofollow(path, os.O_RDONLY), "rb")
        except OSError:
            return None
        with fh:
            for block in iter(lambda: fh.read(CHUNK), b""):
                h.update(block)
        return self._check(f, h)

    def _check(self, f: dict, h: Hashers) -> str | None:
        """The sha256 hex when the content matches the hub's metadata, else None."""
        digest = h.sha256.hexdigest()
        if f["lfs"]:
            return digest if digest == f["sha256"] else None
        if f["blob_id"] and h.git is not None and h.git.hexdigest() != f["blob_id"]:
            return None
        return digest

    def _resume(self, part: Path, f: dict) -> tuple:
        """Hashers primed with the partial prefix (read once), and its length."""
        h = Hashers(f)
        try:
            st = os.lstat(str(part))
        except OSError:
            return h, 0
        size = st.st_size
        if size > f["size"] or not stat.S_ISREG(st.st_mode):
            part.unlink()
            return h, 0
        with os.fdopen(open_nofollow(part, os.O_RDONLY), "rb") as fh:
            for block in iter(lambda: fh.read(CHUNK), b""):
                h.update(block)
        return h, size

    def _stream(self, f: dict, part: Path, h: Hashers, have: int, url: str | None = None,
                headers: dict | None = None, opener=None, retries: int | None = None) -> None:
        """Stream the file into `part` from the Hub (or `url` with `headers` and `opener`: the peer),
        hashing while it arrives; `retries`: the budget (default --retries)."""
        url = url or self.hf_hub_url(self.args.repo, f["name"], revision=self.commit, endpoint=self.args.endpoint)
        base_headers, opener = headers if headers is not None else self.headers, opener or self.opener
        try:
            safe_dir(self.local_dir, os.path.join(PARTIAL_DIR, parent_of(f["name"])))
        except OSError as exc:
            raise Fail("disk", "cannot create %s: %s" % (part.parent, exc), f["name"])
        if f["size"] == 0:
            os.close(open_nofollow(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
            return
        attempts = 0
        last_emit = 0.0
        while have < f["size"]:
            if self.abort.is_set():
                raise Aborted()
            req_headers = dict(base_headers)
            if have:
                req_headers["Range"] = "bytes=%d-" % have
            progressed = False
            try:
                resp = opener.open(urllib.request.Request(url, headers=req_headers),
                                        timeout=self.args.stall_timeout)
                with resp:
                    if have and resp.status == 200:      # server ignored the Range: start over
                        h, have = Hashers(f), 0
                    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if have else os.O_TRUNC)
                    try:
                        out = os.fdopen(open_nofollow(part, flags), "ab" if have else "wb")
                    except OSError as exc:
                        raise Fail("disk", "cannot write %s: %s" % (part, exc), f["name"])
                    with out:
                        while True:
                            if self.abort.is_set():
                                raise Aborted()
                            block = resp.read(CHUNK)
                            if not block:
                                break
                            try:
                                out.write(block)
                            except OSError as exc:
                                raise Fail("disk", "cannot write %s: %s" % (part, exc), f["name"])
                            h.update(block)
                            have += len(block)
                            progressed = True
                            with self._fetched_lock:
                                self.fetched += len(block)
                            now = time.monotonic()
                            if now - last_emit >= PROGRESS_INTERVAL and have < f["size"]:
                                last_emit = now
                                emit("progress", file=f["name"], done=have, size=f["size"])
                if have < f["size"]:
                    raise ConnectionError("connection closed at byte %d of %d" % (have, f["size"]))
                if have > f["size"]:
                    raise Fail("checksum", "%s: got %d bytes, expected %d" % (f["name"], have, f["size"]),
                               f["name"])
            except urllib.error.HTTPError as exc:
                if exc.code in (401, 403):
                    raise Fail("auth", "%s: HTTP %d %s" % (f["name"], exc.code,
                                                           exc.headers.get("X-Error-Message") or exc.reason),
                               f["name"])
                if exc.code == 404:
                    raise Fail("not_found", "%s: HTTP 404 %s" % (f["name"], exc.headers.get("X-Error-Message")
                                                                  or exc.reason), f["name"])
                if exc.code == 416:          # our partial is longer than the file: start over
                    part.unlink()
                    h, have = Hashers(f), 0
                    continue
                if exc.code < 500 and exc.code not in (408, 429):
                    raise Fail("network", "%s: HTTP %d %s" % (f["name"], exc.code, exc.reason), f["name"])
                attempts = self._backoff(f, attempts, "HTTP %d" % exc.code, retries)
            except (urllib.error.URLError, HTTPException, ConnectionError, socket.timeout, TimeoutError) as exc:
                if progressed:
                    attempts = 0     # bytes arrived: a fresh budget of retries, like huggingface_hub
                attempts = self._backoff(f, attempts, "%s: %s" % (type(exc).__name__, exc), retries)

    def _backoff(self, f: dict, attempts: int, why: str, retries: int | None = None) -> int:
        attempts += 1
        retries = self.args.retries if retries is None else retries
        if attempts > retries:
            raise Fail("network", "%s: giving up after %d retries (%s)" % (f["name"], retries, why),
                       f["name"])
        print("retry %d/%d for %s: %s" % (attempts, retries, f["name"], why), file=sys.stderr)
        time.sleep(min(30.0, self.args.backoff * 2 ** (attempts - 1)))
        return attempts

    def _install(self, f: dict, part: Path | None, sha256: str) -> None:
        final = self.local_dir / f["name"]
        try:
            safe_dir(self.local_dir, parent_of(f["name"]))
            if part is not None:
                os.replace(str(part), str(final))    # rename: a symlink at `final` is replaced, not followed
            st = os.lstat(str(final))
        except OSError as exc:
            raise Fail("disk", "cannot install %s: %s" % (final, exc), f["name"])
        entry = {"size": f["size"], "sha256": sha256, "lfs": f["lfs"], "mtime_ns": st.st_mtime_ns}
        if f["blob_id"]:
            entry["blob_id"] = f["blob_id"]
        self.record.add(f["name"], entry)
        self._write_hf_metadata(f)

    def _write_hf_metadata(self, f: dict) -> None:
        """Also tell huggingface_hub the file is current (its .cache/huggingface/download/*.metadata),
        so a later hf_hub_download(local_dir=...) does not fetch it again. Best effort: private API."""
        meta = self.local_dir / PARTIAL_DIR / (f["name"] + ".metadata")
        try:
            if os.path.islink(str(meta)):             # it opens without O_NOFOLLOW: never through a link
                os.unlink(str(meta))
            from huggingface_hub._local_folder import write_download_metadata
            write_download_metadata(local_dir=self.local_dir, filename=f["name"], commit_hash=self.commit,
                                    etag=f["sha256"] or f["blob_id"])
        except Exception:  # noqa: BLE001
            pass


# -- main ------------------------------------------------------------------------------------------
def load_token(args) -> str | None:
    token: str | None
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise Fail("auth", "cannot read the token file %s: %s" % (args.token_file, exc.strerror))
        if args.remove_token_file:          # written for this run only: gone before anything else happens
            try:
                os.unlink(args.token_file)
            except OSError:
                pass
    else:
        token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None
    if token:
        _secrets.append(token)
    return token or None


def peer_reachable(url: str, timeout: float = 5.0) -> bool:
    """The fleet peer accepts a connection within `timeout` (a firewall that drops it would otherwise
    cost every worker's first file a stall timeout before the Hub)."""
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout).close()
        return True
    except (OSError, ValueError):
        return False


def load_peer_token(args) -> str | None:
    """The fleet peer's token (--peer-token-file, written for this run: removed once read)."""
    if not args.peer:
        return None
    try:
        token = Path(args.peer_token_file).read_text().strip()
        os.unlink(args.peer_token_file)
    except (OSError, TypeError) as exc:
        raise Fail("auth", "cannot read the peer token file %s: %s" % (args.peer_token_file, exc))
    _secrets.append(token)
    return token


def parse_args(argv: list | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Verified, resumable download of a pinned Hub repo (JSON lines).")
    ap.add_argument("--repo", required=True)
    ap.add_argument("--revision", required=True)
    ap.add_argument("--local-dir", required=True)
    ap.add_argument("--allow", action="append", default=[])
    ap.add_argument("--ignore", action="append", default=[])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--plan-only", action="store_true")
    ap.add_argument("--commit", default=None,
                    help="download exactly this commit (the plan's) of --revision, wherever the branch is now")
    ap.add_argument("--token-file", default=None)
    ap.add_argument("--remove-token-file", action="store_true",
                    help="the token file was written for this run: remove it once read")
    ap.add_argument("--endpoint", default=None, help="hub URL (default: HF_ENDPOINT or huggingface.co)")
    ap.add_argument("--peer", default=None,
                    help="http://ADDR:PORT of a fleet host serving this commit (serve_weights.py): files come from "
                         "it first, each checked against the Hub's sha256; what fails comes from the Hub")
    ap.add_argument("--peer-token-file", default=None, help="the peer's token (removed once read)")
    ap.add_argument("--retries", type=int, default=5)
    ap.add_argument("--backoff", type=float, default=1.0, help="first retry delay, doubled each time")
    ap.add_argument("--stall-timeout", type=float, default=60.0, help="no byte for this long = retry")
    return ap.parse_args(argv)


def partial_path(local_dir: Path, f: dict) -> Path:
    """Where a file's partial data waits for the next resume (named by its etag, so a changed file
    never resumes from stale bytes)."""
    etag = f["sha256"] or f["blob_id"] or "noetag"
    return local_dir / PARTIAL_DIR / ("%s.%s.incomplete" % (f["name"], etag))


def plan(args, record: Record, commit: str, selected: list) -> tuple:
    local_dir = Path(args.local_dir)
    have: list[dict] = []
    fetch: list[dict] = []
    for f in selected:
        (have if record.verified(local_dir, f) else fetch).append(f)
    partial = 0
    for f in fetch:
        try:
            partial += os.lstat(str(partial_path(local_dir, f))).st_size
        except OSError:
            pass
    emit("plan", repo=args.repo, revision=args.revision, commit=commit, files=len(selected),
         total_bytes=sum(f["size"] for f in selected), have_bytes=sum(f["size"] for f in have),
         to_fetch_bytes=sum(f["size"] for f in fetch), partial_bytes=partial,
         to_fetch=[f["name"] for f in fetch])
    return have, fetch


def main(argv: list | None = None) -> int:
    args = parse_args(argv)
    # Weights are not secret and the service reads them as its own unprivileged user: folders 0755,
    # files 0644 whatever the umask of the SSH session (a 077 umask made them root-only).
    os.umask(0o022)
    started = time.monotonic()
    record = None
    try:
        token = load_token(args)
        commit, files = fetch_metadata(args.repo, args.commit or args.revision, token, args.endpoint,
                                       args.retries, args.backoff)
        if args.commit and commit != args.commit:
            raise Fail("not_found", "%s: the hub answered commit %s for commit %s" % (args.repo, commit, args.commit))
        missing = [f["name"] for f in files if f["size"] is None]
        if missing:
            raise Fail("network", "the hub gave no size for %d files (e.g. %s)" % (len(missing), missing[0]))
        check_names(files)
        selected = select(files, args.allow, args.ignore)
        local_dir = Path(args.local_dir)
        record = Record(local_dir, args.repo, args.revision, commit)
        have, fetch = plan(args, record, commit, selected)
        if args.plan_only:
            return 0
        # The folder carries our record from the start (before the first byte of a shard), so vllm-orch
        # knows it made it even when this run is interrupted: only such folders are ever deleted.
        record.save()
        for f in have:
            emit("file", file=f["name"], size=f["size"], sha256=record.data["files"][f["name"]].get("sha256"),
                 status="skipped")
        dl = Downloader(args, commit, token, record, load_peer_token(args))
        if dl.peer and not peer_reachable(dl.peer):
            print("peer: %s does not answer; every file from the Hub" % dl.peer, file=sys.stderr)
            dl.peer = ""
        first_fail = None
        with ThreadPoolExecutor(max_workers=max(1, args.workers)) as pool:
            futures = {pool.submit(dl.run_file, f): f for f in fetch}
            for fut in as_completed(futures):
                f = futures[fut]
                try:
                    status = fut.result()
                except Aborted:
                    continue
                except Fail as fail:
                    if first_fail is None:
                        first_fail = fail
                    continue
                except Exception as exc:  # noqa: BLE001 - a bug or an unexpected OS error: report it
                    if first_fail is None:
                        first_fail = Fail("network", "%s: %s: %s" % (f["name"], type(exc).__name__, exc), f["name"])
                    continue
                emit("file", file=f["name"], size=f["size"],
                     sha256=record.data["files"][f["name"]]["sha256"], status=status)
        if first_fail is not None:
            record.flush()
            raise first_fail
        record.finish(selected, args.allow, args.ignore)
        emit("done", verified=True, bytes=dl.fetched, peer_bytes=dl.from_peer,
             seconds=round(time.monotonic() - started, 3),
             files=len(selected), total_bytes=sum(f["size"] for f in selected), commit=commit)
        return 0
    except Fail as fail:
        fields = {"kind": fail.kind, "message": fail.message}
        if fail.file:
            fields["file"] = fail.file
        emit("error", **fields)
        return 1
    except KeyboardInterrupt:
        if record is not None:
            record.flush()
        emit("error", kind="network", message="interrupted")
        return 1


if __name__ == "__main__":
    sys.exit(main())
