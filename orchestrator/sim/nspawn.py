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
10.200.0.0/16 through its gateway, and this side forwards what arrives on a test host's veth and
nothing else: net.ipv4.conf.<veth>.forwarding=1 on that veth alone (IPv4 forwarding is decided by
the interface a packet comes in on), never the machine-wide net.ipv4.ip_forward, plus, when iptables
is installed, an ACCEPT rule at the top of the FORWARD chain for packets from that veth to another
test host's veth (Docker sets that chain's policy to DROP). Both go with the veth. Everything here
acts in the caller's network namespace (interfaces are looked up with `ip`, not /sys/class/net,
which shows the namespace that mounted /sys): `./dev test` runs each pytest worker in a namespace of
its own, so its test hosts, routes and forwarding live and die with it.
Reverse-path filtering (rp_filter) passes: each host's /24 is reached through its own veth.

Nothing outlives its owner for long: a test run names itself in $VLLM_ORCH_TEST_OWNER (pid:start
time, tests/plugins/remote_hosts.py) and every container or namespace it makes is registered in
/run/vllm-orch-test-hosts/ under that owner. A pytest killed with SIGKILL leaves them (a container
with a root sshd, a named namespace, cgroups); the next test run, and `vllm-orch sim down`, reap
what a dead owner left (reap_stale). Hosts made without an owner (`vllm-orch sim up --systemd`)
are never reaped: `sim down` stops them.
"""

from __future__ import annotations

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
REGISTRY = Path("/run/vllm-orch-test-hosts")         # one record per container/namespace of a test run
OWNER_ENV = "VLLM_ORCH_TEST_OWNER"
NSPAWN_RUN = Path("/run/systemd/nspawn")
HOSTS_NET = "10.200.0.0/16"                         # every test host's address is in it
# What runs before per-veth forwarding recorded (and a later run undoes: reap_stale).
LEGACY_FORWARDING_STATE = Path("/run/vllm-orch-forwarding.json")
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
_LEGACY_FORWARD_RULE = ["FORWARD", "-s", HOSTS_NET, "-d", HOSTS_NET, "-j", "ACCEPT"]


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


def link_exists(dev: str) -> bool:
    """Whether this network namespace has the interface (asked with `ip`: /sys/class/net shows the
    namespace that mounted /sys, not the caller's)."""
    return subprocess.run(["ip", "link", "show", "dev", dev], capture_output=True).returncode == 0


def index_in_use(index: int) -> bool:
    """Whether host number `index` already has its veth (a live or stale container)."""
    return link_exists(_veth(index))


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
        enable_forwarding(veth)
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
    enable_forwarding(veth)
    return result


def release_network(name: str, index: int) -> None:
    """Remove what prepare_network made (for a namespace used without a container); its
    forwarding goes with its veth."""
    _cleanup_network(netns_name(name), _veth(index))


def _route_hosts(ns: str, gateway: str) -> None:
    """The other test hosts are reached through this machine (idempotent)."""
    _ip("-n", ns, "route", "replace", HOSTS_NET, "via", gateway, "dev", "eth0")


def _forward_rule(veth: str) -> list[str]:
    return ["FORWARD", "-i", veth, "-o", f"{VETH_PREFIX}+", "-j", "ACCEPT"]


def enable_forwarding(veth: str) -> None:
    """Forward what arrives on this test host's veth (to the other test hosts), and nothing else:
    the veth's own forwarding switch, and an iptables ACCEPT from it to the other test hosts' veths
    when iptables is installed. Idempotent; both go away with the veth (_cleanup_network)."""
    Path(f"/proc/sys/net/ipv4/conf/{veth}/forwarding").write_text("1\n")
    iptables = shutil.which("iptables")
    if iptables and subprocess.run([iptables, "-w", "-C", *_forward_rule(veth)], capture_output=True).returncode:
        subprocess.run([iptables, "-w", "-I", "FORWARD", "1", *_forward_rule(veth)[1:]], capture_output=True)


def _drop_forward_rule(veth: str) -> None:
    iptables = shutil.which("iptables")
    if iptables:
        while subprocess.run([iptables, "-w", "-D", *_forward_rule(veth)], capture_output=True).returncode == 0:
            pass


def release_legacy_forwarding() -> bool:
    """Undo what an older vllm-orch test run did machine-wide (net.ipv4.ip_forward=1 and a FORWARD
    rule for all of 10.200.0.0/16, recorded in /run/vllm-orch-forwarding.json) once none of its
    test hosts is left; True when it did."""
    state = _read_json(LEGACY_FORWARDING_STATE)
    if not state or any(Path("/sys/class/net").glob(f"{VETH_PREFIX}*")):
        return False
    if state.get("iptables"):
        subprocess.run([state["iptables"], "-w", "-D", *_LEGACY_FORWARD_RULE], capture_output=True)
    if state.get("ip_forward") == "0":
        IP_FORWARD.write_text("0\n")
    LEGACY_FORWARDING_STATE.unlink(missing_ok=True)
    return True


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


def owner_of_this_run() -> str | None:
    """`pid:start time` of the test run that owns what is made now ($VLLM_ORCH_TEST_OWNER), or None."""
    return os.environ.get(OWNER_ENV) or None


def register(name: str, record: dict) -> None:
    """Remember what a test run made (when one owns it), so reap_stale can remove it after the run
    was killed. The folder is root's and private; records are written whole (rename)."""
    owner = owner_of_this_run()
    if not owner:
        return
    REGISTRY.mkdir(mode=0o700, exist_ok=True)
    tmp = REGISTRY / f".{name}.{os.getpid()}"
    tmp.write_text(json.dumps({**record, "_name": name, "_owner": owner, "_veth_netns": _netns_id()}))
    os.replace(tmp, REGISTRY / f"{name}.json")


def unregister(name: str) -> None:
    (REGISTRY / f"{name}.json").unlink(missing_ok=True)


def _netns_id() -> int:
    """The caller's network namespace (a veth lives and dies with the namespace it was made in)."""
    return os.stat("/proc/self/ns/net").st_ino


def _owner_alive(owner: str) -> bool:
    from orchestrator.sim.nvidia_smi import proc_alive
    pid, _, start = owner.partition(":")
    try:
        return proc_alive(int(pid), float(start) if start else None)
    except ValueError:
        return False


def reap_stale() -> list[str]:
    """Remove every registered container or namespace whose owning test run is gone (killed before
    its teardown): stop the container (its cgroups, so every process in it), unmount its root, delete
    its namespace and veth. Also undoes an older run's machine-wide forwarding. Root only; says what
    it removed."""
    if os.geteuid() != 0:
        return []
    removed = []
    for path in sorted(REGISTRY.glob("*.json")) if REGISTRY.is_dir() else []:
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        if _owner_alive(str(rec.get("_owner", ""))):
            continue
        if rec.get("_veth_netns") != _netns_id():
            rec["_veth"] = ""            # made in another namespace (a worker's): it went with it
        shutdown(rec, timeout=5) if rec.get("_pid") else release_network_record(rec)
        path.unlink(missing_ok=True)
        removed.append(f"{rec.get('_name')} (left by test run {rec.get('_owner')})")
    if release_legacy_forwarding():
        removed.append("net.ipv4.ip_forward and the FORWARD rule an older test run set")
    return removed


def release_network_record(rec: dict) -> None:
    _cleanup_network(rec.get("_netns", ""), rec.get("_veth", ""))


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
    register(name, info)
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
        unregister(info.get("_name", ""))


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
    # nspawn's own runtime folders of this container (it cannot remove them itself where /run is not
    # a tmpfs: "Attempted to remove disk file system"). The shared parents stay: removing one while
    # it is empty races with another container's start, which then fails creating its own in it.
    for leftover in (NSPAWN_RUN / "propagate" / info["_name"],
                     NSPAWN_RUN / "unix-export" / info["_name"]):
        _rmdir_tree(leftover)
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
    if veth:
        _drop_forward_rule(veth)
        if link_exists(veth):
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
