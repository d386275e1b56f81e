"""Creating, inspecting and removing SIMULATED GPU hosts (the `vllm-orch sim` commands' logic).

A sim home (`sim/` in vllm-orch's state home: $VLLM_ORCH_STATE_HOME, default
~/.local/state/vllm-orch) holds `hosts/<name>/` (one folder per simulated host, made by prepare_host
below) and `sim.json` (every process `up` started, by PID and /proc start time, so `down` stops
exactly those and never a reused PID). The hosts reach the orchestrator as ordinary inventory
entries (orchestrator.sim.inventory) in `hosts.d/sim.yaml` beside the sim home: the state home's
extra-inventory folder, which the orchestrator always reads.

A host is created with one of two vLLMs and keeps it: the SIMULATED server (default), or the REAL
one (`up(real_vllm=True)`, CLI `--real-vllm`): vLLM's CPU build from a cached venv
(devtools/real_vllm_venv.py), serving the tiny models the hub mirror publishes (sim/tinymodel.py).
Such a host fakes no Python packages; only the GPUs are simulated, and the fake nvidia-smi lists
the real vLLM's engine and worker processes as GPU holders.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from orchestrator.config.inventory import state_home
from orchestrator.errors import ConfigError, OrchestratorError, RefusedError
from orchestrator.paths import package_file
from orchestrator.sim import fault_file
from orchestrator.sim import nvidia_smi as smi
from orchestrator.sim.inventory import SimHost

GPU_NAME = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
GPU_MEMORY_MIB = 97887
DRIVER_VERSION = "580.95.05"
CUDA_VERSION = "13.0"
VLLM_VERSION = "0.33.0"
DISTS = {"vllm": VLLM_VERSION, "torch": "2.14.0+cu130", "flashinfer-python": "0.7.2.post1",
         "flashinfer-cubin": "0.7.2.post1"}          # what vllm-0.33.0's METADATA requires (sim/engines.py REQUIRES)
DEFAULT_SPEED = 200.0
GIB = 1 << 30
DEFAULT_SCALE = 10000
HUB_START_TIMEOUT_S = 15.0
# Process hosts after the first serve on their own port (8100, 8200, ...): see SimHost.serving_port.
PROCESS_HOST_PORT_BASE = 8000
PROCESS_HOST_PORT_STEP = 100
# The mirror's faults (orchestrator/sim/hub.py documents them; it may export HUB_FAULTS instead).
HUB_FAULTS = {
    "hub-5xx": "the mirror answers one /resolve request with 503",
    "hub-drop": "the mirror drops the connection half way through one LFS file",
    "hub-corrupt": "the mirror flips bytes in one .safetensors body",
    "hub-slow": "the mirror throttles bodies (~2 MB/s) until cleared",
}


def sim_home() -> Path:
    return state_home() / "sim"


def inventory_file(home: Path | None = None) -> Path:
    """The inventory file `up` writes: hosts.d/sim.yaml of the state home the sim home is in."""
    return (home or sim_home()).parent / "hosts.d" / "sim.yaml"


def inventory_hosts(home: Path | None = None) -> dict:
    """The host entries `up` wrote (name -> the mapping in hosts.d/sim.yaml), as the inventory reads them."""
    return yaml.safe_load(inventory_file(home).read_text())["hosts"]


def host_name(i: int) -> str:
    return "sim" if i == 0 else f"sim-{i + 1}"


def host_dir(name: str, home: Path | None = None) -> Path:
    return (home or sim_home()) / "hosts" / name


# -- processes ---------------------------------------------------------------------------------
# One liveness rule for everything simulated: the standalone fake nvidia-smi's (a running process that
# is the one recorded - not a reused PID, not an unreaped zombie).
from orchestrator.sim.nvidia_smi import proc_alive as alive  # noqa: E402
from orchestrator.sim.nvidia_smi import proc_start_time as start_time  # noqa: E402


def stop_pid(pid: int, started: float | None, timeout: float = 5.0) -> bool:
    """SIGTERM, wait, then SIGKILL; only if the PID is still the recorded process."""
    if not alive(pid, started):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap(pid)
        if not alive(pid, started):
            return True
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for _ in range(40):
        _reap(pid)
        if not alive(pid, started):
            break
        time.sleep(0.05)
    return True


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


# -- host folders ------------------------------------------------------------------------------
def gpu_uuid(host: str, index: int) -> str:
    u = str(uuid.uuid5(uuid.NAMESPACE_URL, f"vllm-orch-sim/{host}/{index}"))
    return f"GPU-{u}"


def write_dist(site: Path, dist: str, version: str) -> None:
    """A fake `<dist>-<version>.dist-info` that importlib.metadata reads like an installed one."""
    norm = dist.replace("-", "_")
    for old in site.glob(f"{norm}-*.dist-info"):
        shutil.rmtree(old)
    d = site / f"{norm}-{version}.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
                                "Summary: SIMULATED package (vllm-orch sim host)\n")
    (d / "INSTALLER").write_text("vllm-orch-sim\n")


def install_program(src: str, dest: Path, python: str) -> None:
    text = package_file("sim", src).read_text()
    lines = text.split("\n")
    if lines[0].startswith("#!"):
        lines = lines[1:]
    dest.write_text(f"#!{python}\n" + "\n".join(lines))
    dest.chmod(0o755)


def prepare_host(name: str, hdir: Path, *, speed: float, scale: int, flavour: str,
                 python: str, cpu_vllm: dict | None = None, ram_gib: float | None = None,
                 available_gib: float | None = None) -> dict:
    """Create or refresh a host folder; keeps models, state, logs, pending faults and any
    fault-modified site-packages (so `up` twice changes nothing that matters). RAM and available
    memory (real GiB, reported scaled like the files: orchestrator/sim/nvidia_smi.py) keep their
    earlier values when not given.
    cpu_vllm: {"venv", "version", ...} of vLLM's CPU build when the host's vLLM is the real one."""
    for sub in ("bin", "gpu-procs", "models", "units", "state", "logs", "run"):
        (hdir / sub).mkdir(parents=True, exist_ok=True)
    install_program("vllm_server.py", hdir / "bin" / "vllm", python)
    install_program("gpu_holder.py", hdir / "bin" / "gpu_holder.py", python)     # the server's workers
    install_program("nvidia_smi.py", hdir / "bin" / "nvidia-smi", python)
    site = hdir / "site-packages"
    site.mkdir(exist_ok=True)
    for dist, version in DISTS.items():
        if not cpu_vllm and not list(site.glob(f"{dist.replace('-', '_')}-*.dist-info")):
            write_dist(site, dist, version)
    if not (hdir / "faults.json").exists():
        (hdir / "faults.json").write_text("[]\n")
    old = _read_json(hdir / "sim.json", {})
    info = {"host": name, "simulated": True, "flavour": flavour, "speed": float(speed),
            "scale": int(scale),
            "gpus": [{"index": i, "name": GPU_NAME, "memory_total_mib": GPU_MEMORY_MIB,
                      "uuid": gpu_uuid(name, i)} for i in range(8)],
            "driver_version": DRIVER_VERSION, "cuda_version": CUDA_VERSION,
            "vllm_version": VLLM_VERSION, "hub_port": old.get("hub_port")}
    if cpu_vllm:
        # Where the fake nvidia-smi looks for the real vLLM's processes: the working directory of
        # a service is its model folder (this folder's models/, or the container's models root:
        # inside its own PID namespace, the container's nvidia-smi sees only its own processes).
        info["vllm_version"] = cpu_vllm["version"]
        root = str(hdir / "models") if flavour == "process" else CONTAINER_MODELS_ROOT
        info["real_vllm"] = {"venv": cpu_vllm["venv"], "models_roots": [root]}
    info.update(memory_fields(old, ram_gib, available_gib))
    _write_json(hdir / "sim.json", info)
    smi.write_meminfo(hdir)
    if flavour == "systemd":
        # The service runs as an unprivileged user (vllm-orch's default `vllm`) in the container: the
        # simulated GPU bookkeeping it writes must be writable by any user, as the real driver's is,
        # in sticky folders (like /tmp: nobody removes another's files). The host folder itself stays
        # root's: it holds the programs root runs (bin/nvidia-smi, bin/vllm).
        hdir.chmod(0o755)
        for path in (hdir / "gpu-procs", hdir / "run", hdir / "logs"):
            path.chmod(0o1777)
        for path in (hdir / "faults.json", hdir / "faults.json.lock", hdir / "meminfo"):
            path.touch()
            path.chmod(0o666)
    return info


def memory_fields(old: dict, ram_gib: float | None, available_gib: float | None) -> dict:
    """sim.json's ram_bytes/available_bytes (real bytes): given values, else the earlier ones, else
    a typical 8-GPU server (1.5 TiB, 64 GiB of it used by the OS and everything but vLLM)."""
    ram = int(ram_gib * GIB) if ram_gib is not None else int(old.get("ram_bytes") or smi.DEFAULT_RAM_BYTES)
    if available_gib is not None:
        available = int(available_gib * GIB)
    elif ram_gib is not None:
        available = ram - (smi.DEFAULT_RAM_BYTES - smi.DEFAULT_AVAILABLE_BYTES)
    else:
        available = int(old.get("available_bytes") or smi.DEFAULT_AVAILABLE_BYTES)
    if not 0 < available <= ram:
        raise ConfigError(f"available memory ({available / GIB:g} GiB) must be more than 0 and at most the "
                          f"host's RAM ({ram / GIB:g} GiB)")
    return {"ram_bytes": ram, "available_bytes": available}


def set_memory(host: str, *, ram_gib: float | None = None, available_gib: float | None = None,
               home: Path | None = None) -> dict:
    """Change a SIMULATED host's RAM or available memory now (e.g. another process took memory
    while a warm-up runs); its meminfo follows at once."""
    hdir = _existing_host(host, home)
    info = _read_json(hdir / "sim.json", {})
    info.update(memory_fields(info, ram_gib, available_gib))
    _write_json(hdir / "sim.json", info)
    smi.write_meminfo(hdir)
    return info


def _read_json(path: Path, default):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


# -- hub mirror --------------------------------------------------------------------------------
def hub_available() -> bool:
    return importlib.util.find_spec("orchestrator.sim.hub") is not None


def start_hub(hdir: Path, scale: int = DEFAULT_SCALE, python: str = sys.executable,
              bind: str = "127.0.0.1") -> dict:
    """Start the host's Hugging Face Hub mirror; returns {"pid", "start_time", "port"}."""
    port_file = hdir / "hub.port"
    port_file.unlink(missing_ok=True)
    log = open(hdir / "logs" / "hub.log", "ab")
    env = dict(os.environ)
    root = str(package_file().parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen([python, "-m", "orchestrator.sim.hub", "--host-dir", str(hdir),
                             "--port", "0", "--bind", bind, "--scale", str(scale)],
                            stdout=log, stderr=log,
                            stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    log.close()
    deadline = time.monotonic() + HUB_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text().strip().isdigit():
            return {"pid": proc.pid, "start_time": start_time(proc.pid),
                    "port": int(port_file.read_text().strip())}
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    tail = (hdir / "logs" / "hub.log").read_text(errors="replace").strip().splitlines()[-3:]
    raise RefusedError(f"the SIMULATED hub mirror for {hdir.name} did not start",
                       details=tail, hint=f"see {hdir / 'logs' / 'hub.log'}")


# -- the real vLLM (CPU build) -----------------------------------------------------------------
CONTAINER_MODELS_ROOT = "/var/lib/vllm-orch/models"


def real_vllm_env(build: bool = True) -> dict:
    """{"venv", "vllm", "python", "version"} of vLLM's CPU build, building the venv if needed
    (minutes, once per machine). ConfigError when it cannot be built."""
    from orchestrator.devtools import real_vllm_venv as rv

    if not build and not rv.is_built():
        raise ConfigError("vLLM's CPU build is not built on this machine",
                          hint="python -m orchestrator.devtools.real_vllm_venv")
    try:
        info = rv.ensure_venv()
    except rv.BuildError as exc:
        raise ConfigError(f"could not build vLLM's CPU build venv: {exc}",
                          details=exc.log.strip().splitlines()[-5:]) from None
    venv = info.python.parent.parent
    return {"venv": str(venv), "vllm": str(rv.vllm_path(venv)), "python": str(info.python),
            "version": rv.VLLM_VERSION}


def real_vllm_processes(hdir: Path) -> list[tuple[int, int | None]]:
    """(pid, start time) of every real vLLM process of this host folder: started in one of its
    model folders (services) or marked with VLLM_SIM_HOST_DIR (by hand), API servers included."""
    out = []
    models = str(hdir.resolve() / "models") + "/"
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cwd = os.readlink(d / "cwd").rstrip("/") + "/"
            marked = f"VLLM_SIM_HOST_DIR={hdir}".encode() in (d / "environ").read_bytes().split(b"\0")
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        vllm_like = argv[0].startswith(b"VLLM::") or any(b"vllm" in a for a in argv[:3])
        if vllm_like and (cwd.startswith(models) or marked):
            out.append((int(d.name), start_time(int(d.name))))
    return out


def stop_all(procs: list[tuple[int, int | None]], timeout: float = 20.0) -> list[int]:
    """SIGTERM every (pid, start time) at once (an API server then stops its engines), wait, SIGKILL
    what is left; only processes that are still the recorded ones."""
    live = [(p, st) for p, st in procs if alive(p, st)]
    for pid, _ in live:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p, st) for p, st in live):
        for pid, _ in live:
            _reap(pid)
        time.sleep(0.1)
    for pid, st in live:
        if alive(pid, st):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return [p for p, _ in live]


