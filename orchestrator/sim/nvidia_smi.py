#!/usr/bin/env python3
"""SIMULATED nvidia-smi for a simulated GPU host (installed as `<hostdir>/bin/nvidia-smi`).

Self-contained, stdlib only, Python >= 3.9. Reads `<hostdir>/sim.json` (the GPUs, driver and CUDA
versions) and `<hostdir>/gpu-procs/*.json` (processes "holding" GPU memory, written by the simulated
vLLM server); an entry counts only while its PID is alive (not a zombie) and its start time still
matches, so killed workers free their memory and a reused PID does not inherit it. The same
registry gives the host's CPU memory: write_meminfo() keeps `<hostdir>/meminfo` (the simulated
/proc/meminfo) in step; the simulated vLLM server calls it when its workers come and go. Process facts
come from /proc (not psutil: importing it was most of each call's CPU, and the suite calls this
program thousands of times).

Output formats follow real nvidia-smi 580 (see tests/fixtures/nvidia-smi/ for recorded samples):
  --query-gpu=FIELDS --format=csv[,noheader][,nounits]     "0, NVIDIA ..., 97887 MiB, 0 MiB, ..."
  --query-compute-apps=FIELDS --format=csv[,noheader][,nounits]
        header of used_memory is "used_gpu_memory [MiB]"; no processes -> header only
  -L                                                       "GPU 0: NAME (UUID: GPU-...)"
  (no arguments)                                           the banner table with
        "Driver Version: X      CUDA Version: Y" and the Processes section
  -i INDEX[,INDEX]                                         restricts GPUs (and their processes)

On a host whose vLLM is the REAL one (vLLM's CPU build, `sim.json` "real_vllm"), the processes that
hold GPU memory on a GPU host are found in /proc instead: vLLM's engine and worker processes
(titles `VLLM::EngineCore*`, `VLLM::Worker*`; the API server and `VLLM::DPCoordinator` hold no GPU)
started in one of the host's model folders (a service's working directory) or marked with this
host's VLLM_SIM_HOST_DIR (a `vllm serve` started by hand). Each "holds" its resident memory on the
GPU its CUDA_VISIBLE_DEVICES and its data/tensor-parallel rank name, so orphans of a killed server
stay visible exactly as real orphaned workers do.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

HOST_DIR = Path(os.environ.get("VLLM_SIM_HOST_DIR") or Path(__file__).resolve().parent.parent)
RESERVED_MIB = 445     # driver-reserved memory: memory.free = total - used - reserved, as on real cards
DEFAULT_GPU = {"name": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "memory_total_mib": 97887}

# field -> (header with units, unit suffix for values)
GPU_FIELDS = {
    "index": ("index", ""), "name": ("name", ""), "uuid": ("uuid", ""),
    "memory.total": ("memory.total [MiB]", " MiB"), "memory.used": ("memory.used [MiB]", " MiB"),
    "memory.free": ("memory.free [MiB]", " MiB"),
    "memory.reserved": ("memory.reserved [MiB]", " MiB"),
    "driver_version": ("driver_version", ""), "utilization.gpu": ("utilization.gpu [%]", " %"),
    "utilization.memory": ("utilization.memory [%]", " %"), "count": ("count", ""),
    "pci.bus_id": ("pci.bus_id", ""), "compute_cap": ("compute_cap", ""),
    "temperature.gpu": ("temperature.gpu", ""), "power.draw": ("power.draw [W]", " W"),
    "power.limit": ("power.limit [W]", " W"), "pstate": ("pstate", ""),
    "persistence_mode": ("persistence_mode", ""), "serial": ("serial", ""),
}
APP_FIELDS = {
    "pid": ("pid", ""), "process_name": ("process_name", ""), "name": ("process_name", ""),
    "used_memory": ("used_gpu_memory [MiB]", " MiB"),
    "used_gpu_memory": ("used_gpu_memory [MiB]", " MiB"),
    "gpu_uuid": ("gpu_uuid", ""), "gpu_name": ("gpu_name", ""), "gpu_bus_id": ("gpu_bus_id", ""),
    "gpu_serial": ("gpu_serial", ""),
}


def _read_json(path: Path, default):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def proc_start_time(pid: int):
    """When the process started, in seconds after boot (None if it is gone): with the PID, the
    identity of one process (PIDs are reused). Boot-relative, so a wall-clock step changes nothing.
    The simulated vLLM server records its GPU holders with the same rule."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
    return round(ticks / os.sysconf("SC_CLK_TCK"), 2)


