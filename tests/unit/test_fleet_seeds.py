"""Download once per fleet's policy (ops/seed.py FleetSeeds), with hosts as threads and the holder's
server stood in (the real one: tests/integration/test_fleet_download.py): the first host fetches
from the Hub, the others wait for it and copy from it; a host that holds the checkpoint already is
copied from and nobody fetches; a failed fetch passes the Hub to the next host; a host the others
cannot reach fetches for itself."""

from __future__ import annotations

import threading
import time

from orchestrator.config.inventory import HostEntry
from orchestrator.host.download import Peer
from orchestrator.ops import seed
from orchestrator.secret import Secret

KEY = ("MiniMaxAI/MiniMax-M2.5", "a" * 40)


def entries(*names: str, address: str = "10.0.0.{}") -> list[HostEntry]:
    return [HostEntry(name=n, address=address.format(i + 1)) for i, n in enumerate(names)]


def seeds_of(es: list[HostEntry], served: list) -> seed.FleetSeeds:
    s = seed.FleetSeeds(es, connect=lambda e: None)

    def serve(holder: str, folder: str) -> Peer:
        served.append((holder, folder))
        return Peer(holder, f"http://{holder}:1", Secret("t" * 43))

    s._serve = serve            # the holder's server: serve_weights.py, tested for real elsewhere
    return s


def test_the_first_host_fetches_and_the_others_wait_for_it_then_copy_from_it():
    served: list = []
    s = seeds_of(entries("a", "b", "c"), served)
    got: dict = {}
    assert s.claim("a", KEY) is None                             # a fetches from the Hub

    def copier(name: str) -> None:
        got[name] = s.claim(name, KEY)

    threads = [threading.Thread(target=copier, args=(n,)) for n in ("b", "c")]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert not got and s.source("b", KEY) == "a"                  # they wait while a fetches
    s.hold("a", KEY, "/models/m")
    for t in threads:
        t.join(5)
    assert {n: p.host for n, p in got.items()} == {"b": "a", "c": "a"}
    assert served == [("a", "/models/m"), ("a", "/models/m")]


def test_a_host_holding_it_is_copied_from_and_a_running_host_that_has_not_planned_is_waited_for():
    s = seeds_of(entries("a", "b"), [])
    got: dict = {}
    with s.run("a"), s.run("b"):
        t = threading.Thread(target=lambda: got.setdefault("b", s.claim("b", KEY)))
        t.start()
        time.sleep(0.3)
        assert not got                                            # a runs and has not planned: b waits
        s.hold("a", KEY, "/models/m")                             # a's plan: it holds it
        t.join(5)
    assert got["b"].host == "a"


def test_a_failed_fetch_passes_the_hub_to_the_next_host_and_an_unreachable_host_fetches_for_itself():
    s = seeds_of(entries("a", "b"), [])
    got: dict = {}
    assert s.claim("a", KEY) is None
    t = threading.Thread(target=lambda: got.setdefault("b", s.claim("b", KEY)))
    t.start()
    time.sleep(0.3)
    s.failed("a", KEY)
    t.join(5)
    assert got == {"b": None}                                     # b fetches from the Hub now
    lonely = seeds_of(entries("x", "y", address="gpu{}.example"), [])   # DNS names: no LAN address
    assert lonely.claim("x", KEY) is None and lonely.claim("y", KEY) is None
    assert seed.lan_address(HostEntry(name="l", address="local"), local_fleet=True) == "127.0.0.1"
    assert seed.lan_address(HostEntry(name="l", address="local"), local_fleet=False) is None


def test_a_holder_that_cannot_be_reached_to_serve_sends_the_copier_to_the_hub():
    s = seed.FleetSeeds(entries("a", "b"), connect=lambda e: (_ for _ in ()).throw(OSError("no route")))
    s.hold("a", KEY, "/models/m")
    assert s.claim("b", KEY) is None                             # not an error: b fetches from the Hub
