"""How long `vllm-orch status` takes for 1 and for 8 SIMULATED hosts, where the time goes, and what
it costs in CPU: the controller's own, and the hosts' (their commands and their vLLM servers).

Not a test: prints figures. Starts its own sim home in a tmp folder (8 process hosts, speed 2000),
deploys kimi-k25-int4 on the first host with a free port (so /health, /v1/models and /metrics are
probed there too), then times gather_status() -- the code path of the command -- several times.

    .venv/bin/python benchmarks/bench_status.py [--repeat 5] [--profile]

Per run it reports wall time, the controller's CPU (time.process_time: every thread of this
process), the hosts' CPU (getrusage(RUSAGE_CHILDREN): the simulated hosts are LocalHosts, so their
commands -- the facts script, nvidia-smi, sh -- are this process's children) and the simulated vLLM
servers' CPU (psutil, they are not our children), and a breakdown of one host's wall time by phase
(connection, host script round trips, parsing, each HTTP probe) from wrappers put around those calls.
On this 2-core machine the hosts' commands share the controller's cores, so 8 hosts cost about 8
times the hosts' CPU divided by 2 cores; the last line estimates the ratio where each host works on
its own cores (the slowest host's wall time plus the controller's extra CPU for the other 7).
--profile: cProfile of one host's status on the serving host, in this thread (top functions).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Phases:
    """Wall time per phase and per host thread, from wrappers around the calls status makes."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.lock = threading.Lock()
        self.runs: list[dict[str, float]] = []
        self.latest: dict[str, float] | None = None

    def wrap(self, module, attr: str, phase: str) -> None:
        if not hasattr(module, attr):
            return
        inner = getattr(module, attr)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                spent = time.perf_counter() - t0
                # a probe run in a helper thread counts for the host that started last (exact
                # in the one-host breakdown, which is what reads the books)
                book = getattr(self.local, "book", None) or self.latest
                if book is not None:
                    with self.lock:
                        book[phase] += spent
        setattr(module, attr, timed)

    def host(self, fn):
        """Wrap the per-host function: a fresh book per call, its total as `total`."""
        def timed(*a, **kw):
            self.local.book = self.latest = defaultdict(float)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.local.book["total"] = time.perf_counter() - t0
                with self.lock:
                    self.runs.append(dict(self.local.book))
                self.local.book = None
        return timed


def install_phases() -> Phases:
    from orchestrator.host import facts, scripts
    from orchestrator.host.local import LocalHost
    from orchestrator.host.ssh import SshHost
    from orchestrator.ops import status
    from orchestrator.probe import api

    ph = Phases()
    ph.wrap(SshHost, "transport", "~ of which SSH connection")     # made on first use, inside a round trip
    ph.wrap(status, "read_extras", "read_extras (was an sh round trip)")
    ph.wrap(scripts, "run", "facts script round trip")
    ph.wrap(facts, "parse", "facts parsing")
    ph.wrap(api, "health", "GET /health")
    ph.wrap(api, "served_models", "GET /v1/models")
    ph.wrap(api, "fetch_metrics", "GET /metrics + parsing")
    ph.wrap(LocalHost, "close", "close")
    ph.wrap(SshHost, "close", "close")
    status.host_status = ph.host(status.host_status)
    return ph


def print_phases(ph: Phases, title: str) -> None:
    """Median wall time per phase over the one-host runs in ph.runs."""
    phases = sorted({k for r in ph.runs for k in r} - {"total"})
    total = statistics.median(r["total"] for r in ph.runs)
    print(f"  {title}: {total * 1000:.0f} ms (median per phase, wall):")
    accounted = 0.0
    for k in phases:
        v = statistics.median(r.get(k, 0.0) for r in ph.runs)
        accounted += 0.0 if k.startswith("~") else v         # "~": a part of another phase
        print(f"    {k:36s} {v * 1000:6.1f} ms")
    print(f"    {'other (controller code)':36s} {max(0.0, total - accounted) * 1000:6.1f} ms")


