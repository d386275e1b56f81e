"""Fixtures for remote test hosts: a real OpenSSH sshd on loopback, and real-systemd hosts booted
with systemd-nspawn. Both are session-scoped (started once) and stopped by PID at the end.

    sshd_local      -> orchestrator.sim.sshd.Sshd (address, port, user, identity_file,
                       known_hosts_file, host_key_pub, pid, folder)
    ssh_host        -> an SshHost connected to sshd_local (fresh per test, closed after)
    systemd_hosts   -> factory: systemd_hosts(n) -> list of inventory dicts (see sim/nspawn.boot),
                       booted once per session and shared by every test asking for <= n
    systemd_sim_host, systemd_sim_hosts(n) -> (HostEntry, inventory dict, host folder) of booted
                       systemd hosts made SIMULATED GPU hosts by hand (fleet tests ask for several)
    systemd_sim     -> (sim home, HostEntry): `vllm-orch sim up --systemd` (a SIMULATED GPU host in
                       a real-systemd container with a persistent root, its hub mirror), per module
    clean_systemd_sim -> the same, with no vllm unit running or enabled, no faults, no records
    routed_namespaces(n, tag) -> context manager: n routed network namespaces without containers
Skips say exactly what is missing; CI is root and installs everything these need.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from pathlib import Path

import pytest

from orchestrator.host.ssh import SshHost
from orchestrator.sim import sshd as sshd_mod

HOST_SECONDS: dict[str, float] = {}   # what the suite spent starting/stopping hosts, by fixture


def _timed(key: str, started: float) -> None:
    HOST_SECONDS[key] = HOST_SECONDS.get(key, 0.0) + time.monotonic() - started


@pytest.fixture(scope="session")
def sshd_local(tmp_path_factory):
    reason = sshd_mod.available()
    if reason:
        pytest.skip(f"real sshd: {reason}")
    started = time.monotonic()
    info = sshd_mod.start(tmp_path_factory.mktemp("sshd"))
    _timed("sshd start", started)
    yield info
    sshd_mod.stop(info)


@pytest.fixture
def ssh_host(sshd_local):
    host = SshHost("sshd-local", sshd_local.address, port=sshd_local.port, user=sshd_local.user,
                   identity_file=sshd_local.identity_file,
                   known_hosts_file=sshd_local.known_hosts_file, connect_timeout=5,
                   ssh_config=None)
    yield host
    host.close()


def systemd_skip_reason() -> str | None:
    """Why real-systemd hosts cannot run here, or None."""
    if os.geteuid() != 0:
        return "real-systemd hosts need root (systemd-nspawn, network namespaces)"
    for tool, pkg in (("systemd-nspawn", "systemd-container"), ("debootstrap", "debootstrap"),
                      ("ip", "iproute2")):
        if not shutil.which(tool):
            return f"{tool} not found (apt-get install {pkg})"
    return None


@pytest.fixture(scope="session")
def systemd_hosts(tmp_path_factory):
    """systemd_hosts(n): n booted containers (names sd1-<pid>...), shared across the session.
    The tree is cached in $VLLM_ORCH_NSPAWN_CACHE (default ~/.cache/vllm-orch/nspawn)."""
    reason = systemd_skip_reason()
    if reason:
        pytest.skip(reason)
    from orchestrator.sim import nspawn

    booted: list[dict] = []
    root = tmp_path_factory.mktemp("systemd-hosts")

    def factory(n: int = 1) -> list[dict]:
        started = time.monotonic()
        cache = Path(os.environ.get("VLLM_ORCH_NSPAWN_CACHE", nspawn.DEFAULT_CACHE_DIR))
        tree = nspawn.ensure_tree(cache)
        _timed("nspawn tree (cached after the first build)", started)
        started = time.monotonic()
        # Unique names and free addresses, allocated under a machine-wide lock, so two pytest
        # runs (or xdist workers) on one machine never collide.
        with open(cache / "hosts.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            specs = []
            for i in range(len(booted) + 1, n + 1):
                index = nspawn.free_index(150, 254) if not specs else \
                    nspawn.free_index(specs[-1][1] + 1, 254)
                name = f"sd{i}-{os.getpid()}"
                specs.append((name, index, _host_dir(root / name)))
            new = nspawn.boot_many(specs, tree)
        booted.extend(new)
        if new:
            _timed("nspawn boot", started)
        return booted[:n]

    yield factory
    started = time.monotonic()
    for info in booted:
        nspawn.shutdown(info)
    _timed("nspawn shutdown", started)


@pytest.fixture(scope="module")
def systemd_sim(tmp_path_factory):
    """A real-systemd SIMULATED host (`vllm-orch sim up --systemd`), shared by a test module."""
    reason = systemd_skip_reason()
    if reason:
        pytest.skip(reason)
    import yaml

    from orchestrator.config.inventory import HostEntry
    from orchestrator.sim import manager

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path_factory.mktemp("sim-systemd")))
    home = manager.sim_home()
    started = time.monotonic()
    try:
        manager.up(1, speed=2000, systemd=True, home=home)
        _timed("sim up --systemd", started)
        entry = yaml.safe_load(manager.inventory_file(home).read_text())["hosts"]["sim"]
        yield home, HostEntry.model_validate({**entry, "name": "sim"})
    finally:
        manager.down(home)
        mp.undo()


@pytest.fixture
def clean_systemd_sim(systemd_sim):
    """The module's systemd_sim with every vllm unit stopped and disabled, no pending fault and no
    active / swap / health records: each test starts from a host that serves nothing."""
    from orchestrator.sim import manager

    home, e = systemd_sim
    manager.clear_faults("sim", home=home)
    serve_nothing(e)
    return home, e


def serve_nothing(e) -> None:
    """Every vllm unit of the systemd host `e` stopped and disabled, and no service / legacy active /
    swap / health record left: a shared host handed back serving nothing (the next test's placement
    would otherwise be refused over a service recorded on the same GPUs)."""
    from orchestrator.host.connect import open_host

    with open_host(e) as host:
        host.run(["sh", "-c", "for u in $(systemctl list-units --all --plain --no-legend 'vllm-*' | "
                              "awk '{print $1}'); do systemctl stop $u; systemctl disable $u; done; "
                              "systemctl reset-failed 'vllm-*' 2>/dev/null; "
                              f"rm -rf {e.state_dir}/active.json {e.state_dir}/services {e.state_dir}/swap.json "
                              f"{e.state_dir}/health; "
                              "true"], timeout=300).check(e.name)


@pytest.fixture(scope="session")
def systemd_sim_host(systemd_hosts, tmp_path_factory):
    """A booted systemd host turned into a SIMULATED GPU host by hand (no `sim up`), shared by the
    session: the sim programs in its host folder,
    a Hub mirror on the gateway address of its network namespace, and its inventory entry (what
    `vllm-orch sim up --systemd` would write). Yields (HostEntry, inventory dict, host folder)."""
    hub = _SimHubs()
    try:
        yield hub.prepare(systemd_hosts(1)[0])
    finally:
        hub.stop()


@pytest.fixture(scope="session")
def systemd_sim_hosts(systemd_hosts):
    """systemd_sim_hosts(n): the first n booted systemd hosts (systemd_hosts) each made a SIMULATED
    GPU host like systemd_sim_host (the first is the same host), for fleet tests. Returns a list of
    (HostEntry, inventory dict, host folder)."""
    hubs = _SimHubs()
    prepared: dict[str, tuple] = {}

    def factory(n: int) -> list[tuple]:
        infos = systemd_hosts(n)
        for info in infos:
            if info["_name"] not in prepared:
                prepared[info["_name"]] = hubs.prepare(info)
        return [prepared[info["_name"]] for info in infos]

    yield factory
    hubs.stop()


class _SimHubs:
    """Makes booted systemd hosts SIMULATED GPU hosts, each with its Hub mirror; stops the mirrors."""

    def __init__(self) -> None:
        self.procs: list = []

    def prepare(self, info: dict) -> tuple:
        import subprocess
        import sys

        from orchestrator.config.inventory import HostEntry
        from orchestrator.sim import manager, nspawn
        from orchestrator.sim.inventory import SimHost
        from tests.plugins.sim_hosts import TEST_SPEED

        hdir = Path(info["_console_log"]).parent.parent
        manager.prepare_host(info["_name"], hdir, speed=TEST_SPEED, scale=10000, flavour="systemd",
                             python="/usr/bin/env python3")
        port_file = hdir / "hub.port"
        port_file.unlink(missing_ok=True)
        repo = Path(__file__).resolve().parents[2]
        hub = subprocess.Popen([sys.executable, "-m", "orchestrator.sim.hub", "--host-dir", str(hdir), "--port", "0",
                                "--bind", info["_gateway"]], cwd=str(repo), stdout=subprocess.DEVNULL,
                               stderr=open(hdir / "hub.stderr", "wb"))
        self.procs.append(hub)
        deadline = time.monotonic() + 15
        while not port_file.exists() or not port_file.read_text().strip():
            assert hub.poll() is None and time.monotonic() < deadline, (hdir / "hub.stderr").read_text()
            time.sleep(0.05)
        data = SimHost(info["_name"], hdir, "systemd", TEST_SPEED, 10000, python="", container=info).host_entry()
        data["models_root"] = f"{nspawn.SIM_MOUNT}/models"     # the bound host folder, not the overlay tmpfs
        data["env"] = {**data["env"], "HF_ENDPOINT": f"http://{info['_gateway']}:{port_file.read_text().strip()}"}
        return HostEntry(name=info["_name"], **data), data, hdir

    def stop(self) -> None:
        for hub in self.procs:
            hub.terminate()
            hub.wait(10)


@contextlib.contextmanager
def routed_namespaces(n: int, tag: str):
    """n network namespaces made like the systemd hosts' (orchestrator/sim/nspawn.prepare_network:
    a veth, 10.200.N.2 inside, routed to the other test hosts) but with no container: for running a
    program of this machine (a real vLLM, a real Ray) "on another host" with `ip netns exec`.
    Yields [(netns name, address)]; removes them after. Skips when real-systemd hosts cannot run."""
    reason = systemd_skip_reason()
    if reason:
        pytest.skip(reason)
    from orchestrator.sim import nspawn

    cache = Path(os.environ.get("VLLM_ORCH_NSPAWN_CACHE", nspawn.DEFAULT_CACHE_DIR))
    cache.mkdir(parents=True, exist_ok=True)
    made: list[tuple[str, int]] = []
    try:
        with open(cache / "hosts.lock", "w") as lock:       # where the host fixtures allocate addresses
            fcntl.flock(lock, fcntl.LOCK_EX)
            for i in range(1, n + 1):
                index = nspawn.free_index(150, 254)
                name = f"{tag}{i}-{os.getpid()}"
                net = nspawn.prepare_network(name, index)
                nspawn.register(name, {"_netns": net["netns"], "_veth": net["veth"]})
                made.append((name, index))
        yield [(nspawn.netns_name(name), nspawn.addresses(index)[1]) for name, index in made]
    finally:
        for name, index in made:
            nspawn.release_network(name, index)
            nspawn.unregister(name)


def _host_dir(path: Path) -> Path:
    """A minimal host folder (the sim's layout) when the sim programs are not needed."""
    for sub in ("bin", "site-packages", "models", "state", "logs", "gpu-procs"):
        (path / sub).mkdir(parents=True, exist_ok=True)
    return path


def pytest_configure(config):
    """Before anything is made: the run (or the parallel run's controller, before its workers start)
    reaps what a killed earlier run left (orchestrator/sim/nspawn.py reap_stale); every process
    that makes test hosts names itself their owner, so the next run can tell they are left over."""
    if systemd_skip_reason():
        return
    from orchestrator.sim import nspawn
    from orchestrator.sim.nvidia_smi import proc_start_time

    if not hasattr(config, "workerinput"):
        for what in nspawn.reap_stale():
            print(f"reaped a stale test host: {what}")
    os.environ[nspawn.OWNER_ENV] = f"{os.getpid()}:{proc_start_time(os.getpid())}"


def pytest_sessionfinish(session):
    """A parallel worker hands its figures to the controller (pytest-xdist's workeroutput)."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["host_seconds"] = dict(HOST_SECONDS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller adds up every worker's time on test hosts."""
    for key, secs in (getattr(node, "workeroutput", None) or {}).get("host_seconds", {}).items():
        HOST_SECONDS[key] = HOST_SECONDS.get(key, 0.0) + secs


def pytest_terminal_summary(terminalreporter):
    if HOST_SECONDS:
        terminalreporter.write_sep("-", "time spent on test hosts")
        for key, secs in HOST_SECONDS.items():
            terminalreporter.write_line(f"{key}: {secs:.2f} s")