def proc_alive(pid: int, start_time=None) -> bool:
    """The process runs - a zombie (exited, not reaped) holds nothing and counts as dead - and,
    given the start time recorded with it, it is still that process and not a reused PID."""
    try:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return False
    except (OSError, IndexError):
        return False
    if start_time is None:
        return True
    now = proc_start_time(pid)
    return now is not None and abs(now - float(start_time)) < 0.015


_REAL_HOLDER = re.compile(r"^VLLM::(EngineCore|Worker)")


def _proc_title(pid) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return ""


def _rank(title: str, key: str) -> int:
    m = re.search(rf"_{key}(\d+)", title)
    return int(m.group(1)) if m else 0


def _visible_devices(env: dict, ppid: str) -> str:
    """CUDA_VISIBLE_DEVICES of a process, else of its nearest ancestor that has it: vLLM's CPU build
    starts data-parallel engines without it (it narrows CPU_VISIBLE_MEMORY_NODES instead)."""
    for _ in range(8):
        if "CUDA_VISIBLE_DEVICES" in env:
            return env["CUDA_VISIBLE_DEVICES"]
        try:
            env = dict(item.split("=", 1) for item in Path(f"/proc/{ppid}/environ").read_bytes()
                       .decode(errors="replace").split("\0") if "=" in item)
            ppid = Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            break
    return "0"


