#!/usr/bin/env python3
"""Read a model's weight files into the page cache, in vLLM's load order, as far as memory allows.
Runs ON THE HOST with the host's Python (>= 3.8, stdlib only), as `python - ARGS` with this text on
stdin (orchestrator/host/scripts.py), while the model it replaces still serves.

    python warm.py --dir D [--plan-only] [--budget BYTES] [--floor BYTES] [--rate BYTES_PER_S]
                   [--meminfo /proc/meminfo] [--block 16777216]

stdout carries JSON lines only:
  {"event":"plan","dir","files":[[name,size,cached],...],"total_bytes","cached_bytes",
   "weights_bytes" (the index's metadata.total_size, or null),
   "mem_total","mem_available"}                                   (--plan-only stops here)
  {"event":"progress","file","done","size","covered","warmed","headroom"}         (<= ~4/s)
  {"event":"file","file","size","cached_before","warmed"}
  {"event":"done","reason","warmed_bytes","covered_bytes","cached_bytes","total_bytes","seconds",
   "min_headroom","available"}
  {"event":"error","message"}
reason: complete (every weight file is cached) | budget (--budget bytes of the files, in load
order, are cached) | memory (reading on would take available memory, net of the pages this run
warmed, under --floor) | nofiles.  Exit status: 0 done, 1 error, 2 bad arguments.

Load order is vLLM 0.33's (model_executor/model_loader/default_loader.py `_prepare_weights` and
weight_utils.py `safetensors_weights_iterator`): the folder's *.safetensors (else *.bin), only those
named in model.safetensors.index.json's weight_map when it exists, sorted by file name with numbers
compared as numbers. A prefix is warmed: the loader consumes it first, so the pages it reads later
from disk can only push out warmed pages it is already done with.

Residency comes from mincore(2) on a read-only mapping (the same answer as util-linux fincore);
blocks already cached are not read again. Memory: MemAvailable counts the page cache as available,
so the pages this run reads do not lower it; what this run must not do is take memory other
processes need, hence the check on MemAvailable minus the bytes it warmed. Reads are paced to
--rate so the kernel's page reclaim never races the serving model.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
import time

PROGRESS_INTERVAL = 0.25
BLOCK = 16 * 1024 * 1024            # vLLM's own prefetch block (DEFAULT_SAFETENSORS_PREFETCH_BLOCK_SIZE)
INDEX = "model.safetensors.index.json"
PAGE = os.sysconf("SC_PAGE_SIZE")
_RESIDENT = bytes(range(1, 256, 2))        # mincore flag bytes whose bit 0 is set


def emit(event, **fields):
    sys.stdout.write(json.dumps(dict(event=event, **fields), separators=(",", ":")) + "\n")
    sys.stdout.flush()


def natural_key(name):
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", os.path.basename(name))]


def load_order(folder):
    """The weight files vLLM 0.33 loads from a local folder, in its order."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    files = [n for n in names if n.endswith(".safetensors") and os.path.isfile(os.path.join(folder, n))]
    if files:
        try:
            with open(os.path.join(folder, INDEX)) as f:
                listed = set(json.load(f).get("weight_map", {}).values())
            files = [n for n in files if n in listed]
        except (OSError, ValueError, AttributeError):
            pass
    else:
        skip = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")
        files = [n for n in names if n.endswith(".bin") and n not in skip]
    return sorted(files, key=natural_key)


class Mapping:
    """A read-only mapping of a file, to ask mincore(2) which of its pages are in the page cache.
    Mapping reads nothing; without mincore every page counts as not cached."""

    _libc: ctypes.CDLL | bool | None = None      # False: tried, and there is no usable libc

    def __init__(self, path, size):
        self.size, self.addr = size, None
        libc = Mapping.libc()
        if libc is None or size == 0:
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)          # PROT_READ, MAP_SHARED
        finally:
            os.close(fd)
        if addr not in (None, ctypes.c_void_p(-1).value):
            self.addr = addr

    @classmethod
    def libc(cls):
        if cls._libc is None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.mmap.restype = ctypes.c_void_p
                libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_long)
                libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
                libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
                cls._libc = libc
            except (OSError, AttributeError):
                cls._libc = False
        return cls._libc or None

    def cached(self, start=0, length=None):
        """Bytes of [start, start+length) whose pages are in the page cache."""
        length = self.size - start if length is None else min(length, self.size - start)
        if self.addr is None or length <= 0:
            return 0
        first, last = start // PAGE, (start + length - 1) // PAGE
        pages = last - first + 1
        vec = (ctypes.c_ubyte * pages)()
        if self.libc().mincore(self.addr + first * PAGE, pages * PAGE, vec) != 0:
            return 0
        flags = ctypes.string_at(vec, pages)
        total = (pages - len(flags.translate(None, _RESIDENT))) * PAGE   # bit 0: the page is cached
        if flags[0] & 1:
            total -= start - first * PAGE
        if flags[-1] & 1:
            total -= (last + 1) * PAGE - (start + length)
        return total

    def close(self):
        if self.addr is not None:
            self.libc().munmap(self.addr, self.size)
            self.addr = None


