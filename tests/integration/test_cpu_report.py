"""`--cpu-report` (tests/plugins/cpu_report.py) charges a test with the CPU of the processes it
starts, and not with another test's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plugins.cpu_report import read, usable

REPO = Path(__file__).resolve().parents[2]
BURN = "import sys; n = 0\nfor i in range(4_000_000): n += i\n"      # a fixed amount of work

TESTS = f'''
import resource, subprocess, sys
from pathlib import Path

def spent():
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime

def test_burns_in_a_child():
    before = spent()
    subprocess.run([sys.executable, "-c", {BURN!r}], check=True)
    Path("child-cpu").write_text(str(spent() - before))   # the kernel's own count of the child's CPU

def test_idle():
    pass
'''


@pytest.mark.skipif(usable() is not None, reason=f"--cpu-report cannot measure here: {usable()}")
def test_each_test_is_charged_with_its_own_processes(tmp_path):
    (tmp_path / "test_cpu.py").write_text(TESTS)
    out = tmp_path / "cpu.tsv"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "-p", "tests.plugins.cpu_report", "--cpu-report", str(out), "--rootdir", str(tmp_path),
                        str(tmp_path / "test_cpu.py")],
                       cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = read(out)
    cpu = {nodeid.split("::")[1]: c for nodeid, c, _, _ in rows}
    # The child's CPU as the kernel counted it in the same run: the same work costs a different
    # amount of CPU in another process on a busy machine (CI: 0.46 s in the test, 0.58 s beside it).
    child = float((tmp_path / "child-cpu").read_text())
    assert child > 0.05, child
    assert cpu["test_burns_in_a_child"] >= 0.8 * child, (cpu, child)
    assert cpu["test_idle"] < 0.5 * child, (cpu, child)
    assert "CPU per test" in r.stdout and "test_burns_in_a_child" in r.stdout
    assert set(cpu) == {"test_burns_in_a_child", "test_idle"}
    # The tier by tests/plugins/tiers.py's rule (outside tests/unit, no host fixture: sim), summed.
    assert {tier for *_, tier in rows} == {"sim"} and "summed over 2 tests of tier sim" in r.stdout
