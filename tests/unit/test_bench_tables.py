"""The bench's words about time: how long a sweep takes at the least before it starts, and how long
the running level has left (a `--duration 5` sweep took 80 s with no word of it)."""

from __future__ import annotations

from orchestrator.bench.options import BenchOptions
from orchestrator.bench.tables import eta, progress_line, run_intro


def progress(**kw) -> dict:
    return {"level": "C=1", "phase": "window", "completed": 3, "window_done": 4, "window_min": 20, "errors": 0,
            "in_flight": 1, "elapsed_s": 12.0, "window_s": 2.0, "duration_s": 5.0, **kw}


def test_the_sweep_says_its_least_time_before_it_starts():
    text = run_intro(BenchOptions(concurrency=[1, 8, 32], duration_s=5, warmup_s=10))
    assert "3 levels" in text and "at least 45 s" in text and "minimum requests" in text, text


def test_a_level_says_how_long_it_has_left_from_its_window_or_its_minimum_requests():
    assert eta(progress(phase="warm-up")) == "in warm-up"
    # 4 of 20 requests in 2 s: 16 more at 2/s is 8 s, longer than the window's 3 s left
    assert eta(progress()) == "~8 s left in this level"
    assert eta(progress(window_done=20, window_s=2.0)) == "~3 s left in this level"     # the window's rest
    assert eta(progress(window_done=0)) == "the first requests of the window are still running"
    assert progress_line(progress()).endswith("; ~8 s left in this level")


def level_summary(c: int) -> dict:
    lat = {k: {"n": 40, "p50": 10.0 * c, "p95": 12.5 * c, "p99": 14.25 * c} for k in ("ttft", "tpot", "e2e")}
    return {"level": f"C={c}", "concurrency": c, "latency_ms": lat, "requests": {"errors": 0},
            "throughput": {"output_tok_s": 81.4 * c, "requests_per_s": 0.25 * c},
            "per_user": {"tok_s_user_median": 81.4}, "valid": True}


def test_the_results_table_on_an_80_column_terminal_is_split_not_cut():
    # 15 columns at 80 columns were cut to "…": every figure must still be printed whole.
    import io

    from rich.console import Console

    from orchestrator.bench.tables import print_levels

    for width, parts in ((80, 3), (250, 1)):
        out = io.StringIO()
        print_levels(Console(file=out, width=width, force_terminal=True, color_system=None),
                     [level_summary(1), level_summary(128)])
        text = out.getvalue()
        assert "…" not in text and max(len(line) for line in text.splitlines()) <= width, text
        assert text.count("bench results") == parts, text
        for figure in ("10419.2", "1824.00", "E2E p99", "TPOT p50", "tok/s/user"):
            assert figure in text, (figure, text)


def test_models_on_an_80_column_terminal_fold_instead_of_cutting():
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "models"], cwd=repo, capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "COLUMNS": "80", "FORCE_COLOR": "1",
                                                     "NO_COLOR": "1", "HOME": str(repo)})
    assert out.returncode == 0, out.stderr
    import re
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout)
    table = [line for line in plain.splitlines() if line.startswith(("┃", "│"))]
    assert table and "…" not in out.stdout and all(len(line) <= 80 for line in table), out.stdout
    assert "kimi-k25-int4-2node" in out.stdout and "8000" in out.stdout and "GPUs" in out.stdout