def sim_server_pids(entries) -> list[int]:
    """The serving hosts' vLLM processes: the group leader each process service's record names
    (state_dir/run/vllm-MODEL.pid: `PGID BOOT_ID START_TIME`), and its descendants."""
    import psutil
    pids = []
    for entry in entries:
        for record in Path(entry.state_dir, "run").glob("vllm-*.pid"):
            try:
                leader = psutil.Process(int(record.read_text().split()[0]))
                pids += [leader.pid, *(c.pid for c in leader.children(recursive=True))]
            except (OSError, ValueError, IndexError, psutil.Error):
                pass
    return pids


def servers_cpu(pids: list[int]) -> float:
    import psutil
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def host_side(entry) -> None:
    """The pieces of the facts round trip, each run alone on an idle host: CPU (median of 5)."""
    import subprocess

    from orchestrator.host import nvidia_smi as gpu
    env = {**os.environ, **entry.env}
    pieces = [("the host's Python starting", [entry.python, "-c", "pass"]),
              ("+ import psutil", [entry.python, "-c", "import psutil"]),
              ("+ importlib.metadata.version('vllm')",
               [entry.python, "-c", "import importlib.metadata as m; m.version('vllm')"]),
              ("nvidia-smi --query-gpu", gpu.query_gpus_argv(entry.nvidia_smi)),
              ("nvidia-smi --query-compute-apps", gpu.query_compute_apps_argv(entry.nvidia_smi)),
              ("nvidia-smi (banner)", [entry.nvidia_smi]),
              ("sh -c (one command)", ["sh", "-c", "cut -d' ' -f1 /proc/uptime"])]
    print("  the host's side, piece by piece (CPU, median of 5, an idle host):")
    for what, argv in pieces:
        spent = []
        for _ in range(5):
            k0 = children_cpu()
            subprocess.run(argv, capture_output=True, env=env, check=False)
            spent.append(children_cpu() - k0)
        print(f"    {what:40s} {statistics.median(spent) * 1000:6.1f} ms")
    try:
        from orchestrator.host.facts import gather_for_status
    except ImportError:             # before the status subset existed
        return
    from orchestrator.host.local import LocalHost
    no_smi = entry.model_copy(update={"nvidia_smi": "true"})
    for what, e in (("status's facts round trip (all of it)", entry),
                    ("  the same, nvidia-smi replaced by true", no_smi)):
        spent = []
        for _ in range(5):
            k0 = children_cpu()
            gather_for_status(LocalHost(e.name, env=e.env), e, 500)
            spent.append(children_cpu() - k0)
        print(f"    {what:40s} {statistics.median(spent) * 1000:6.1f} ms")


