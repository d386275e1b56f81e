"""Real-systemd simulated hosts: a Debian tree booted by systemd-nspawn in its own network
namespace, reached over real SSH (systemd-nspawn(1) explains each flag used below).

    tree = ensure_tree(cache_dir)                  # once per machine (~55 s), cached
    info = boot("sim", 1, host_dir, tree)          # ~1-2 s; returns the host's inventory entry
    info = reboot(info)                            # `systemctl reboot` inside, then boot again
    shutdown(info)                                 # stops it and removes everything boot made

Root file system: by default every boot starts from the read-only tree with a throwaway overlay
(--volatile=overlay). `persistent=True` mounts an overlayfs whose upper layer lives in
<host_dir>/root/ instead, so what is installed on the host (units, /etc, /var) survives a reboot
like on a real machine; shutdown unmounts it, `sim down` deletes it with the host folder.

Addresses: host N is 10.200.N.2 inside its namespace; 10.200.N.1 is this machine's side of the
veth pair (where the host's hub mirror must listen). Fields starting with "_" are for shutdown and
diagnosis, not for the inventory reader.

Hosts reach each other (a multi-node service's ranks connect to its head): each namespace routes
10.200.0.0/16 through its gateway, and this machine forwards between the veths
(net.ipv4.ip_forward=1, plus an ACCEPT rule for 10.200.0.0/16 -> 10.200.0.0/16 at the top of the
FORWARD chain when iptables is installed - Docker sets that chain's policy to DROP). Both are
recorded in /run/vllm-orch-forwarding.json and undone when the last test host's veth is gone.
Reverse-path filtering (rp_filter) passes: each host's /24 is reached through its own veth.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from orchestrator.sim.nspawn_tree import DEFAULT_CACHE_DIR, SIM_MOUNT, ensure_tree, tree_key_path  # noqa: F401

CGROUP_ROOT = Path("/sys/fs/cgroup")
NSPAWN_RUN = Path("/run/systemd/nspawn")
HOSTS_NET = "10.200.0.0/16"                         # every test host's address is in it
FORWARDING_STATE = Path("/run/vllm-orch-forwarding.json")
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
_FORWARD_RULE = ["FORWARD", "-s", HOSTS_NET, "-d", HOSTS_NET, "-j", "ACCEPT"]


def addresses(index: int) -> tuple[str, str]:
    """(this machine's side, the container's address) for host number `index` (1..254)."""
    if not 1 <= index <= 254:
        raise ValueError(f"host index must be 1..254, got {index}")
    return f"10.200.{index}.1", f"10.200.{index}.2"


def netns_name(name: str) -> str:
    return f"vllm-orch-{name}"


VETH_PREFIX = "vorch"


def _veth(index: int) -> str:
    return f"{VETH_PREFIX}{index}"   # interface names are limited to 15 characters


def index_in_use(index: int) -> bool:
    """Whether host number `index` already has its veth (a live or stale container)."""
    return Path(f"/sys/class/net/{_veth(index)}").exists()


def free_index(lo: int = 1, hi: int = 254) -> int:
    """The lowest host number whose addresses are unused (hold a lock across this and boot when
    several processes allocate at once)."""
    for index in range(lo, hi + 1):
        if not index_in_use(index):
            return index
    raise RuntimeError(f"no free host number in {lo}..{hi}")


def cgroup_dirs(name: str) -> list[Path]:
    """Where the container's processes live: its own folder in each hierarchy systemd uses, so
    several containers do not share one `payload` cgroup (hybrid v1/v2 or pure v2)."""
    leaf = f"vllm-orch-{name}"
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return [CGROUP_ROOT / leaf]
    return [CGROUP_ROOT / h / leaf for h in ("unified", "systemd") if (CGROUP_ROOT / h).is_dir()]


def prepare_network(name: str, index: int) -> dict:
    """Namespace + veth pair with addresses, idempotent: a complete one is kept as it is (so a
    hub mirror already bound to the root side keeps its address), a partial one is rebuilt.
    Call this before starting anything that must listen on the root side (the hub mirror)."""
    ns, veth = netns_name(name), _veth(index)
    outside, inside = addresses(index)
    result = {"netns": ns, "veth": veth, "gateway": outside, "address": inside}
    if _has_addr([], veth, outside) and _has_addr(["-n", ns], "eth0", inside):
        _route_hosts(ns, outside)
        enable_forwarding()
        return result
    _cleanup_network(ns, veth)
    _ip("netns", "add", ns)
    _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}c", "netns", ns)
    _ip("-n", ns, "link", "set", f"{veth}c", "name", "eth0")
    _ip("addr", "add", f"{outside}/24", "dev", veth)
    _ip("link", "set", veth, "up")
    _ip("-n", ns, "addr", "add", f"{inside}/24", "dev", "eth0")
    _ip("-n", ns, "link", "set", "eth0", "up")
    _ip("-n", ns, "link", "set", "lo", "up")
    _route_hosts(ns, outside)
    enable_forwarding()
    return result


def release_network(name: str, index: int) -> None:
    """Remove what prepare_network made (for a namespace used without a container), and undo the
    forwarding when it was the last test host."""
    _cleanup_network(netns_name(name), _veth(index))
    release_forwarding()


def _route_hosts(ns: str, gateway: str) -> None:
    """The other test hosts are reached through this machine (idempotent)."""
    _ip("-n", ns, "route", "replace", HOSTS_NET, "via", gateway, "dev", "eth0")


def enable_forwarding() -> dict:
    """Let this machine forward between test hosts' veths (see the module docstring); what was
    changed is recorded so that release_forwarding can undo exactly that. Idempotent."""
    with _forwarding_lock():
        state = _read_json(FORWARDING_STATE)
        if not state:
            state = {"ip_forward": IP_FORWARD.read_text().strip(), "iptables": None}
        if IP_FORWARD.read_text().strip() != "1":
            IP_FORWARD.write_text("1\n")
        iptables = shutil.which("iptables")
        if iptables and state.get("iptables") is None:
            present = subprocess.run([iptables, "-w", "-C", *_FORWARD_RULE], capture_output=True)
            if present.returncode != 0:
                added = subprocess.run([iptables, "-w", "-I", *_FORWARD_RULE[:1], "1", *_FORWARD_RULE[1:]],
                                       capture_output=True, text=True)
                state["iptables"] = iptables if added.returncode == 0 else None
                state["iptables_error"] = added.stderr.strip() or None
        FORWARDING_STATE.write_text(json.dumps(state) + "\n")
        return state


def release_forwarding() -> bool:
    """Undo enable_forwarding once no test host's veth is left; True when it did."""
    with _forwarding_lock():
        state = _read_json(FORWARDING_STATE)
        if not state or any(Path("/sys/class/net").glob(f"{VETH_PREFIX}*")):
            return False
        if state.get("iptables"):
            subprocess.run([state["iptables"], "-w", "-D", *_FORWARD_RULE], capture_output=True)
        if state.get("ip_forward") == "0":
            IP_FORWARD.write_text("0\n")
        FORWARDING_STATE.unlink(missing_ok=True)
        return True


