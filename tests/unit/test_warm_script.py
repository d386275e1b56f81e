"""The host-side warm script on real files and the real page cache: vLLM's load order, residency
as util-linux fincore reports it, a budget that stops at a prefix, a memory floor that stops it,
a read rate it never exceeds, and the host's RAM as the facts script reads it."""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import shutil
import subprocess
import sys
import time

import pytest

from orchestrator.paths import package_file

WARM = package_file("host", "remote", "warm.py").read_text()
FACTS = package_file("host", "remote", "facts_script.py").read_text()
MB = 10 ** 6


def run(*args: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-", *args], input=WARM, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def evict(path) -> None:
    """Make a file cold: written back, then dropped from the page cache (posix_fadvise DONTNEED)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


PAGE = os.sysconf("SC_PAGE_SIZE")


def fincore(path) -> int:
    """Pages of the file in the page cache, as util-linux reports them."""
    out = subprocess.run(["fincore", "--noheadings", "--raw", "--output", "PAGES", str(path)],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def pages(nbytes: int) -> int:
    return -(-nbytes // PAGE)


@contextlib.contextmanager
def held_in_cache(path):
    """Someone else has the file cached and keeps it so: mapped and mlock()ed, so its pages stay in
    the page cache however hard the rest of the machine presses on memory (a page of a file read with
    read() was evicted between two looks in a full parallel run: 488 of 489 pages)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mlock.argtypes = libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            # mlock faults every page in (reading the file into the cache) and pins it
            assert libc.mlock(addr, size) == 0, (f"mlock of {size} bytes: {os.strerror(ctypes.get_errno())} "
                                                 "(as a user, `ulimit -l` must allow it; root may)")
            yield
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def model(folder, sizes: dict[str, int], index: list[str] | None = None, cold: bool = True):
    folder.mkdir(parents=True, exist_ok=True)
    for name, size in sizes.items():
        (folder / name).write_bytes(os.urandom(size))
        if cold:
            evict(folder / name)
    if index is not None:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {f"w{i}": n for i, n in enumerate(index)}}))
    return folder


def meminfo(tmp_path, total: int, available: int):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       {total // 1024} kB\nMemFree:        {available // 1024} kB\n"
                    f"MemAvailable:   {available // 1024} kB\n")
    return path


def test_load_order_is_vllms_natural_order_of_the_indexed_files(tmp_path):
    names = ["model-00010-of-00010.safetensors", "model-00002-of-00010.safetensors",
             "model-00001-of-00010.safetensors"]
    folder = model(tmp_path / "m", {**{n: 5000 for n in names}, "consolidated.safetensors": 5000}, index=names)
    (folder / "config.json").write_text("{}")
    plan = run("--dir", str(folder), "--plan-only")[0]
    assert [f[0] for f in plan["files"]] == sorted(names)        # 1, 2, 10: not 1, 10, 2; no consolidated
    assert plan["total_bytes"] == 15000 and plan["mem_total"] > 0
    bins = model(tmp_path / "b", {"pytorch_model-2.bin": 10, "pytorch_model-10.bin": 10, "optimizer.bin": 10})
    assert [f[0] for f in run("--dir", str(bins), "--plan-only")[0]["files"]] == \
        ["pytorch_model-2.bin", "pytorch_model-10.bin"]
    assert run("--dir", str(tmp_path / "absent"), "--plan-only")[0]["files"] == []


