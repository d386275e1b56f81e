"""Download once per fleet: when several hosts of one command (`deploy --group`, `swap --group`)
need the same checkpoint (repo@commit), the first host to reach its download step fetches it from
the Hub; each other one waits for that, then copies it from a host that holds it over the LAN
(host/download.py `Serving`: serve_weights.py on the holder, host/remote/download.py --peer on the
copier). The copier still asks the Hub for the listing of that commit and checks every file's
sha256 against it while it streams; a file the peer cannot give, or gives with other bytes, comes
from the Hub. So N hosts are ready in about one Hub download plus a LAN copy, and no host trusts
another's bytes.

A host that cannot be reached by the others (no IP address: `cluster.address`, or `address` being
one; a local host serves on 127.0.0.1 to other local ones) downloads from the Hub as before, and
the plan says why. The holder serves only while copies run: its server ends with the command.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TypeVar

from orchestrator.config.inventory import HostEntry
from orchestrator.host import cancel
from orchestrator.host.base import Host
from orchestrator.host.connect import open_host
from orchestrator.host.download import Peer, Serving
from orchestrator.plan.run import Options

Key = tuple[str, str]        # (repo, commit)
T = TypeVar("T")


def lan_address(entry: HostEntry, local_fleet: bool) -> str | None:
    """The address the fleet's other hosts reach this one at, for a copy: its cluster address (an IP:
    cluster.address, else `address` when that is one), 127.0.0.1 for a local host among local hosts;
    None: the others cannot reach it."""
    if entry.is_local:
        return "127.0.0.1" if local_fleet else None
    return entry.cluster_address


# How long a host that would fetch from the Hub waits for the fleet's other running hosts to make their
# plans (one of them may hold the checkpoint already): gathering a host's facts takes seconds.
PLAN_WAIT_S = 300.0


@dataclass
class _Checkpoint:
    fetching: str | None = None                          # the host fetching it from the Hub now
    holders: list[tuple[str, str]] = field(default_factory=list)   # (host, folder path) holding it, verified
    planned: set[str] = field(default_factory=set)       # the hosts whose plan has its download step


class FleetSeeds:
    """The fleet's checkpoints: who fetches each from the Hub, who holds it, and the servers started
    for copies (plan/run.py `Seeds`, which the download step uses). Thread-safe: every host's run
    is a thread of one fleet command."""

    def __init__(self, entries: Sequence[HostEntry], connect: Callable[[HostEntry], Host] = open_host,
                 rate_bps: int = 0):
        self.entries = {e.name: e for e in entries}
        self.local = all(e.is_local for e in entries)
        self.connect, self.rate_bps = connect, rate_bps
        self.cond = threading.Condition()
        self.points: dict[Key, _Checkpoint] = {}
        self.servers: dict[tuple[str, str], Serving] = {}
        self.running: set[str] = set()                  # the hosts whose run is under way (`run`)
        self.hosts: list[Host] = []
        self.serve_lock = threading.Lock()

    @contextmanager
    def run(self, host: str) -> Iterator[None]:
        """Around one host's run: while it runs, a host that would fetch from the Hub first waits for
        its plan (it may hold the checkpoint)."""
        with self.cond:
            self.running.add(host)
        try:
            yield
        finally:
            with self.cond:
                self.running.discard(host)
                self.cond.notify_all()

    def plan(self, host: str, key: Key) -> None:
        """HOST's plan has KEY's download step (held, or to fetch)."""
        with self.cond:
            self.points.setdefault(key, _Checkpoint()).planned.add(host)
            self.cond.notify_all()

    def reachable(self, name: str) -> bool:
        e = self.entries.get(name)
        return e is not None and lan_address(e, self.local) is not None

    def source(self, host: str, key: Key) -> str | None:
        """For a plan: the host this one would copy from (one holding it or fetching it now), None:
        the Hub."""
        with self.cond:
            point = self.points.get(key)
            if point is None or not self.reachable(host):
                return None
            holders = [h for h, _ in point.holders if h != host and self.reachable(h)]
            if holders:
                return holders[0]
            return point.fetching if point.fetching not in (None, host) and self.reachable(point.fetching) else None

    def hold(self, host: str, key: Key, folder: str) -> None:
        """HOST holds KEY verified in FOLDER (its download ended, or its plan found it complete)."""
        with self.cond:
            point = self.points.setdefault(key, _Checkpoint())
            point.planned.add(host)
            if (host, folder) not in point.holders:
                point.holders.append((host, folder))
            if point.fetching == host:
                point.fetching = None
            self.cond.notify_all()

    def claim(self, host: str, key: Key) -> Peer | None:
        """At the download step: a Peer to copy from (a holder, after waiting for the host fetching it
        from the Hub), or None: this host fetches from the Hub (the first, or no holder reachable, or
        the fetch failed). `failed` must follow a None when the fetch fails (others then go to the Hub)."""
        if not self.reachable(host):
            return None
        deadline = time.monotonic() + PLAN_WAIT_S
        with self.cond:
            point = self.points.setdefault(key, _Checkpoint())
            while True:
                holders = [(h, f) for h, f in point.holders if h != host and self.reachable(h)]
                if holders:
                    holder = holders[0]
                    break
                unplanned = self.running - point.planned - {host}
                if (point.fetching is None or point.fetching == host) and \
                        (not unplanned or time.monotonic() > deadline):
                    point.fetching = host
                    return None
                self.cond.wait(0.5)
                cancel.check()
        return self._serve(*holder)

    def failed(self, host: str, key: Key) -> None:
        """HOST's fetch of KEY from the Hub failed: the next waiting host fetches it."""
        with self.cond:
            point = self.points.get(key)
            if point is not None and point.fetching == host:
                point.fetching = None
            self.cond.notify_all()

    def _serve(self, holder: str, folder: str) -> Peer | None:
        with self.serve_lock:
            serving = self.servers.get((holder, folder))
            if serving is None:
                entry = self.entries[holder]
                address = lan_address(entry, self.local)
                assert address is not None
                try:
                    host = self.connect(entry)
                    self.hosts.append(host)
                    rate = self.rate_bps or int(entry.fleet_copy_mbps * 125_000)
                    serving = Serving(host, entry, folder, address, rate)
                except Exception:               # the holder cannot be reached or serve: the Hub, then
                    return None
                self.servers[(holder, folder)] = serving
            return serving.peer

    def close(self) -> None:
        for serving in self.servers.values():
            try:
                serving.close()
            except OSError:
                pass
        for host in self.hosts:
            host.close()
        self.servers.clear()
        self.hosts.clear()


@contextmanager
def seeded(opts: Options, entries: Sequence[HostEntry], accept_new_host_key: bool = False) -> Iterator[Options]:
    """The options of a fleet command with its FleetSeeds (none for one host); the servers it starts
    end with the block."""
    if len(entries) < 2:
        yield opts
        return
    seeds = FleetSeeds(entries, connect=lambda e: open_host(e, accept_new_host_key))
    try:
        yield replace(opts, seeds=seeds)
    finally:
        seeds.close()


def run_seeded(opts: Options, entry: HostEntry, run: Callable[[], T]) -> T:
    """One host's run of a fleet command, known to the fleet's FleetSeeds while it runs (`FleetSeeds.run`)."""
    if isinstance(opts.seeds, FleetSeeds):
        with opts.seeds.run(entry.name):
            return run()
    return run()
