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