def meminfo(path):
    """(MemTotal, MemAvailable) in bytes; MemAvailable None on kernels without it."""
    fields = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            words = rest.split()
            if words and words[0].isdigit():
                fields[key.strip()] = int(words[0]) * (1024 if words[1:2] == ["kB"] else 1)
    return fields.get("MemTotal"), fields.get("MemAvailable")


def index_total(folder):
    """The checkpoint's tensor bytes as its index states them (metadata.total_size), or None."""
    try:
        with open(os.path.join(folder, INDEX)) as f:
            total = json.load(f).get("metadata", {}).get("total_size")
        return int(total) if total else None
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def survey(folder):
    """[(name, size, cached bytes)] in load order."""
    out = []
    for name in load_order(folder):
        path = os.path.join(folder, name)
        size = os.path.getsize(path)
        m = Mapping(path, size)
        try:
            out.append((name, size, m.cached()))
        finally:
            m.close()
    return out


class Pacer:
    """Sleeps so that the bytes read so far never exceed rate x elapsed time."""

    def __init__(self, rate):
        self.rate, self.t0, self.done = rate, time.monotonic(), 0

    def add(self, n):
        self.done += n
        if self.rate > 0:
            ahead = self.done / self.rate - (time.monotonic() - self.t0)
            if ahead > 0:
                time.sleep(ahead)


def warm(args, files):
    started = time.monotonic()
    total = sum(size for _, size, _ in files)
    covered = warmed = 0
    min_headroom = None
    reason = "complete"
    pacer = Pacer(args.rate)
    buf = bytearray(args.block)
    last_emit = 0.0
    for name, size, cached_before in files:
        path = os.path.join(args.dir, name)
        m = Mapping(path, size)
        try:
            with open(path, "rb", buffering=0) as f:
                if hasattr(os, "posix_fadvise"):    # no readahead: exactly the blocks read are cached
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
                off = 0
                while off < size:
                    n = min(args.block, size - off)
                    if args.budget is not None and covered + n > args.budget:
                        reason = "budget"
                        break
                    cold = n - m.cached(off, n)
                    if cold > 0:
                        _, available = meminfo(args.meminfo)
                        if available is not None:
                            headroom = available - warmed - cold
                            if args.floor is not None and headroom < args.floor:
                                reason = "memory"
                                break
                            min_headroom = headroom if min_headroom is None else min(min_headroom, headroom)
                        f.seek(off)
                        view = memoryview(buf)[:n]
                        got = 0
                        while got < n:
                            r = f.readinto(view[got:])
                            if not r:
                                break
                            got += r
                        warmed += cold
                        pacer.add(cold)
                    covered += n
                    off += n
                    now = time.monotonic()
                    if now - last_emit >= PROGRESS_INTERVAL:
                        last_emit = now
                        emit("progress", file=name, done=off, size=size, covered=covered, warmed=warmed,
                             headroom=min_headroom)
            file_warmed = max(0, m.cached() - cached_before)
        finally:
            m.close()
        emit("file", file=name, size=size, cached_before=cached_before, warmed=file_warmed)
        if reason != "complete":
            break
    cached = sum(c for _, _, c in survey(args.dir))
    _, available = meminfo(args.meminfo)
    emit("done", reason=reason if files else "nofiles", warmed_bytes=warmed, covered_bytes=covered,
         cached_bytes=cached, total_bytes=total, seconds=round(time.monotonic() - started, 3),
         min_headroom=min_headroom, available=available)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="warm.py")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--plan-only", action="store_true")
    ap.add_argument("--budget", type=int, help="most bytes of the files, in load order, to have cached")
    ap.add_argument("--floor", type=int, help="stop before available memory net of the warmed bytes < this")
    ap.add_argument("--rate", type=float, default=0.0, help="most bytes per second read (0: no bound)")
    ap.add_argument("--meminfo", default="/proc/meminfo")
    ap.add_argument("--block", type=int, default=BLOCK)
    args = ap.parse_args(argv)
    if args.block < PAGE:
        ap.error("--block must be at least one page")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        files = survey(args.dir)
        if args.plan_only:
            try:
                total_ram, available = meminfo(args.meminfo)
            except OSError:
                total_ram = available = None
            emit("plan", dir=args.dir, files=[list(f) for f in files],
                 total_bytes=sum(s for _, s, _ in files), cached_bytes=sum(c for _, _, c in files),
                 weights_bytes=index_total(args.dir), mem_total=total_ram, mem_available=available)
            return 0
        warm(args, files)
        return 0
    except (OSError, ValueError) as exc:
        emit("error", message="%s: %s" % (type(exc).__name__, exc))
        return 1


if __name__ == "__main__":
    sys.exit(main())
