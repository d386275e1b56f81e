"""matplotlib is an extra (`vllm-orch[plots]`): without it a bench run still writes every report file,
report.html included, and says in one line (console, result.json, report.html) that the PNGs were
skipped and how to get them; with it, the PNGs are inlined."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from orchestrator.bench.options import BenchOptions
from orchestrator.bench.plots import INSTALL_HINT, PlotsUnavailable, write_plots
from orchestrator.bench.runner import run_benchmark
from orchestrator.sim.mockserver import start_process


@pytest.fixture
def no_matplotlib(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # `import matplotlib` raises ImportError


def test_write_plots_says_how_to_install_matplotlib(no_matplotlib, tmp_path):
    with pytest.raises(PlotsUnavailable) as info:
        write_plots([], tmp_path, "t")
    assert str(info.value) == INSTALL_HINT and "vllm-orch[plots]" in str(info.value)


def _run(out: Path, console=None):
    proc, port = start_process(model="m", ttft_ms=5, itl_ms=1)
    try:
        opts = BenchOptions(concurrency=[1], max_tokens=8, warmup_s=0, duration_s=0.2, min_requests=2,
                            scrape_metrics=False)
        return run_benchmark(f"http://127.0.0.1:{port}", "m", opts, {"host": "sim", "host_label": "SIMULATED"},
                             out, console)
    finally:
        proc.kill()
        proc.wait()


def test_a_run_without_matplotlib_writes_the_report_and_says_plots_were_skipped(no_matplotlib, tmp_path):
    from rich.console import Console

    console = Console(file=open(tmp_path / "console.txt", "w"), width=200)
    r = _run(tmp_path / "r", console)
    console.file.close()
    files = {p.relative_to(r.out_dir).as_posix() for p in r.out_dir.rglob("*") if p.is_file()}
    assert {"result.json", "requests.jsonl", "summary.csv", "report.html"} <= files
    assert not any(f.startswith("plots/") for f in files)
    data = json.loads((r.out_dir / "result.json").read_text())
    assert data["plots_skipped"] == INSTALL_HINT and data["files"]["html"] == "report.html"
    page = (r.out_dir / "report.html").read_text()
    assert "Plots skipped: PNG plots need matplotlib" in page and "<img" not in page
    assert "Host sim: SIMULATED" in page                       # the inventory label, shown first
    assert f"plots skipped: {INSTALL_HINT}" in (tmp_path / "console.txt").read_text()


def test_a_run_with_matplotlib_inlines_the_plots():
    r = _run(Path(tempfile.mkdtemp()) / "r")
    assert "plots_skipped" not in r.data and (r.out_dir / "plots" / "throughput.png").is_file()
    assert r.data["files"]["plot_throughput"] == "plots/throughput.png"
    assert (r.out_dir / "report.html").read_text().count("<img") == 3
