"""`./dev test --quick` (tests/plugins/tiers.py QUICK_TESTS, QUICK_FILES): every entry names a test
that exists and takes exactly one of it, so a renamed test fails here instead of silently shrinking
the inner loop; nothing outside the unit tier, the contract files and the list is selected."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.plugins.tiers import QUICK_FILES, QUICK_TESTS

REPO = Path(__file__).resolve().parents[2]


def test_the_quick_selection_is_the_unit_tier_the_contract_files_and_one_test_per_operation():
    for path in QUICK_FILES:
        assert (REPO / path).is_file(), path
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-p", "no:randomly", "-m", "quick", "tests"], cwd=REPO, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    outside = [i for i in ids if not i.startswith("tests/unit/") and not i.startswith(QUICK_FILES)]
    for operation, entry in QUICK_TESTS.items():
        taken = [i for i in outside if i == entry or i.split("[", 1)[0] == entry]
        assert len(taken) == 1, f"{operation}: {entry} selects {taken}"
    assert len(outside) == len(QUICK_TESTS), sorted(set(outside) - set(QUICK_TESTS.values()))
    assert sum(i.startswith("tests/unit/") for i in ids) > 800