# -- state -------------------------------------------------------------------------------------
def load_state(home: Path | None = None) -> dict:
    return _read_json((home or sim_home()) / "sim.json", {})


def up(hosts: int = 1, *, speed: float | None = None, scale: int = DEFAULT_SCALE,
       systemd: bool = False, vllm_python: str | None = None, real_vllm: bool = False,
       ram_gib: float | None = None, available_gib: float | None = None, home: Path | None = None) -> dict:
    """Create/refresh `hosts` simulated hosts and start what is not running. Idempotent: hosts
    already up keep their processes (hosts beyond `hosts` from an earlier `up` are kept too);
    speed None keeps a host's speed (DEFAULT_SPEED for a new host), RAM and available memory
    None keep a host's (1.5 TiB and 1.4 TiB for a new one). real_vllm: new hosts run vLLM's CPU
    build instead of the simulated server (a host keeps the vLLM it was created with)."""
    if hosts < 1:
        raise ConfigError("--hosts must be at least 1")
    if real_vllm and vllm_python:
        raise ConfigError("--real-vllm and --vllm-python cannot be combined",
                          hint="--real-vllm brings its own Python (vLLM's CPU build)")
    home = home or sim_home()
    home.mkdir(parents=True, exist_ok=True)
    state = load_state(home) or {"simulated": True, "hosts": {}}
    state["simulated"] = True
    for name, rec in state["hosts"].items():
        if real_vllm and not rec.get("real_vllm"):
            raise RefusedError(f"SIMULATED host {name} is up with the simulated vLLM; a host keeps "
                               "the vLLM it was created with", hint="vllm-orch sim down, then sim up --real-vllm")
    cpu = real_vllm_env() if real_vllm or any(r.get("real_vllm") for r in state["hosts"].values()) \
        else None
    flavour = "systemd" if systemd else "process"
    nspawn = _nspawn() if systemd else None
    tree = _tree(nspawn) if nspawn else None
    inventory: dict[str, dict[str, Any]] = {"hosts": {}}
    for i in range(max(hosts, len(state["hosts"]))):
        name = host_name(i)
        rec = state["hosts"].get(name)
        if rec is None and i >= hosts:
            continue
        rec = rec or {"flavour": flavour, "processes": {}, "real_vllm": real_vllm}
        host_cpu = cpu if rec.get("real_vllm") else None
        hdir = host_dir(name, home)
        started = []
        keep = rec.get("speed") or DEFAULT_SPEED
        info = prepare_host(name, hdir, speed=speed if speed and i < hosts else keep,
                            scale=scale, flavour=rec["flavour"],
                            python=sys.executable if rec["flavour"] == "process"
                            else "/usr/bin/env python3", cpu_vllm=host_cpu,
                            ram_gib=ram_gib if i < hosts else None,
                            available_gib=available_gib if i < hosts else None)
        rec.update({"dir": str(hdir), "speed": info["speed"], "scale": scale})
        hub = rec["processes"].get("hub")
        bind = "127.0.0.1"
        if rec["flavour"] == "systemd":
            # The container reaches the mirror on its veth gateway: set the network up first.
            nspawn = nspawn or _nspawn()
            # machine (and network namespace) names and addresses are machine-wide: two sim homes
            # (two test runs) each have a host `sim`, so the container's name carries the home's
            # tag, and addresses are taken under the lock the test fixtures take too
            rec.setdefault("machine", f"{name}-{hashlib.sha1(str(home).encode()).hexdigest()[:6]}")
            cache = _tree_cache(nspawn)
            cache.mkdir(parents=True, exist_ok=True)
            with open(cache / "hosts.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if "index" not in rec:
                    rec["index"] = nspawn.free_index(1, 149)   # tests' fixtures use 150..254
                bind = nspawn.prepare_network(rec["machine"], rec["index"])["gateway"]
        if hub_available() and not (hub and alive(hub["pid"], hub["start_time"])):
            rec["processes"]["hub"] = hub = start_hub(hdir, scale, bind=bind)
            started.append(f"hub mirror pid {hub['pid']}")
        hub_port = hub["port"] if hub and alive(hub["pid"], hub["start_time"]) else None
        info["hub_port"] = hub_port
        _write_json(hdir / "sim.json", info)
        if vllm_python and i < hosts:
            rec["python"] = vllm_python
        real_python = rec.get("python") or vllm_python      # a Python with a real vLLM, if given
        sim_host = SimHost(name, hdir, rec["flavour"], info["speed"], scale,
                           python=real_python or sys.executable, real_vllm=bool(real_python),
                           hub_port=hub_port, cpu_vllm=host_cpu,
                           serving_port=PROCESS_HOST_PORT_BASE + PROCESS_HOST_PORT_STEP * i if i else None)
        if rec["flavour"] == "systemd":
            nspawn = nspawn or _nspawn()
            box = rec["processes"].get("nspawn")
            if not (box and alive(box["pid"], box.get("start_time"))):
                tree = tree or _tree(nspawn)
                binds = [nspawn.venv_bind(Path(host_cpu["venv"]), tree)] if host_cpu else []
                # a persistent root: what vllm-orch installs survives `sim reboot`, as on a real host
                try:
                    box = dict(nspawn.boot(rec["machine"], rec["index"], hdir, tree, hub_port=hub_port,
                                           binds_ro=binds, persistent=True))
                except BaseException:      # not recorded yet, so `sim down` could not stop the mirror
                    if hub and "hub mirror" in " ".join(started):
                        stop_pid(hub["pid"], hub["start_time"])
                    raise
                box["start_time"] = start_time(box["_pid"])
                box["pid"] = box["_pid"]
                rec["processes"]["nspawn"] = box
                started.append(f"systemd-nspawn container pid {box['pid']}")
            sim_host.container = {k: v for k, v in box.items() if k not in ("pid", "start_time")}
            sim_host.real_vllm = False          # the container's own /opt/vllm, never --vllm-python
        rec["started_now"] = started
        state["hosts"][name] = rec
        inventory["hosts"][name] = sim_host.host_entry()
    state["hub_available"] = hub_available()
    _write_json(home / "sim.json", state)
    inv = inventory_file(home)
    inv.parent.mkdir(parents=True, exist_ok=True)
    inv.write_text("# SIMULATED GPU hosts written by `vllm-orch sim up` (removed by `vllm-orch sim down`)\n"
                   + yaml.safe_dump(inventory, sort_keys=False))
    return state


def reboot(name: str, home: Path | None = None) -> dict:
    """`systemctl reboot` inside a systemd-flavoured SIMULATED host, then boot it again: enabled
    units start, what was only started does not. Returns the container's new record."""
    home = home or sim_home()
    state = load_state(home)
    rec = (state.get("hosts") or {}).get(name)
    if rec is None or rec.get("flavour") != "systemd" or "nspawn" not in rec.get("processes", {}):
        raise ConfigError(f"{name!r} is not a running systemd-flavoured SIMULATED host",
                          hint="vllm-orch sim up --systemd")
    box = dict(_nspawn().reboot(rec["processes"]["nspawn"]))
    box["start_time"] = start_time(box["_pid"])
    box["pid"] = box["_pid"]
    rec["processes"]["nspawn"] = box
    _write_json(home / "sim.json", state)
    return box


def _tree_cache(nspawn) -> Path:
    """One container tree per machine, shared with the test fixtures (built once, ~55 s)."""
    return Path(os.environ.get("VLLM_ORCH_NSPAWN_CACHE") or nspawn.DEFAULT_CACHE_DIR)


def _nspawn():
    """The container module, once this machine can run containers: --systemd needs root (the
    containers, their network namespaces and the tree debootstrap builds) and systemd-nspawn and
    debootstrap on PATH. Refused here (exit 3, one line) before anything is built or started."""
    if importlib.util.find_spec("orchestrator.sim.nspawn") is None:
        raise RefusedError("--systemd needs orchestrator.sim.nspawn, which is not installed "
                           "in this build", hint="use the default flavour: vllm-orch sim up")
    if os.geteuid() != 0:
        raise RefusedError("--systemd runs each SIMULATED host as a systemd-nspawn container, which "
                           "needs root", hint="run it as root (sudo), or use the default flavour: "
                                              "vllm-orch sim up")
    missing = [p for p in ("systemd-nspawn", "debootstrap") if shutil.which(p) is None]
    if missing:
        raise RefusedError(f"--systemd needs {' and '.join(missing)}, not found on PATH",
                           hint="apt-get install systemd-container debootstrap (Debian/Ubuntu), "
                                "or use the default flavour: vllm-orch sim up")
    from orchestrator.sim import nspawn
    return nspawn


def _tree(nspawn) -> Path:
    """The containers' Debian tree (built once per machine); a failed build is one error line
    naming the step that failed, not an internal error."""
    from orchestrator.sim.nspawn_tree import TreeBuildError
    try:
        return nspawn.ensure_tree(_tree_cache(nspawn))
    except TreeBuildError as e:
        raise OrchestratorError(f"building the SIMULATED hosts' container tree failed: {e}",
                                hint="debootstrap needs a Debian mirror; see the lines above") from None


def status(home: Path | None = None) -> dict:
    """What runs, per host: mirror, containers, simulated vLLM servers and GPU holders."""
    home = home or sim_home()
    state = load_state(home)
    out: dict[str, Any] = {"simulated": True, "home": str(home), "up": bool(state.get("hosts")), "hosts": {}}
    for name, rec in (state.get("hosts") or {}).items():
        hdir = Path(rec["dir"])
        procs = {k: {"pid": p["pid"], "alive": alive(p["pid"], p.get("start_time")),
                     **({"port": p["port"]} if "port" in p else {})}
                 for k, p in rec["processes"].items()}
        servers = [s for s in (_read_json(f, None) for f in (hdir / "run").glob("vllm-*.json"))
                   if s and alive(s["pid"], s.get("start_time"))]
        holders = [h for h in (_read_json(f, None) for f in (hdir / "gpu-procs").glob("*.json"))
                   if h and alive(h["pid"], h.get("start_time"))]
        real = _read_json(hdir / "sim.json", {}).get("real_vllm")
        if real and rec["flavour"] == "process":
            from orchestrator.sim.nvidia_smi import real_vllm_holders
            holders += real_vllm_holders(real["models_roots"], hdir)
        out["hosts"][name] = {"dir": str(hdir), "flavour": rec["flavour"], "speed": rec["speed"],
                              "vllm": f"REAL {real['venv']}" if real else "SIMULATED",
                              "processes": procs, "vllm_servers": servers,
                              "gpu_holders": holders,
                              "faults": _read_json(hdir / "faults.json", [])}
    return out


def stop_gateway(pidfile: Path) -> int | None:
    """A process host's gateway (`vllm-orch gateway up`), by its record (`PGID BOOT_ID START_TIME`,
    host/services.ProcessService): its process group is signalled only while its leader is the very
    process that record names. The PGID, or None when there was none to stop."""
    try:
        pgid, _boot, started = pidfile.read_text().split()[:3]
        stat = Path(f"/proc/{int(pgid)}/stat").read_text()
    except (OSError, ValueError):
        return None
    if stat.rsplit(") ", 1)[-1].split()[19] != started:
        return None
    try:
        os.killpg(int(pgid), signal.SIGTERM)
    except OSError:
        return None
    return int(pgid)


def down(home: Path | None = None) -> list:
    """Stop every PID `up` recorded (plus simulated vLLM servers and GPU holders it finds in its
    own host folders), then remove the sim state. Returns what was stopped."""
    home = home or sim_home()
    state = load_state(home)
    stopped = []
    for name, rec in (state.get("hosts") or {}).items():
        hdir = Path(rec["dir"])
        for f in list((hdir / "run").glob("vllm-*.json")) + list(
                (hdir / "gpu-procs").glob("*.json")):
            e = _read_json(f, None)
            if e and stop_pid(int(e["pid"]), e.get("start_time")):
                stopped.append(f"{name}: {e.get('process_name', 'vllm serve')} pid {e['pid']}")
        if rec.get("real_vllm") and rec["flavour"] == "process":
            stopped += [f"{name}: real vLLM pid {p}" for p in stop_all(real_vllm_processes(hdir))]
        if rec["flavour"] == "process" and (pid := stop_gateway(hdir / "state" / "run" / "vllm-orch-gateway.pid")):
            stopped.append(f"{name}: gateway (HAProxy) process group {pid}")
        for kind, p in rec.get("processes", {}).items():
            if kind == "nspawn":
                _nspawn().shutdown(p)
                stopped.append(f"{name}: systemd-nspawn pid {p['pid']}")
            elif stop_pid(p["pid"], p.get("start_time")):
                stopped.append(f"{name}: {kind} pid {p['pid']}")
    shutil.rmtree(home / "hosts", ignore_errors=True)
    (home / "sim.json").unlink(missing_ok=True)
    inventory_file(home).unlink(missing_ok=True)
    return stopped


def reap_stale_test_hosts() -> list[str]:
    """Containers and namespaces a killed test run left behind (orchestrator/sim/nspawn.py
    reap_stale; root only, nothing without systemd-nspawn support)."""
    if os.geteuid() != 0 or importlib.util.find_spec("orchestrator.sim.nspawn") is None:
        return []
    # not _nspawn(): that refuses a machine without systemd-nspawn, where no container was ever left
    return importlib.import_module("orchestrator.sim.nspawn").reap_stale()


# -- faults ------------------------------------------------------------------------------------
def fault_catalog() -> dict:
    """name -> one-line description: the simulated server's faults and the hub mirror's."""
    spec = importlib.util.spec_from_file_location("_sim_vllm", package_file("sim", "vllm_server.py"))
    assert spec is not None and spec.loader is not None     # a .py file always has a source loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    faults = dict(mod.FAULTS)
    faults.update(HUB_FAULTS)
    if hub_available():
        try:
            exported = getattr(importlib.import_module("orchestrator.sim.hub"), "HUB_FAULTS", None)
        except Exception:   # a broken hub module must not hide the server's faults
            exported = None
        if isinstance(exported, dict):
            faults.update(exported)
    return faults


def add_fault(host: str, fault: str, model: str | None = None,
              home: Path | None = None, **extra) -> list:
    """Arm a fault; `extra` goes into its entry (`times`: starts it fires at; `after`: seconds,
    for hang-after-ready; `factor`: for slow-start)."""
    hdir = _existing_host(host, home)
    catalog = fault_catalog()
    if fault not in catalog:
        raise ConfigError(f"unknown fault {fault!r}",
                          hint="vllm-orch sim fault --list shows them")
    fault_file.add_fault(hdir, fault, model, **extra)      # locked: the server may be consuming one
    faults = _read_json(hdir / "faults.json", [])
    if fault == "crash-flashinfer":   # the real cause: mismatched packages (the release before), visible to preflight
        write_dist(hdir / "site-packages", "flashinfer-cubin", "0.7.2")
    return faults


def clear_faults(host: str, home: Path | None = None) -> None:
    hdir = _existing_host(host, home)
    fault_file.clear_faults(hdir)
    for dist, version in DISTS.items():
        write_dist(hdir / "site-packages", dist, version)


def _existing_host(host: str, home: Path | None) -> Path:
    hdir = host_dir(host, home)
    if not (hdir / "sim.json").exists():
        raise ConfigError(f"no SIMULATED host named {host!r}", hint="run: vllm-orch sim up")
    return hdir
