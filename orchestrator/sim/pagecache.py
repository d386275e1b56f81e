"""The page cache of a SIMULATED host's files, for tests and benchmarks: make files cold the way
an operator would (written back, then dropped with posix_fadvise(POSIX_FADV_DONTNEED)), and read
how much of them is cached the way util-linux reports it (fincore). The simulated vLLM's load
time follows this real state, so a cold start and a warmed one are measured, not assumed.

Files in a systemd-nspawn container's volatile overlay live on tmpfs: they cannot be dropped
(tmpfs pages are the data), so warm-up figures use the process-flavour hosts.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path


def evict(paths: Iterable[os.PathLike | str]) -> None:
    """Drop the files' pages from the page cache (after writing dirty ones back)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached(paths: Iterable[os.PathLike | str]) -> dict[str, int]:
    """{path: bytes of it in the page cache}, from util-linux fincore (whole pages)."""
    paths = [str(p) for p in paths]
    if not paths:
        return {}
    out = subprocess.run(["fincore", "--json", "--bytes", "--output", "RES,FILE", *paths], capture_output=True,
                         text=True, check=True, timeout=60)
    return {str(r["file"]): int(r["res"]) for r in json.loads(out.stdout)["fincore"]}


def model_files(folder: os.PathLike | str) -> list[Path]:
    """A model folder's weight files (what a load reads)."""
    return sorted(p for p in Path(folder).glob("*.safetensors") if p.is_file())


def evict_model(folder: os.PathLike | str) -> int:
    """Make a model's weight files cold; returns their bytes."""
    files = model_files(folder)
    evict(files)
    return sum(p.stat().st_size for p in files)