@pytest.mark.skipif(shutil.which("fincore") is None, reason="util-linux fincore is not installed")
def test_residency_agrees_with_fincore_and_cached_blocks_are_not_read_again(tmp_path):
    folder = model(tmp_path / "m", {"model-00001-of-00002.safetensors": 3 * MB + 7,
                                    "model-00002-of-00002.safetensors": 2 * MB})
    first, second = sorted(folder.iterdir())
    assert run("--dir", str(folder), "--plan-only")[0]["cached_bytes"] == 0 == fincore(first) == fincore(second)
    with held_in_cache(second):             # the second file cached by someone else
        plan = run("--dir", str(folder), "--plan-only")[0]
        assert pages(plan["files"][1][2]) == fincore(second) == pages(2 * MB) and plan["cached_bytes"] == 2 * MB
        done = run("--dir", str(folder), "--block", str(1 << 20))[-1]
    assert done["reason"] == "complete" and done["warmed_bytes"] == 3 * MB + 7      # not the cached file again
    assert done["cached_bytes"] == done["total_bytes"] == 5 * MB + 7
    assert fincore(first) == pages(3 * MB + 7)


def test_budget_warms_a_prefix_in_load_order_and_the_floor_stops_it(tmp_path):
    sizes = {f"model-{i:05d}-of-00004.safetensors": 2 * MB for i in range(1, 5)}
    folder = model(tmp_path / "m", sizes)
    events = run("--dir", str(folder), "--budget", str(5 * MB), "--block", str(1 << 20))
    done = events[-1]
    assert done["reason"] == "budget" and done["covered_bytes"] <= 5 * MB
    files = [e for e in events if e["event"] == "file"]
    assert [f["file"] for f in files] == sorted(sizes)[:3] and files[2]["warmed"] < 2 * MB
    for name in sizes:
        evict(folder / name)
    # available memory 3 MB above the floor: the warm-up reads what keeps it above, then stops
    mem = meminfo(tmp_path, 64 * 2 ** 30, 20 * 2 ** 30)
    done = run("--dir", str(folder), "--meminfo", str(mem), "--floor", str(20 * 2 ** 30 - 3 * MB),
               "--block", str(1 << 20))[-1]
    assert done["reason"] == "memory" and 2 * MB <= done["warmed_bytes"] <= 3 * MB
    assert done["min_headroom"] >= 20 * 2 ** 30 - 3 * MB and done["available"] == 20 * 2 ** 30


def test_reads_never_outrun_the_rate_bound(tmp_path):
    folder = model(tmp_path / "m", {"model-00001-of-00001.safetensors": 4 * MB})
    t0 = time.monotonic()
    done = run("--dir", str(folder), "--rate", str(8 * MB), "--block", str(1 << 20))[-1]
    wall = time.monotonic() - t0
    assert done["warmed_bytes"] == 4 * MB
    assert done["seconds"] >= 0.45 and wall >= 0.45      # 4 MB at 8 MB/s: at least 0.5 s (a lower bound only)


def test_facts_script_reads_the_hosts_memory_from_its_meminfo_file(tmp_path):
    mem = meminfo(tmp_path, 1536 * 2 ** 30 // 10000, 1100 * 2 ** 30 // 10000)
    args = {"ports": [], "models_root": str(tmp_path / "models"), "state_dir": str(tmp_path / "state"),
            "nvidia_smi": "nvidia-smi-absent", "vllm": "/nonexistent/vllm", "manager": "process", "models": [],
            "gpu_query": ["nvidia-smi-absent"], "apps_query": ["nvidia-smi-absent"], "meminfo": str(mem)}
    out = subprocess.run([sys.executable, "-c", FACTS, json.dumps(args)], capture_output=True, text=True, timeout=60)
    memory = json.loads(out.stdout)["memory"]
    assert memory == {"path": str(mem), "total": 1536 * 2 ** 30 // 10000 // 1024 * 1024,
                      "available": 1100 * 2 ** 30 // 10000 // 1024 * 1024}
    args["meminfo"] = "/proc/meminfo"
    real = json.loads(subprocess.run([sys.executable, "-c", FACTS, json.dumps(args)], capture_output=True,
                                     text=True, timeout=60).stdout)["memory"]
    assert 0 < real["available"] <= real["total"]
    args["meminfo"] = str(tmp_path / "none")
    assert "error" in json.loads(subprocess.run([sys.executable, "-c", FACTS, json.dumps(args)],
                                                capture_output=True, text=True, timeout=60).stdout)["memory"]
