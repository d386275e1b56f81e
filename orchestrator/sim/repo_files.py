"""One file of a synthetic Hub repo: deterministic bytes made on demand, with the metadata the Hub
gives for it (size, git blob oid, LFS sha256 and pointer size).

Why not store files: the Kimi repos alone are ~110 MB at scale 10000, and a test wants several
mirrors at once. Bytes are built block by block from a per-repo random pool (a rotation per block),
so any range can be served without materialising the file, and the sha256 is computed once, lazily.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

BLOCK = 1 << 20          # bytes per generated block; a block is a rotation of the repo's pool
_POOLS: dict[str, bytes] = {}
_POOLS_LOCK = threading.Lock()


def _pool(seed: str) -> bytes:
    """BLOCK random bytes for a repo (seeded), shared by all its files."""
    with _POOLS_LOCK:
        pool = _POOLS.get(seed)
        if pool is None:
            pool = random.Random(hashlib.sha256(seed.encode()).digest()).randbytes(BLOCK)
            _POOLS[seed] = pool
        return pool


def git_blob_oid(data: bytes) -> str:
    """The git object id of a blob (what the Hub reports as `oid`/`blobId` for non-LFS files)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The git-lfs pointer file stored in git in place of an LFS file."""
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n").encode()


def safetensors_header(size: int, tensor: str) -> bytes:
    """A valid safetensors prefix (u64 LE length + JSON header) for a file of `size` bytes holding
    one U8 tensor that fills the rest: the synthetic shard is a loadable safetensors file."""
    body = size
    for _ in range(4):
        meta = {"__metadata__": {"format": "pt", "generator": "vllm-orch SIMULATED hub"},
                tensor: {"dtype": "U8", "shape": [body], "data_offsets": [0, body]}}
        text = json.dumps(meta, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        new_body = size - 8 - len(text)
        if new_body == body:
            break
        body = new_body
    if body < 0:
        raise ValueError(f"{size} bytes is too small for a safetensors header")
    return len(text).to_bytes(8, "little") + text


@dataclass
class RepoFile:
    """A file as served: `path` in the repo, `size` served bytes, `lfs` tracked by git-lfs.

    Content is either `text` (small files, served as is) or synthetic: `prefix` (e.g. a safetensors
    header) followed by pool-rotation blocks up to `size`. `real_size` is the unscaled size the
    file has on the real Hub (informational: load-time models use it)."""

    path: str
    size: int
    lfs: bool
    seed: str
    text: bytes | None = None
    prefix: bytes = b""
    real_size: int = 0
    _sha256: str | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_text(cls, path: str, text: str | bytes, *, seed: str, lfs: bool = False) -> RepoFile:
        data = text.encode() if isinstance(text, str) else text
        return cls(path=path, size=len(data), lfs=lfs, seed=seed, text=data, real_size=len(data))

    # -- bytes -------------------------------------------------------------------------------------
    def _block(self, index: int) -> bytes:
        pool = _pool(self.seed)
        k = int.from_bytes(hashlib.sha256(f"{self.path}#{index}".encode()).digest()[:4], "big") % BLOCK
        return pool[k:] + pool[:k]

    def iter_bytes(self, start: int = 0, end: int | None = None, chunk: int = BLOCK) -> Iterator[bytes]:
        """The bytes [start, end) in chunks of at most `chunk` (end defaults to the file size)."""
        end = self.size if end is None else min(end, self.size)
        if self.text is not None:
            for pos in range(start, end, chunk):
                yield self.text[pos:min(end, pos + chunk)]
            return
        pos = start
        plen = len(self.prefix)
        while pos < end:
            if pos < plen:
                piece = self.prefix[pos:min(end, plen)]
            else:
                index, off = divmod(pos - plen, BLOCK)
                piece = self._block(index)[off:off + min(BLOCK - off, end - pos)]
            for i in range(0, len(piece), chunk):
                yield piece[i:i + chunk]
            pos += len(piece)

    def read(self, start: int = 0, end: int | None = None) -> bytes:
        return b"".join(self.iter_bytes(start, end))

    # -- metadata ----------------------------------------------------------------------------------
    @property
    def sha256(self) -> str:
        """sha256 of the served bytes (computed once; ~0.1 s per 50 MB)."""
        with self._lock:
            if self._sha256 is None:
                h = hashlib.sha256()
                for piece in self.iter_bytes():
                    h.update(piece)
                self._sha256 = h.hexdigest()
            return self._sha256

    @property
    def blob_id(self) -> str:
        """The git oid: of the content for git files, of the LFS pointer for LFS files."""
        if self.lfs:
            return git_blob_oid(self.pointer)
        return git_blob_oid(self.read())

    @property
    def pointer(self) -> bytes:
        return lfs_pointer(self.sha256, self.size)

    @property
    def etag(self) -> str:
        """What the Hub puts in (X-Linked-)ETag: the sha256 for LFS files, the git oid otherwise."""
        return self.sha256 if self.lfs else self.blob_id

    def tree_entry(self) -> dict:
        """The entry /api/models/{repo}/tree and /paths-info return for this file."""
        entry: dict = {"type": "file", "oid": self.blob_id, "size": self.size, "path": self.path}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": len(self.pointer)}
        # No "xetHash": the mirror is plain HTTP only, so huggingface_hub never takes the xet path.
        return entry

    def sibling(self, blobs: bool) -> dict:
        """The entry of `siblings` in /api/models/{repo} (with ?blobs=true: size, blobId, lfs)."""
        if not blobs:
            return {"rfilename": self.path}
        entry: dict = {"rfilename": self.path, "size": self.size, "blobId": self.blob_id}
        if self.lfs:
            entry["lfs"] = {"size": self.size, "sha256": self.sha256, "pointerSize": len(self.pointer)}
        return entry