@contextlib.contextmanager
def _forwarding_lock():
    with open(FORWARDING_STATE.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _has_addr(where: list[str], dev: str, address: str) -> bool:
    proc = subprocess.run(["ip", *where, "-4", "-o", "addr", "show", "dev", dev, "up"],
                          capture_output=True, text=True)
    return proc.returncode == 0 and f" {address}/24 " in proc.stdout


def venv_bind(venv: Path, tree: Path) -> str:
    """A venv of this machine (the real vLLM's) to bind read-only at the same path in containers
    booted from `tree`: its scripts and pyvenv.cfg name that path, and its interpreter (pyvenv.cfg
    `home`) must exist in the tree at the same version - true for a venv made with the system
    python3 of the same Debian release (devtools/real_vllm_venv.py makes it so)."""
    from orchestrator.errors import RefusedError

    cfg = dict(line.split(" = ", 1) for line in (venv / "pyvenv.cfg").read_text().splitlines()
               if " = " in line)
    version = cfg.get("version") or cfg.get("version_info", "")
    short = ".".join(version.split(".")[:2])
    inside = tree / cfg.get("home", "/usr/bin").lstrip("/") / f"python{short}"
    probe = subprocess.run(["chroot", str(tree), f"/{inside.relative_to(tree)}", "-c",
                            "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                           capture_output=True, text=True) if inside.exists() else None
    if probe is None or probe.stdout.strip() != version:
        raise RefusedError(f"the venv {venv} (Python {version} from {cfg.get('home')}) cannot run in "
                           f"the container tree {tree}: " + (f"its python is {probe.stdout.strip() or '?'}"
                                                              if probe else f"{inside} is missing"),
                           hint="build the venv with the system python3 of the tree's Debian release "
                                "(VLLM_ORCH_REAL_VLLM_BASE_PYTHON)")
    return str(venv)


def mount_root(tree: Path, root: Path) -> Path:
    """An overlayfs over the read-only tree whose changes persist in `root` (upper/, work/);
    returns the mount point (merged/). Idempotent."""
    upper, work, merged = root / "upper", root / "work", root / "merged"
    for d in (upper, work, merged):
        d.mkdir(parents=True, exist_ok=True)
    if not os.path.ismount(merged):
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={tree},upperdir={upper},workdir={work}", str(merged)],
                       check=True, capture_output=True, text=True)
    return merged


def boot(name: str, index: int, host_dir: Path, tree: Path, *, hub_port: int | None = None,
         binds_ro: Sequence[str] = (), timeout: float = 60.0, persistent: bool = False) -> dict:
    """Boot one container and return its inventory entry once sshd answers and systemd is up.
    binds_ro: folders of this machine bound read-only at the same path (the real vLLM's venv).
    `persistent`: its root file system keeps changes across reboots (see the module docstring)."""
    from orchestrator.host.ssh import SshHost

    host_dir = Path(host_dir).resolve()
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    running = find_running(name)
    if running:
        raise RuntimeError(f"a container named {name} is already running (pid {running})")
    net = prepare_network(name, index)
    cgroups = cgroup_dirs(name)
    for cg in cgroups:
        _rmdir_tree(cg)
        cg.mkdir(parents=True, exist_ok=True)
    timings["network+cgroups"] = time.monotonic() - t0

    t = time.monotonic()
    (host_dir / "logs").mkdir(parents=True, exist_ok=True)
    console = host_dir / "logs" / "nspawn-console.log"
    root = mount_root(tree, host_dir / "root") if persistent else None
    argv = ["systemd-nspawn", "-D", str(root or tree), "-M", name, "--register=no", "--keep-unit",
            *([] if root else ["--volatile=overlay"]), "--resolv-conf=off", "--link-journal=no", "--timezone=off",
            "--console=read-only", f"--network-namespace-path=/run/netns/{net['netns']}",
            f"--bind={host_dir}:{SIM_MOUNT}", *(f"--bind-ro={p}" for p in binds_ro), "-b"]
    # Move the launching shell into our cgroups first, then exec nspawn (same PID).
    enter = "; ".join(f"echo $$ > {cg}/cgroup.procs" for cg in cgroups)
    with open(console, "wb") as out:
        proc = subprocess.Popen(["sh", "-c", f'{enter}; exec "$@"', "nspawn", *argv],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    kh = host_dir / "known_hosts"
    key_type, key_b64 = (tree / "etc/ssh/ssh_host_ed25519_key.pub").read_text().split()[:2]
    kh.write_text(f"{net['address']} {key_type} {key_b64}\n")
    info = {
        "address": net["address"], "port": 22, "user": "root",
        "identity_file": str(tree_key_path(tree)), "known_hosts_file": str(kh), "sudo": False,
        "service_manager": "systemd", "models_root": "/var/lib/vllm-orch/models",
        "units_dir": "/etc/systemd/system", "state_dir": "/var/lib/vllm-orch/state",
        "vllm": "/opt/vllm/bin/vllm", "python": "/opt/vllm/bin/python",
        "nvidia_smi": "/usr/local/bin/nvidia-smi",
        "env": {"PYTHONPATH": f"{SIM_MOUNT}/site-packages", "HF_HUB_DISABLE_TELEMETRY": "1"},
        "_name": name, "_pid": proc.pid, "_netns": net["netns"], "_veth": net["veth"],
        "_gateway": net["gateway"], "_cgroups": [str(c) for c in cgroups],
        "_console_log": str(console), "_timings": timings, "_index": index, "_host_dir": str(host_dir),
        "_tree": str(tree), "_root": str(root) if root else None, "_binds_ro": list(binds_ro),
    }
    port = hub_port or _hub_port(host_dir)
    if port:
        info["env"]["HF_ENDPOINT"] = f"http://{net['gateway']}:{port}"
        info["_hub_port"] = port
    try:
        _wait_port(net["address"], 22, proc, console, time.monotonic() + timeout)
        timings["launch->sshd listening"] = time.monotonic() - t
        t = time.monotonic()
        with SshHost(name, net["address"], user="root", identity_file=info["identity_file"],
                     known_hosts_file=str(kh), connect_timeout=10, ssh_config=None) as host:
            first = host.run(["true"], timeout=10)
            timings["first ssh command (connect included)"] = time.monotonic() - t
            t = time.monotonic()
            state = host.run(["systemctl", "is-system-running", "--wait"], timeout=timeout)
            timings["systemd up"] = time.monotonic() - t
            if first.exit_code != 0 or state.stdout.strip() not in ("running", "degraded"):
                raise RuntimeError(f"{name}: systemd is {state.stdout.strip() or state.stderr}")
            if state.stdout.strip() == "degraded":
                failed = host.run(["systemctl", "--failed", "--no-legend", "--plain"])
                info["_degraded"] = failed.stdout.split("\n")
    except BaseException:
        shutdown(info)
        raise
    timings["total"] = time.monotonic() - t0
    return info


def boot_many(specs: list[tuple[str, int, Path]], tree: Path, **kw) -> list[dict]:
    """Boot several containers at once (each boot mostly waits); all or none."""
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def one(i: int, spec: tuple[str, int, Path]) -> None:
        try:
            name, index, host_dir = spec
            results[i] = boot(name, index, host_dir, tree, **kw)
        except BaseException as exc:  # noqa: BLE001 - re-raised below after cleanup
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i, s)) for i, s in enumerate(specs)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        for info in results.values():
            shutdown(info)
        raise errors[0]
    return [results[i] for i in range(len(specs))]


def reboot(info: dict, timeout: float = 60.0) -> dict:
    """`systemctl reboot` inside the container, as an operator would run it: systemd stops every
    unit and exits, systemd-nspawn with it (code 133); then the same container boots again on the
    same network (a hub mirror bound to its gateway keeps working). Only a container booted with
    `persistent=True` still has what was installed on it. Returns the new inventory entry."""
    from orchestrator.errors import ConnectError
    from orchestrator.host.ssh import SshHost

    with SshHost(info["_name"], info["address"], user="root", identity_file=info["identity_file"],
                 known_hosts_file=info["known_hosts_file"], connect_timeout=10, ssh_config=None) as host:
        try:
            host.run(["systemctl", "reboot"], timeout=10)
        except ConnectError:
            pass                                    # the connection may drop before the answer
    pid = info["_pid"]
    if not _wait_exit(pid, timeout):
        raise RuntimeError(f"{info['_name']}: still running {timeout:g} s after `systemctl reboot`")
    _release(info, keep_network=True)
    return boot(info["_name"], info["_index"], Path(info["_host_dir"]), Path(info["_tree"]),
                hub_port=info.get("_hub_port"), binds_ro=info.get("_binds_ro", []), timeout=timeout,
                persistent=bool(info.get("_root")))


def _release(info: dict, keep_network: bool = False) -> None:
    for cg in info.get("_cgroups", []):
        _rmdir_tree(Path(cg))
    if info.get("_root"):
        subprocess.run(["umount", info["_root"]], capture_output=True)
    if not keep_network:
        _cleanup_network(info.get("_netns", ""), info.get("_veth", ""))
        release_forwarding()


def shutdown(info: dict, timeout: float = 15.0) -> dict[str, float]:
    """Stop the container (SIGTERM = clean poweroff), then remove its namespace, veth, cgroups
    and nspawn's runtime leftovers. Safe to call twice, and on a half-booted container."""
    t = time.monotonic()
    pid = info.get("_pid")
    if pid and _is_our_nspawn(pid, info["_name"]):
        os.kill(pid, signal.SIGTERM)
        if not _wait_exit(pid, timeout):
            os.kill(pid, signal.SIGKILL)
            _wait_exit(pid, 5)
    stopped = time.monotonic() - t
    _release(info)
    for leftover in (NSPAWN_RUN / "propagate" / info["_name"],
                     NSPAWN_RUN / "unix-export" / info["_name"]):
        _rmdir_tree(leftover)
    for empty in (NSPAWN_RUN / "propagate", NSPAWN_RUN / "locks", NSPAWN_RUN):
        try:
            empty.rmdir()                   # only when no other container still uses it
        except OSError:
            pass
    return {"stop": stopped, "total": time.monotonic() - t}


def find_running(name: str) -> int | None:
    """PID of a live systemd-nspawn booted by us as machine `name`, if any."""
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and _is_our_nspawn(int(p.name), name):
            return int(p.name)
    return None


# -- helpers -----------------------------------------------------------------------------------------
def _hub_port(host_dir: Path) -> int | None:
    try:
        return json.loads((host_dir / "sim.json").read_text()).get("hub_port")
    except (OSError, ValueError):
        return None


def _is_our_nspawn(pid: int, name: str) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(argv) and argv[0].endswith(b"systemd-nspawn") and b"-M" in argv \
        and name.encode() in argv and b"--register=no" in argv


def _wait_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:           # not our child (e.g. `sim down` in a new process)
            if not Path(f"/proc/{pid}").exists():
                return True
        time.sleep(0.02)
    return False


def _wait_port(address: str, port: int, proc: subprocess.Popen, console: Path,
               deadline: float) -> None:
    while True:
        if proc.poll() is not None:
            tail = console.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"systemd-nspawn exited {proc.returncode}: " + " | ".join(tail))
        try:
            socket.create_connection((address, port), timeout=0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd at {address}:{port} did not answer in time") from None
            time.sleep(0.02)


def _cleanup_network(ns: str, veth: str) -> None:
    if ns and Path(f"/run/netns/{ns}").exists():
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    if veth and Path(f"/sys/class/net/{veth}").exists():
        subprocess.run(["ip", "link", "del", veth], capture_output=True)


def _rmdir_tree(path: Path) -> None:
    """Remove a cgroup (or runtime) folder, deepest first; kill what is still in a cgroup first
    (only processes inside our own cgroup, so never anything we did not start)."""
    if not path.exists():
        return
    for dirpath, _dirs, _files in sorted(os.walk(path), key=lambda w: -w[0].count("/")):
        procs = Path(dirpath) / "cgroup.procs"
        if procs.exists():
            for pid in procs.read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for attempt in range(50):
            try:
                os.rmdir(dirpath)
                break
            except FileNotFoundError:
                break
            except OSError:
                if not procs.exists():          # a plain folder (runtime leftovers): files inside
                    subprocess.run(["rm", "-rf", "--one-file-system", dirpath])
                    break
                time.sleep(0.02)


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