def over_ssh(hosts, port_of, ph: Phases, repeat: int, home: Path) -> None:
    """The same hosts reached through a real sshd on loopback (one paramiko connection per host):
    what connection setup and SSH channels cost the controller."""
    from orchestrator.config.inventory import HostEntry
    from orchestrator.ops import status
    from orchestrator.sim import sshd as sshd_mod

    why = sshd_mod.available()
    if why is not None:
        print(f"  over SSH: not measured ({why})")
        return
    info = sshd_mod.start(home / "sshd")
    try:
        entries = [HostEntry.model_validate({**e.model_dump(), **info.inventory()}) for e in hosts]
        for n in (1, 8):
            status.gather_status(entries[:n], port_of)
            walls, ctl = [], []
            ph.runs.clear()
            for _ in range(repeat):
                c0, t0 = time.process_time(), time.perf_counter()
                results = status.gather_status(entries[:n], port_of)
                walls.append(time.perf_counter() - t0)
                ctl.append(time.process_time() - c0)
                assert all(r.reachable for r in results), [r.error for r in results]
            print(f"  over SSH, {n} host{'s' if n > 1 else ' '}: {statistics.median(walls) * 1000:6.0f} ms wall, "
                  f"controller CPU {statistics.median(ctl) / n * 1000:.0f} ms per host")
            if n == 1:
                print_phases(ph, "over SSH, where the serving host's time goes")
    finally:
        sshd_mod.stop(info)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="cProfile one host's status (the serving host)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-status-"))
    os.environ["VLLM_ORCH_STATE_HOME"] = str(tmp)
    from orchestrator.config.inventory import load_inventory
    from orchestrator.config.manifest import get_manifest
    from orchestrator.host.connect import open_host
    from orchestrator.ops import status
    from orchestrator.ops.deploy import run_deploy
    from orchestrator.ops.execute import Reporter
    from orchestrator.ops.stop import stop_model
    from orchestrator.plan.run import Options
    from orchestrator.sim import manager
    from orchestrator.sim.sshd import free_port

    models = tmp / "models"
    models.mkdir()
    data = yaml.safe_load((REPO / "models" / "kimi-k25-int4.yaml").read_text())
    data["serving"]["port"] = free_port()
    (models / "kimi-k25-int4.yaml").write_text(yaml.safe_dump(data))
    manager.up(8, speed=2000, home=tmp / "sim")
    try:
        hosts = list(load_inventory().hosts.values())
        m = get_manifest("kimi-k25-int4", models)[0]
        res = run_deploy(hosts[0], m, Options(budget_s=60), Reporter(None, quiet=True), dry_run=False)
        assert res.ok, res.as_dict()
        port_of = lambda name: m.serving.port if name == m.name else None   # noqa: E731
        servers = sim_server_pids(hosts)
        ph = install_phases()
        print(f"status of SIMULATED hosts (LocalHost, process services, 1 serving); {args.repeat} runs each, "
              f"median; {os.cpu_count()} cores")
        figures = {}
        for n in (1, 8):
            status.gather_status(hosts[:n], port_of)          # warm-up (imports, page cache)
            walls, ctl, kids, srv, trips = [], [], [], [], []
            ph.runs.clear()
            for _ in range(args.repeat):
                c0, k0, s0, t0 = time.process_time(), children_cpu(), servers_cpu(servers), time.perf_counter()
                results = status.gather_status(hosts[:n], port_of)
                walls.append(time.perf_counter() - t0)
                ctl.append(time.process_time() - c0)
                kids.append(children_cpu() - k0)
                srv.append(servers_cpu(servers) - s0)
                trips.append([r.round_trips for r in results])
                assert all(r.reachable for r in results), [r.error for r in results]
            med = statistics.median
            figures[n] = {"wall": med(walls), "ctl": med(ctl), "kids": med(kids), "srv": med(srv),
                          "host_walls": sorted(r.get("total", 0.0) for r in ph.runs)}
            per_host = sorted({t for run in trips for t in run})
            states = ", ".join(f"{r.host}={r.state}" for r in results[:2])
            print(f"  {n} host{'s' if n > 1 else ' '}: {med(walls) * 1000:6.0f} ms wall "
                  f"(min {min(walls) * 1000:.0f}, max {max(walls) * 1000:.0f}); CPU per run: controller "
                  f"{med(ctl) * 1000:.0f} ms, hosts' commands {med(kids) * 1000:.0f} ms, vLLM servers "
                  f"{med(srv) * 1000:.0f} ms; round trips per host: {per_host} ({states}{', ...' if n > 2 else ''})")
        one, eight = figures[1], figures[8]
        print(f"  per host: controller CPU {eight['ctl'] / 8 * 1000:.1f} ms, hosts' CPU "
              f"{eight['kids'] / 8 * 1000:.0f} ms (+ {one['srv'] * 1000:.0f} ms in the serving host's vLLM server)")
        print(f"  8 hosts / 1 host: {eight['wall'] / one['wall']:.2f}x measured (the hosts' work shares these "
              f"{os.cpu_count()} cores)")
        own = (one["wall"] + max(0.0, eight["ctl"] - one["ctl"])) / one["wall"]
        print(f"  8 hosts / 1 host where each host works on its own cores (estimate: 1 host's wall + the "
              f"controller's extra CPU for 7 more hosts): {own:.2f}x")
        # One host's time by phase: the serving host alone (the 1-host runs), median per phase.
        ph.runs.clear()
        for _ in range(args.repeat):
            status.gather_status(hosts[:1], port_of)
        print_phases(ph, "where the serving host's time goes")
        host_side(hosts[1])
        over_ssh(hosts, port_of, ph, args.repeat, tmp)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.repeat):
                status.host_status(hosts[0], port_of)
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        entry = hosts[0]
        with open_host(entry) as host:
            stop_model(host, entry, m.name, release_timeout=10)
    finally:
        manager.down(tmp / "sim")


if __name__ == "__main__":
    main()
