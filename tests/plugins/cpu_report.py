"""`--cpu-report=FILE`: each test's CPU time, its own and that of every process it started.

Write it with `=`: as two words, with no test path after it, pytest takes FILE for a test path
when it looks for the root folder, and the parallel workers then do not know the option.

The suite is CPU-bound on a 2-core machine (docs/figures.md, "Test suite"), and a test's wall time
says little there: it waits for the others. A test's CPU is what it costs everyone. Sampling the
process table misses the short processes a deploy starts by the hundred (nvidia-smi, the facts
script, shells). So each test runs in a control group of its own. Before the test, the worker moves
itself into a fresh cgroup-v1 `cpuacct` group; every process the test starts is born in it and
charged to it, exited or not, up to the test's end. After the test, the worker moves back (a process
the test left running stays in the group, and what it spends later is not reported).

FILE gets one tab-separated line per test: nodeid, CPU seconds, wall seconds, tier (by
tests/plugins/tiers.py's own rule, `tier_of`). The terminal summary shows the total,
the sums per tier (where a full run's time goes: docs/figures.md) and the heaviest tests. It needs
root and a writable cpuacct hierarchy; without one, the report says so in one line and measures
nothing. With pytest-xdist, every worker appends to FILE (one short write per line).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from tests.plugins.tiers import tier_of

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
SHOWN = 15


def pytest_addoption(parser):
    parser.addoption("--cpu-report", metavar="FILE", default=None,
                     help="write each test's CPU seconds (its processes included) to FILE; give it as "
                          "--cpu-report=FILE; needs root and a cgroup-v1 cpuacct hierarchy "
                          "(tests/plugins/cpu_report.py)")


def usable(root: Path = CPUACCT) -> str | None:
    """Why the report cannot measure here, or None."""
    if os.geteuid() != 0:
        return "needs root (it moves the test process between cgroups)"
    if not (root / "cpuacct.usage").is_file() or not os.access(root, os.W_OK):
        return f"needs a writable cgroup-v1 cpuacct hierarchy at {root}"
    return None


def own_group(root: Path = CPUACCT) -> Path:
    """This process's cpuacct group (`N:cpu,cpuacct:/path` in /proc/self/cgroup), to return to."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "cpuacct" in parts[1].split(","):
            return root / parts[2].lstrip("/")
    return root


class Meter:
    def __init__(self, out: Path, root: Path = CPUACCT):
        self.out, self.home = out, own_group(root)
        self.base = self.home / f"vllm-orch-tests-{os.getpid()}"
        self.base.mkdir(exist_ok=True)

    def _join(self, group: Path) -> None:
        (group / "cgroup.procs").write_text(str(os.getpid()))

    def measure(self, nodeid: str, tier: str):
        group = self.base / uuid.uuid4().hex[:12]
        group.mkdir()
        self._join(group)
        started = time.monotonic()
        try:
            yield
        finally:
            self._join(self.home)
            wall = time.monotonic() - started
            cpu = int((group / "cpuacct.usage").read_text()) / 1e9
            with open(self.out, "a") as f:
                f.write(f"{nodeid}\t{cpu:.3f}\t{wall:.3f}\t{tier}\n")
            try:
                group.rmdir()                     # refused while a process the test left runs in it
            except OSError:
                pass


def pytest_configure(config):
    out = config.getoption("cpu_report")
    if not out:
        return
    why = usable()
    if why:
        config.stash[REASON] = why
        return
    if not hasattr(config, "workerinput"):         # the controller (or a run without xdist) starts it
        Path(out).write_text("")
    config.stash[METER] = Meter(Path(out))


METER = pytest.StashKey[Meter]()
REASON = pytest.StashKey[str]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    meter = item.config.stash.get(METER, None)
    if meter is None:
        yield
        return
    gen = meter.measure(item.nodeid, tier_of(item))
    next(gen)
    try:
        yield
    finally:
        next(gen, None)


def read(path: Path) -> list[tuple[str, float, float, str]]:
    """(nodeid, CPU seconds, wall seconds, tier) per test."""
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) == 4:
            rows.append((parts[0], float(parts[1]), float(parts[2]), parts[3]))
    return rows


def pytest_terminal_summary(terminalreporter, config):
    out = config.getoption("cpu_report")
    if not out or hasattr(config, "workerinput"):
        return
    tr = terminalreporter
    why = config.stash.get(REASON, None)
    if why:
        tr.write_line(f"--cpu-report: nothing measured: {why}")
        return
    rows = read(Path(out))
    tr.section("CPU per test (its processes included)")
    tr.write_line(f"{len(rows)} tests, {sum(r[1] for r in rows):.1f} s of CPU in all; written to {out}")
    tiers: dict[str, list[float]] = {}
    for _, cpu, wall, tier in rows:
        sums = tiers.setdefault(tier, [0, 0.0, 0.0])
        sums[0] += 1
        sums[1] += cpu
        sums[2] += wall
    for tier, (n, cpu, wall) in sorted(tiers.items(), key=lambda kv: -kv[1][1]):
        tr.write_line(f"{cpu:8.1f} s CPU {wall:8.1f} s wall, summed over {int(n)} tests of tier {tier}")
    for nodeid, cpu, wall, _ in sorted(rows, key=lambda r: -r[1])[:SHOWN]:
        tr.write_line(f"{cpu:8.1f} s CPU {wall:8.1f} s wall  {nodeid}")


def pytest_unconfigure(config):
    meter = config.stash.get(METER, None)
    if meter is not None:
        for group in [*meter.base.iterdir(), meter.base]:
            if group.is_dir():
                try:
                    group.rmdir()                 # the groups whose processes have all ended
                except OSError:
                    pass