def real_vllm_holders(roots, host_dir: Path = HOST_DIR) -> list:
    """Processes of a real vLLM that a GPU would list, as gpu-procs entries (see the module doc)."""
    out = []
    roots = [str(r).rstrip("/") + "/" for r in roots]
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        title = _proc_title(d.name)
        if not _REAL_HOLDER.match(title):
            continue
        try:
            cwd = os.readlink(d / "cwd").rstrip("/") + "/"
            env = dict(item.split("=", 1) for item in
                       (d / "environ").read_bytes().decode(errors="replace").split("\0") if "=" in item)
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            rss_kib = next((int(line.split()[1]) for line in (d / "status").read_text().splitlines()
                            if line.startswith("VmRSS:")), 0)
        except (OSError, ValueError, IndexError):
            continue
        if stat[0] == "Z":
            continue
        if not (any(cwd.startswith(r) for r in roots) or env.get("VLLM_SIM_HOST_DIR") == str(host_dir)):
            continue
        visible = [int(x) for x in _visible_devices(env, stat[1]).split(",") if x.strip().isdigit()]
        parent = _proc_title(stat[1])
        dp = _rank(title, "DP") or _rank(parent, "DP")
        pos = dp + _rank(title, "TP")
        out.append({"pid": int(d.name), "process_name": title, "used_mib": max(1, rss_kib // 1024),
                    "gpu_index": (visible or [0])[pos % max(1, len(visible))],
                    "start_time": int(stat[19])})
    return out


def load_state():
    sim = _read_json(HOST_DIR / "sim.json", {})
    gpus = []
    for i, g in enumerate(sim.get("gpus") or [dict(DEFAULT_GPU, index=n) for n in range(8)]):
        g = dict(DEFAULT_GPU, **g)
        g.setdefault("index", i)
        g.setdefault("uuid", f"GPU-{i:08x}-0000-0000-0000-000000000000")
        g["bus_id"] = f"00000000:{0x18 + 0x10 * int(g['index']):02X}:00.0"
        gpus.append(g)
    procs = []
    for f in sorted((HOST_DIR / "gpu-procs").glob("*.json")):
        e = _read_json(f, None)
        if e and proc_alive(int(e["pid"]), e.get("start_time")):
            procs.append(e)
    if sim.get("real_vllm"):
        procs += real_vllm_holders(sim["real_vllm"].get("models_roots") or [])
    for g in gpus:
        mine = [p for p in procs if int(p["gpu_index"]) == int(g["index"])]
        g["used"] = sum(int(p["used_mib"]) for p in mine)
        g["util"] = max([int(p.get("utilization", 0)) for p in mine] or [0])
    return sim, gpus, procs


# -- the host's memory ---------------------------------------------------------------------------
# A simulated host's RAM, scaled like its files: sim.json's ram_bytes and available_bytes (real
# bytes: `vllm-orch sim up --ram-gib/--available-gib`) divided by its scale, minus the CPU memory of
# every live simulated vLLM worker (the cpu_bytes of its gpu-procs entry, with the same liveness as
# GPU memory: a killed worker frees it). Written to <hostdir>/meminfo in /proc/meminfo's format, the
# file the host's inventory entry names as its `meminfo`. Like a kernel's MemAvailable, it does not
# drop when files are read into the page cache (cache counts as available).
DEFAULT_RAM_BYTES = 1536 * 2 ** 30           # a typical 8-GPU server: 1.5 TiB
DEFAULT_AVAILABLE_BYTES = 1472 * 2 ** 30     # 64 GiB for the OS and everything but vLLM


def meminfo_text(host_dir: Path) -> str:
    sim = _read_json(host_dir / "sim.json", {})
    scale = max(1, int(sim.get("scale") or 1))
    total = int(sim.get("ram_bytes") or DEFAULT_RAM_BYTES) // scale
    available = min(total, int(sim.get("available_bytes") or DEFAULT_AVAILABLE_BYTES) // scale)
    workers: dict = {}
    for f in (host_dir / "gpu-procs").glob("*.json"):
        e = _read_json(f, None)
        if e and e.get("cpu_bytes") and proc_alive(int(e["pid"]), e.get("start_time")):
            workers[int(e["pid"])] = int(e["cpu_bytes"])
    available = max(0, available - sum(workers.values()))
    return (f"MemTotal:       {total // 1024:>8} kB\nMemFree:        {available // 1024:>8} kB\n"
            f"MemAvailable:   {available // 1024:>8} kB\n")


def write_meminfo(host_dir: Path | None = None) -> None:
    host_dir = Path(host_dir or HOST_DIR)
    text = meminfo_text(host_dir)
    tmp = host_dir / f".meminfo.{os.getpid()}"
    try:
        tmp.write_text(text)
        os.replace(tmp, host_dir / "meminfo")
    except PermissionError:         # the service user in a container: the folder is root's,
        try:                        # the file (made writable for it) is rewritten in place
            with open(host_dir / "meminfo", "r+") as f:
                f.write(text)
                f.truncate()
        except OSError:
            pass
    except OSError:
        pass


def gpu_value(field: str, g: dict, sim: dict, n: int):
    total = int(g["memory_total_mib"])
    used = min(int(g["used"]), total - RESERVED_MIB)
    return {
        "index": g["index"], "name": g["name"], "uuid": g["uuid"], "memory.total": total,
        "memory.used": used, "memory.free": total - used - RESERVED_MIB,
        "memory.reserved": RESERVED_MIB, "driver_version": sim.get("driver_version", "580.95.05"),
        "utilization.gpu": g["util"], "utilization.memory": min(100, g["util"]), "count": n,
        "pci.bus_id": g["bus_id"], "compute_cap": "12.0", "temperature.gpu": 32 + g["util"] // 3,
        "power.draw": f"{60 + 5.4 * g['util']:.2f}", "power.limit": "600.00",
        "pstate": "P0" if used else "P8", "persistence_mode": "Enabled", "serial": "[N/A]",
    }[field]


def csv_out(rows: list, fields: list, table: dict, header: bool, units: bool) -> str:
    lines = []
    if header:
        lines.append(", ".join(table[f][0] if units else table[f][0].split(" [")[0]
                               for f in fields))
    for row in rows:
        lines.append(", ".join(f"{row[f]}{table[f][1] if units else ''}" for f in fields))
    return "".join(line + "\n" for line in lines)


def banner(sim: dict, gpus: list, procs: list) -> str:
    drv, cuda = sim.get("driver_version", "580.95.05"), sim.get("cuda_version", "13.0")
    sep = "+-----------------------------------------+------------------------+----------------------+"
    full = "+-----------------------------------------------------------------------------------------+"
    out = [time.strftime("%a %b %d %H:%M:%S %Y") + "       ", full,
           f"| NVIDIA-SMI {drv:<22}Driver Version: {drv:<15}CUDA Version: {cuda:<9}|", sep,
           "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
           "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
           "|                                         |                        |               MIG M. |",
           "|=========================================+========================+======================|"]
    for g in gpus:
        name = g["name"] if len(g["name"]) <= 26 else g["name"][:23] + "..."
        util = g["util"]
        used = min(int(g["used"]), int(g["memory_total_mib"]))
        power = f"{60 + 5.4 * util:.0f}W /  600W"
        mem = f"{used}MiB /  {g['memory_total_mib']}MiB"
        out.append(f"| {g['index']:>3}  {name:<26}    On  |   {g['bus_id']} Off |"
                   f"                  Off |")
        out.append(f"| N/A   {32 + util // 3}C    {'P0' if used else 'P8'}  {power:>24} |"
                   f" {mem:>22} | {util:>6}%      Default |")
        out.append("|                                         |                        |"
                   "                  N/A |")
        out.append(sep)
    out += ["", full,
            "| Processes:                                                                              |",
            "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
            "|        ID   ID                                                               Usage      |",
            "|=========================================================================================|"]
    if not procs:
        out.append("|  No running processes found                                                             |")
    for p in sorted(procs, key=lambda p: (int(p["gpu_index"]), int(p["pid"]))):
        name = str(p["process_name"])
        name = name if len(name) <= 33 else "..." + name[-30:]
        out.append(f"|  {int(p['gpu_index']):>3}   N/A  N/A  {int(p['pid']):>14}      C   {name:<33}"
                   f" {str(p['used_mib']) + 'MiB':>10} |")
    out.append(full)
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, i = {}, 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--") and "=" in a:
            k, v = a.split("=", 1)
            opts[k] = v
        elif a in ("-i", "--id", "--format", "--query-gpu", "--query-compute-apps") and \
                i + 1 < len(argv):
            opts["--id" if a == "-i" else a] = argv[i + 1]
            i += 1
        elif a in ("-L", "--list-gpus"):
            opts["-L"] = ""
        elif a in ("-h", "--help"):
            print("NVIDIA System Management Interface -- v" + "580.95.05 (SIMULATED)")
            return 0
        else:
            print("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.")
            return 2
        i += 1
    sim, gpus, procs = load_state()
    if "--id" in opts:
        want = {int(x) for x in opts["--id"].split(",") if x.strip().isdigit()}
        if not want or any(w >= len(gpus) for w in want):
            print("No devices were found")
            return 6
        gpus = [g for g in gpus if int(g["index"]) in want]
        procs = [p for p in procs if int(p["gpu_index"]) in want]
    fmt = [f.strip() for f in opts.get("--format", "").split(",") if f.strip()]
    header, units = "noheader" not in fmt, "nounits" not in fmt
    if "-L" in opts:
        sys.stdout.write("".join(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})\n"
                                 for g in gpus))
        return 0
    for key, table in (("--query-gpu", GPU_FIELDS), ("--query-compute-apps", APP_FIELDS)):
        if key not in opts:
            continue
        fields = [f.strip() for f in opts[key].split(",") if f.strip()]
        bad = [f for f in fields if f not in table]
        if bad:
            print(f'Field "{bad[0]}" is not a valid field to query.')
            return 2
        if "csv" not in fmt:
            print('"--format" must be specified with "--query-gpu" or "--query-compute-apps".')
            return 2
        if key == "--query-gpu":
            rows = [{f: gpu_value(f, g, sim, len(gpus)) for f in fields} for g in gpus]
        else:
            by_index = {int(g["index"]): g for g in gpus}
            rows = []
            for p in sorted(procs, key=lambda p: (int(p["gpu_index"]), int(p["pid"]))):
                g = by_index[int(p["gpu_index"])]
                full = {"pid": p["pid"], "process_name": p["process_name"],
                        "name": p["process_name"], "used_memory": p["used_mib"],
                        "used_gpu_memory": p["used_mib"], "gpu_uuid": g["uuid"],
                        "gpu_name": g["name"], "gpu_bus_id": g["bus_id"], "gpu_serial": "[N/A]"}
                rows.append({f: full[f] for f in fields})
        sys.stdout.write(csv_out(rows, fields, table, header, units))
        return 0
    sys.stdout.write(banner(sim, gpus, procs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
