"""The health check's progress rule (orchestrator/host/remote/unit_probe.py PROGRESS, progress_note):
the series it reads are pinned to vLLM 0.33.0's own metrics code (the /metrics text recorded by
tests/fixtures/vllm-metrics/record.py from vllm/v1/metrics/loggers.py), per engine; and what counts
as a busy engine rather than a hung one."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import pytest

from orchestrator.paths import package_file
from orchestrator.render import artifacts

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-metrics"


def probe_module():
    spec = importlib.util.spec_from_file_location("unit_probe_progress", package_file("host", "remote", "unit_probe.py"))
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def recorded(name: str) -> str:
    return gzip.decompress((FIXTURES / name).read_bytes()).decode()


def test_the_progress_series_are_vllms_own_per_engine():
    """Every signal is found, for every engine, under the name and `engine` label vLLM 0.33 gives
    it, in both registries vLLM serves (one API server; the multiprocess one of DP)."""
    mod = probe_module()
    dp8 = mod.progress_from_text(recorded("dp8-multiproc.prom.gz"))
    assert sorted(dp8, key=int) == [str(e) for e in range(8)]
    kv = [0.25, 0.75, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    for e in range(8):
        assert dp8[str(e)] == {"running": 3 + e, "waiting": e % 2, "kv_cache_usage": pytest.approx(kv[e]),
                               "generation_tokens": 100 * (e + 1), "prompt_tokens": 40}
    tp8 = mod.progress_from_text(recorded("tp8-single.prom.gz"))
    assert set(tp8) == {"0"} and set(tp8["0"]) == {key for key, _ in mod.PROGRESS}


def test_a_step_that_only_filled_the_kv_cache_is_progress():
    """A chunked prefill: no token counter moves, the KV cache fills step by step."""
    mod = probe_module()
    before = {"0": {"generation_tokens": 10.0, "prompt_tokens": 5.0, "kv_cache_usage": 0.10, "running": 1.0,
                    "waiting": 1.0}}
    after = {"0": dict(before["0"], kv_cache_usage=0.17)}
    note = mod.progress_note(before, after)
    assert note and "vllm:kv_cache_usage_perc 0.1000 -> 0.1700" in note and "engine 0" in note


def test_nothing_moved_or_an_engine_with_work_stood_still_is_no_progress():
    mod = probe_module()
    busy = {"running": 1.0, "waiting": 1.0, "kv_cache_usage": 0.3, "generation_tokens": 7.0}
    assert mod.progress_note({"0": busy}, {"0": dict(busy)}) is None              # hung: frozen
    assert mod.progress_note(None, {"0": busy}) is None                          # no /metrics
    idle = {"running": 0.0, "waiting": 0.0, "kv_cache_usage": 0.0}
    moving = dict(busy, generation_tokens=90.0)
    assert mod.progress_note({"0": busy, "1": idle}, {"0": moving, "1": dict(idle)})     # an idle engine may rest
    assert mod.progress_note({"0": busy, "1": busy}, {"0": moving, "1": dict(busy)}) is None   # DP: one hung


def test_the_probe_and_render_agree_on_the_exit_codes_and_the_credential():
    mod = probe_module()
    assert (mod.RESTART_EXIT, mod.BUSY_EXIT, mod.CREDENTIAL) == \
        (artifacts.RESTART_EXIT, artifacts.BUSY_EXIT, artifacts.CREDENTIAL)
