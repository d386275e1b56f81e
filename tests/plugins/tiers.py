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

`./dev test --quick` runs the tests marked `quick` (below: the unit tier, the contract tests that need
no real vLLM server, and one simulated-host test per operation); `./dev test` runs everything.

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


# `./dev test --quick`, the inner loop (<= 5 min on 2 cores): the unit tier, these contract files (the
# simulator held to vLLM 0.33's source and its real parser; the contract tests that start vLLM's CPU
# build stay in the full run: one start is about a minute of CPU), and ONE simulated-host test per
# operation, each the one that walks the operation end to end. Everything else, the rest of the
# simulated tier included, runs in `./dev test`. tests/unit/test_quick_selection.py keeps every
# entry pointing at a test that exists.
QUICK_FILES = (
    "tests/integration/test_sleep_contract.py",
    "tests/integration/test_vllm_flags_contract.py",
)
QUICK_TESTS = {
    "deploy, then nothing to do": "tests/integration/test_deploy.py::test_deploy_each_shipped_model_then_nothing_to_do",
    "deploy over real SSH": "tests/integration/test_deploy_remote.py::test_deploy_over_real_ssh",
    "dry run": "tests/integration/test_dry_run.py::test_dry_run_changes_nothing_on_the_host",
    "download and verify": "tests/integration/test_download.py::test_fresh_download_then_a_second_run_skips_everything",
    "swap, staged": "tests/integration/test_swap.py::test_staged_swap_measures_downtime",
    "swap with rollback": "tests/integration/test_swap.py::test_failed_swap_rolls_back_to_the_previous_model",
    "regen": "tests/integration/test_swap.py::test_regen_without_and_with_a_template_change",
    "sleep swap": "tests/integration/test_sleep_swap.py::test_sleep_old_then_wake_it_back_with_its_canary",
    "status": "tests/integration/test_ops.py::test_status_walks_through_ready_failed_stopped_loading",
    "stop": "tests/integration/test_ops.py::test_stop_kills_its_orphaned_workers_on_its_gpus_only",
    "gc": "tests/integration/test_ops.py::test_gc_deletes_only_inactive_folders_and_nothing_outside",
    "logs": "tests/integration/test_ops.py::test_logs_since_deploy_shows_only_the_last_start",
    "several services": "tests/integration/test_services_sim.py::test_two_services_deploy_show_swap_and_stop_independently",
    "bench": "tests/integration/test_bench_sim.py::test_sweep_reproduces_the_nvfp4_profile",
    "monitor": "tests/integration/test_monitor_cli.py::test_monitor_of_a_keyed_service_with_an_objective",
    "engines": "tests/integration/test_engines_sim.py::"
               "test_deploy_builds_the_engine_offline_from_the_uploaded_wheelhouse_and_runs_from_it",
    "multi-node": "tests/integration/test_multinode_sim.py::test_deploy_status_logs_and_stop_of_a_two_node_service",
    "health timer": "tests/integration/test_health_busy_sim.py::test_a_hung_engine_is_still_restarted",
    "gateway": "tests/integration/test_gateway.py::test_one_url_routes_by_model_with_openai_errors_for_bad_input",
    "gateway-waker": "tests/integration/test_gateway_wake.py::test_a_request_wakes_its_model_and_two_loads_take_turns",
    "demo": "tests/integration/test_demo_sim.py::"
            "test_a_second_demo_keeps_the_hosts_services_and_models_and_a_busy_host_is_left_alone",
}


def is_quick(item: pytest.Item, tier: str) -> bool:
    """Whether `./dev test --quick` runs this test. A QUICK_TESTS entry without a parameter id takes
    the test's first parametrisation only (one test per operation)."""
    path = item.nodeid.split("::", 1)[0]
    if tier == "unit" or path in QUICK_FILES:
        return True
    picked = set(QUICK_TESTS.values())
    return item.nodeid in picked or (item.nodeid.split("[", 1)[0] in picked and _first_param(item))


def _first_param(item: pytest.Item) -> bool:
    spec = getattr(item, "callspec", None)
    return spec is None or all(i == 0 for i in spec.indices.values())


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
        if is_quick(item, tier):
            item.add_marker(pytest.mark.quick)
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
