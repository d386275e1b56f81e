"""Which tier each test belongs to, and how the tests are grouped for parallel workers.

Tiers (a marker each, set here from the fixtures a test uses, so a new test lands in the right tier
without anyone remembering to mark it):

    unit         tests/unit: pure functions, golden files, fake facts
    sim          tests/integration on SIMULATED process hosts (this machine's processes)
    ssh          a real sshd on loopback (sshd_local, ssh_host)
    vllm_parser  vLLM's real argument parser (the cached parser venv)
    systemd      real-systemd test hosts (systemd-nspawn containers; root)
    real_vllm    vLLM's CPU build serving a tiny model
    ray          a real Ray cluster

`./dev test --quick` runs unit, sim and ssh (no container, no real vLLM, its parser or Ray);
`./dev test` runs everything.

Parallel runs (pytest-xdist, `--dist loadgroup`): the tests of a file that uses a module-scoped
fixture (a module's real vLLM server, its booted `sim up --systemd` host, a shared simulated host)
are put in the group of their FILE, so they run on one worker, in order, and the fixture is made
once. Every other test is its own unit of work and may run on any worker (a function-scoped
simulated host is private to its test). Session-scoped fixtures (booted systemd hosts, the sshd)
are made once per worker that needs them. Workers never share a port: each runs in a network
namespace of its own (tests/plugins/netns-python). The real_vllm tier is one group: one real vLLM
server at a time (each start is CPU-bound; two at once on two cores starve each other and the rest).
Files are handed out heaviest tier first (a real vLLM, then containers, ...), and within a tier the
files with a test marked `long` (half a minute or more of wall time on 2 cores) first, so the long ones
do not start last and keep one worker busy after the others are done. A test that must share a
worker with tests of another file names a group itself: `@pytest.mark.xdist_group("NAME")`.
"""

from __future__ import annotations

import pytest

TIER_FIXTURES = {
    "systemd": {"systemd_hosts", "systemd_sim", "clean_systemd_sim", "systemd_sim_host", "systemd_sim_hosts"},
    "real_vllm": {"real_vllm", "real_vllm_host"},
    "vllm_parser": {"vllm_parser_python"},
    "ssh": {"sshd_local", "ssh_host"},
}
# The most demanding tier wins when a test uses several (a real vLLM in a systemd container is both).
ORDER = ("ray", "real_vllm", "systemd", "vllm_parser", "ssh")
TIERS = ("unit", "sim", *ORDER)


def pytest_configure(config):
    """Refuse a parallel run whose groups would not take: with pytest 9.2, pytest-xdist 3.8's
    --dist loadgroup hands every test out on its own, whatever its group (pytest-dev/pytest-xdist
    #1386), and the suite's grouping rules above would silently not hold."""
    if config.getoption("dist", "no") != "loadgroup" or hasattr(config, "workerinput"):
        return
    import xdist

    if pytest.version_tuple[:2] >= (9, 2) and tuple(int(p) for p in xdist.__version__.split(".")[:2]) <= (3, 8):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__} ignores xdist groups "
            "(pytest-dev/pytest-xdist#1386): install pyproject's dev extra (pytest<9.2), or run serially (-p no:xdist)")


def tier_of(item: pytest.Item) -> str:
    marked = {m.name for m in item.iter_markers()}
    used = set(getattr(item, "fixturenames", ()))
    for tier in ORDER:
        if tier in marked or used & TIER_FIXTURES.get(tier, set()):
            return tier
    return "unit" if "/tests/unit/" in f"/{item.nodeid}" else "sim"


def shares_module_state(item: pytest.Item) -> bool:
    """Whether the test uses a fixture made once per module (or class): its file stays together."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d and d[-1].scope in ("module", "class", "package") for d in defs)


@pytest.hookimpl(tryfirst=True)     # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    by_file: dict[str, int] = {}
    grouped: set[str] = set()
    for item in items:
        tier = tier_of(item)
        if tier not in {m.name for m in item.iter_markers()}:
            item.add_marker(getattr(pytest.mark, tier))
        path = item.nodeid.split("::", 1)[0]
        rank = (HEAVIEST_FIRST.index(tier), item.get_closest_marker("long") is None)
        by_file[path] = min(by_file.get(path, (len(HEAVIEST_FIRST), True)), rank)
        if shares_module_state(item):
            grouped.add(path)
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if item.get_closest_marker("xdist_group") is not None:
            continue
        if item.get_closest_marker("real_vllm") is not None:
            item.add_marker(pytest.mark.xdist_group("real_vllm"))     # one real vLLM at a time
            item.add_marker(pytest.mark.timeout(REAL_VLLM_TIMEOUT_S))
        elif path in grouped:
            item.add_marker(pytest.mark.xdist_group(path))
    # the heaviest files first (a stable sort: a file's tests stay together and in their order)
    items.sort(key=lambda it: by_file[it.nodeid.split("::", 1)[0]])


# A real vLLM's start is ~30 s of CPU-bound imports in three processes on an idle 2-core machine;
# beside the other workers it takes several times that. The test timeout guards against a hang,
# not a figure: the real tier's tests get more room than pyproject's 300 s.
REAL_VLLM_TIMEOUT_S = 900
HEAVIEST_FIRST = ("real_vllm", "ray", "systemd", "vllm_parser", "sim", "ssh", "unit")
