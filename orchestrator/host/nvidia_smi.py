"""Parsers for real nvidia-smi output: the GPU list, the compute processes, driver/CUDA versions.

Pure functions, tested on recorded output from real machines (tests/fixtures/nvidia-smi/) and on
the simulated nvidia-smi. They accept every variant the orchestrator may meet:
  - `--format=csv` with a header and units ("memory.total [MiB]" / "97887 MiB"),
    `noheader` and/or `nounits` (then pass `fields`, the order given to --query-*),
  - "[N/A]" / "[Not Supported]" values (-> None),
  - the compute-apps header names `used_memory` as "used_gpu_memory [MiB]".
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

GPU_QUERY_FIELDS = ("index", "name", "memory.total", "memory.used", "memory.free", "uuid",
                    "driver_version", "utilization.gpu")
COMPUTE_APPS_FIELDS = ("pid", "process_name", "used_memory", "gpu_uuid")


def query_gpus_argv(nvidia_smi: str = "nvidia-smi") -> list[str]:
    return [nvidia_smi, "--query-gpu=" + ",".join(GPU_QUERY_FIELDS),
            "--format=csv,noheader,nounits"]


def query_compute_apps_argv(nvidia_smi: str = "nvidia-smi") -> list[str]:
    return [nvidia_smi, "--query-compute-apps=" + ",".join(COMPUTE_APPS_FIELDS),
            "--format=csv,noheader,nounits"]


@dataclass(frozen=True)
class Gpu:
    index: int | None = None
    name: str | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    memory_free_mib: int | None = None
    uuid: str | None = None
    driver_version: str | None = None
    utilization_pct: int | None = None


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    process_name: str | None = None
    used_memory_mib: int | None = None
    gpu_uuid: str | None = None


@dataclass(frozen=True)
class DriverInfo:
    driver_version: str | None
    cuda_version: str | None


# header name (units stripped) -> canonical query field
_HEADER_ALIASES = {"used_gpu_memory": "used_memory", "name": "name"}
_NA = {"[n/a]", "n/a", "[not supported]", "not supported", "[insufficient permissions]", ""}


def _number(value: str) -> int | None:
    """'97887 MiB' / '97887' / '0 %' / '[N/A]' -> int or None."""
    v = value.strip()
    if v.lower() in _NA:
        return None
    m = re.match(r"^(-?\d+(?:\.\d+)?)\s*(?:MiB|%|W|MHz)?$", v)
    if not m:
        raise ValueError(f"not a number: {value!r}")
    return int(float(m.group(1)))


def _text(value: str) -> str | None:
    v = value.strip()
    return None if v.lower() in _NA else v


def _rows(text: str, fields: Sequence[str] | None, known: set) -> tuple[list[str], list[list[str]]]:
    lines = [ln for ln in text.replace("\r", "").split("\n") if ln.strip()]
    if not lines:
        return [], []
    if _looks_like_header(lines[0], known):
        header = [h.strip().split(" [")[0] for h in lines[0].split(",")]
        cols = [_HEADER_ALIASES.get(h, h) for h in header]
        body = lines[1:]
    else:
        if fields is None:
            raise ValueError("nvidia-smi output has no header line; pass the queried fields")
        cols, body = list(fields), lines
    rows = []
    for ln in body:
        parts = [p.strip() for p in ln.split(", ")]
        if len(parts) > len(cols):   # a comma inside a name: keep the extra text in that column
            extra = len(parts) - len(cols)
            at = cols.index("process_name") if "process_name" in cols else (
                cols.index("name") if "name" in cols else 0)
            parts[at:at + extra + 1] = [", ".join(parts[at:at + extra + 1])]
        if len(parts) != len(cols):
            raise ValueError(f"nvidia-smi line has {len(parts)} fields, expected {len(cols)}: "
                             f"{ln!r}")
        rows.append(parts)
    return cols, rows


def _looks_like_header(line: str, known: set) -> bool:
    first = line.split(",")[0].strip().split(" [")[0]
    return _HEADER_ALIASES.get(first, first) in known


def parse_gpus(text: str, fields: Sequence[str] | None = None) -> list[Gpu]:
    """`nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]` -> one Gpu per line.
    Without a header, `fields` must name the queried fields in order."""
    known = set(GPU_QUERY_FIELDS) | {"memory.reserved", "pci.bus_id", "compute_cap", "count",
                                     "utilization.memory", "temperature.gpu", "power.draw",
                                     "power.limit", "pstate", "persistence_mode", "serial"}
    cols, rows = _rows(text, fields, known)
    out = []
    for parts in rows:
        v = dict(zip(cols, parts))
        out.append(Gpu(
            index=_number(v["index"]) if "index" in v else None,
            name=_text(v["name"]) if "name" in v else None,
            memory_total_mib=_number(v["memory.total"]) if "memory.total" in v else None,
            memory_used_mib=_number(v["memory.used"]) if "memory.used" in v else None,
            memory_free_mib=_number(v["memory.free"]) if "memory.free" in v else None,
            uuid=_text(v["uuid"]) if "uuid" in v else None,
            driver_version=_text(v["driver_version"]) if "driver_version" in v else None,
            utilization_pct=_number(v["utilization.gpu"]) if "utilization.gpu" in v else None))
    return out


def parse_compute_apps(text: str, fields: Sequence[str] | None = None) -> list[GpuProcess]:
    """`nvidia-smi --query-compute-apps=... --format=csv[,noheader][,nounits]` -> processes.
    One entry per (process, GPU) line, as nvidia-smi prints them."""
    known = set(COMPUTE_APPS_FIELDS) | {"gpu_name", "gpu_bus_id", "gpu_serial"}
    fields = [("used_memory" if f == "used_gpu_memory" else
               "process_name" if f == "name" else f) for f in fields] if fields else None
    cols, rows = _rows(text, fields, known)
    out = []
    for parts in rows:
        v = dict(zip(cols, parts))
        pid = _number(v.get("pid", ""))
        if pid is None:
            continue
        out.append(GpuProcess(
            pid=pid, process_name=_text(v["process_name"]) if "process_name" in v else None,
            used_memory_mib=_number(v["used_memory"]) if "used_memory" in v else None,
            gpu_uuid=_text(v["gpu_uuid"]) if "gpu_uuid" in v else None))
    return out


_VERSIONS = re.compile(r"Driver Version:\s*(?P<driver>[\w.\-]+)\s+CUDA Version:\s*(?P<cuda>[\w.\-/ ]+?)\s*\|")


def parse_driver_info(banner: str) -> DriverInfo:
    """Driver and CUDA versions from plain `nvidia-smi` output (cuda_version None when the
    banner says 'Not Found' or 'N/A')."""
    m = _VERSIONS.search(banner)
    if not m:
        return DriverInfo(None, None)
    cuda = m.group("cuda").strip()
    return DriverInfo(m.group("driver"), None if cuda.lower() in ("not found", "n/a") else cuda)
