"""Load models and their inputs, as pure functions: arrival schedules, output lengths, SLO parsing
and goodput, the SLO search, prompt files, request templates, the client verdict and the table."""

from __future__ import annotations

import io
import json
import math

import pytest

from orchestrator.bench.arrivals import schedule, warmup_arrivals, warp
from orchestrator.bench.client import Endpoint
from orchestrator.bench.lengths import parse_lengths
from orchestrator.bench.loadgen import LevelRun
from orchestrator.bench.options import BenchOptions
from orchestrator.bench.prompts import RequestFactory, read_prompt_file
from orchestrator.bench.search import Search
from orchestrator.bench.slo import evaluate, is_good, parse_slo
from orchestrator.bench.summary import client_check
from orchestrator.errors import ConfigError


def ks_exponential(gaps: list[float], rate: float) -> float:
    """Kolmogorov-Smirnov distance between the gaps and Exponential(rate)."""
    xs = sorted(gaps)
    n = len(xs)
    return max(max((i + 1) / n - (1 - math.exp(-rate * x)), (1 - math.exp(-rate * x)) - i / n)
               for i, x in enumerate(xs))


def gaps_of(offsets: list[float]) -> list[float]:
    return [b - a for a, b in zip(offsets, offsets[1:])]


def cv(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) / m


def test_poisson_schedule_is_exponential_and_spans_exactly_count_over_rate():
    offsets = schedule(8.0, 400, seed=3)
    assert len(offsets) == 401 and offsets[0] == 0.0
    assert offsets[-1] == pytest.approx(400 / 8.0)           # rescaled like vLLM's bench
    gaps = gaps_of(offsets)
    # the 1% critical value of the KS statistic for n = 400 is 1.63/sqrt(400) = 0.081
    assert ks_exponential(gaps, 8.0) < 0.081
    assert 0.85 < cv(gaps) < 1.15                            # exponential: CV 1
    assert schedule(8.0, 400, seed=3) == offsets             # seeded
    assert schedule(8.0, 400, seed=4) != offsets


def test_burstiness_and_constant_arrivals():
    bursty = gaps_of(schedule(10.0, 2000, burstiness=0.25, seed=1))
    regular = gaps_of(schedule(10.0, 2000, burstiness=4.0, seed=1))
    assert 1.7 < cv(bursty) < 2.3                            # gamma shape k: CV 1/sqrt(k)
    assert 0.42 < cv(regular) < 0.58
    assert sum(bursty) == pytest.approx(200.0) and sum(regular) == pytest.approx(200.0)
    const = gaps_of(schedule(4.0, 10, constant=True))
    assert const == pytest.approx([0.25] * 10)
    assert schedule(math.inf, 5) == [0.0] * 6
    with pytest.raises(ValueError):
        schedule(0.0, 5)


def test_ramp_up_time_change():
    assert warp(0.0, 10.0) == 0.0 and warp(5.0, 10.0) == pytest.approx(10.0)   # continuous at R
    assert warp(7.0, 10.0) == pytest.approx(12.0) and warp(3.0, 0.0) == 3.0
    ramped = schedule(10.0, 200, constant=True, ramp_s=4.0)
    early = sum(1 for t in ramped if t < 2.0)      # 10*2^2/(2*4) = 5 due in the first 2 s of the ramp
    assert early == 5
    late = [t for t in ramped if 6.0 <= t < 8.0]              # full rate after the ramp
    assert len(late) == 20
    assert warmup_arrivals(10.0, 3.0, 0.0) == 30 and warmup_arrivals(10.0, 1.0, 4.0) == 20
    assert warmup_arrivals(math.inf, 3.0, 0.0) == 0


def test_output_lengths():
    assert parse_lengths("512").table(0) == [512] and parse_lengths(64).fixed
    u = parse_lengths("256:768")
    t = u.table(5)
    assert min(t) >= 256 and max(t) <= 768 and abs(sum(t) / len(t) - 512) < 10
    assert parse_lengths("uniform:10:20").bounds == (10, 20)
    n = parse_lengths("normal:512:128")
    t = n.table(1)
    assert n.bounds == (128, 896) and min(t) >= 128 and max(t) <= 896
    assert abs(sum(t) / len(t) - 512) < 10 and 110 < cv(t) * 512 < 145
    assert u.table(5) == u.table(5) and u.table(5) != u.table(6)      # seeded, reproducible
    for bad in ("0", "9:3", "normal:5", "lots", "1:2:3", "normal:0:1"):
        with pytest.raises(ValueError):
            parse_lengths(bad)


def test_slo_parse_and_units():
    assert parse_slo("ttft=500ms,tpot=50ms") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_slo("E2E=2s, itl=100") == {"e2e": 2000.0, "itl": 100.0}
    assert parse_slo("ttft=250us") == {"ttft": 0.25}
    for bad in ("ttft", "ttfb=1ms", "ttft=-1ms", "ttft=fast", "ttft=1ms,ttft=2ms", ""):
        with pytest.raises(ValueError):
            parse_slo(bad)


def _row(ok=True, ttft=100.0, tpot=20.0, e2e=1000.0, itl=30.0, tokens=50):
    return {"ok": ok, "ttft_ms": ttft, "tpot_ms": tpot, "e2e_ms": e2e, "itl_max_ms": itl,
            "completion_tokens": tokens}


def test_goodput_counts_good_requests_with_failures_against():
    slo = {"ttft": 500.0, "tpot": 50.0}
    rows = [_row() for _ in range(6)] + [_row(ttft=600.0), _row(tpot=60.0), _row(ok=False),
                                          _row(tpot=None, tokens=1)]
    assert is_good(rows[-1], slo)                             # one token: no TPOT to miss
    s = evaluate(rows, slo, 90.0, window_s=2.0)
    assert s["requests"] == 10 and s["good"] == 7 and s["good_fraction"] == pytest.approx(0.7)
    assert not s["met"] and evaluate(rows, slo, 70.0, 2.0)["met"]
    assert s["goodput_req_s"] == pytest.approx(3.5) and s["goodput_tok_s"] == pytest.approx((6 * 50 + 1) / 2)
    assert s["metrics"]["ttft"]["threshold_ms"] == 500.0 and s["metrics"]["ttft"]["fraction_within"] == 0.8
    assert not is_good(_row(itl=120.0), {"itl": 100.0}) and is_good(_row(e2e=900.0), {"e2e": 1000.0})


def run_search(knee: float, lo: float, hi: float, integer: bool, **kw) -> dict:
    s = Search(lo, hi, integer=integer, **kw)
    while (x := s.next()) is not None:
        s.record(x, x <= knee)
    return s.result()


def test_search_finds_the_knee_in_a_few_levels():
    r = run_search(46, 1, 128, True)                                   # within 10%, 8 levels at most
    assert r["best"] <= 46 < r["first_failing"] and r["first_failing"] / r["best"] <= 1.1
    assert r["levels_run"] <= 8 and r["note"] == "converged"
    r = run_search(46, 1, 128, True, precision=0.0, max_levels=12)    # exact, a few more levels
    assert (r["best"], r["first_failing"]) == (46, 47) and r["levels_run"] <= 12
    r = run_search(12.7, 1.0, 64.0, False)
    assert r["best"] <= 12.7 < r["first_failing"] and r["first_failing"] / r["best"] <= 1.1
    assert r["levels_run"] <= 8
    assert run_search(0.5, 1, 128, True)["best"] is None               # even the lowest misses
    top = run_search(500, 1, 128, True)
    assert top["best"] == 128 and top["levels_run"] == 2 and "higher bound" in top["note"]
    assert run_search(46, 1, 128, True, max_levels=4)["levels_run"] == 4
    s = Search(1, 128, integer=True)
    for x, met in ((1, True), (128, False), (11, False), (3, True)):
        assert s.next() == x
        s.record(x, met)
    s.record(20, True)                                                 # a noisy level
    assert s.next() is None and "not monotonic" in s.note


def test_prompt_files_sharegpt_messages_strings_and_lines(tmp_path):
    share = [{"id": "a", "conversations": [{"from": "system", "value": "sys"},
                                           {"from": "human", "value": " first question "},
                                           {"from": "gpt", "value": "answer"},
                                           {"from": "human", "value": "second"}]},
             {"id": "b", "conversations": [{"from": "gpt", "value": "no user turn"}]},
             {"messages": [{"role": "user", "content": "from messages"}]}, "a plain string"]
    (tmp_path / "s.json").write_text(json.dumps(share))
    assert read_prompt_file(tmp_path / "s.json") == ["first question", "from messages", "a plain string"]
    (tmp_path / "p.txt").write_text("one\n\n  two  \n[not json\n")
    assert read_prompt_file(tmp_path / "p.txt") == ["one", "two", "[not json"]
    (tmp_path / "bad.json").write_text("[{\"conversations\": ")
    with pytest.raises(ConfigError, match="bad.json:1: not valid JSON"):
        read_prompt_file(tmp_path / "bad.json")
    (tmp_path / "none.json").write_text(json.dumps([{"conversations": []}]))
    with pytest.raises(ConfigError, match="no prompt found"):
        read_prompt_file(tmp_path / "none.json")
    (tmp_path / "many.txt").write_text("\n".join(f"prompt {i}" for i in range(50)))
    from orchestrator.bench.prompts import load_prompts

    a = load_prompts(BenchOptions(prompts_file=tmp_path / "many.txt", seed=1, prompt_pool=10))
    assert len(a) == 10 and a == load_prompts(BenchOptions(prompts_file=tmp_path / "many.txt",
                                                           seed=1, prompt_pool=10))
    assert a != load_prompts(BenchOptions(prompts_file=tmp_path / "many.txt", seed=2, prompt_pool=10))


def test_request_template_carries_each_requests_max_tokens():
    ep = Endpoint.parse("http://127.0.0.1:8000")
    f = RequestFactory(ep, "m", BenchOptions(max_tokens="8:4000", seed=3), ["hello there"])
    seen = set()
    for i in range(50):
        raw, n = f(i)
        head, body = raw.split(b"\r\n\r\n", 1)
        length = int(next(h for h in head.split(b"\r\n") if h.startswith(b"Content-Length")).split(b":")[1])
        obj = json.loads(body)
        assert length == len(body) and obj["max_tokens"] == n and 8 <= n <= 4000
        assert obj["messages"][0]["content"] == f"{i:08d} hello there"
        seen.add(n)
    assert len(seen) > 40
    raw, n = RequestFactory(ep, "m", BenchOptions(max_tokens=16), ["x"])(7)
    assert n == 16 and json.loads(raw.split(b"\r\n\r\n", 1)[1])["max_tokens"] == 16


def _run(lag: list[float], cpu: float | None, processes: int = 1) -> LevelRun:
    return LevelRun(4, [], 0, 0, 1, 1, lag, cpu, "", processes=processes)


def test_client_verdict_has_a_margin_between_ok_and_invalid():
    opts = BenchOptions()
    assert client_check(_run([1.0] * 200, 30.0), opts)[0] == "ok"
    verdict, bad, notes = client_check(_run([10.6] * 200, 30.0), opts)
    assert verdict == "marginal" and not bad and "10.6 ms is above 10 ms (invalid above 25 ms)" in notes[0]
    assert client_check(_run([9.8] * 200, 30.0), opts)[0] == "ok"
    assert client_check(_run([30.0] * 200, 30.0), opts)[0] == "invalid"
    assert client_check(_run([1.0] * 200, 85.0), opts)[0] == "marginal"
    assert client_check(_run([1.0] * 200, 170.0, processes=2), opts)[0] == "marginal"   # per process
    assert client_check(_run([1.0] * 200, 97.0), opts)[0] == "invalid"


def test_final_table_is_not_cut_when_output_is_redirected():
    from rich.console import Console

    from orchestrator.bench.tables import levels_table, print_wide

    lat = {m: {"n": 300, "p50": 1234.5, "p95": 2345.6, "p99": 3456.7, "p99_low_n": False}
           for m in ("ttft", "tpot", "e2e")}
    level = {"level": "rate=16/s max C=128", "concurrency": 128, "valid": True, "client_verdict": "ok",
             "latency_ms": lat, "requests": {"errors": 0}, "throughput": {"output_tok_s": 12345.6,
                                                                          "requests_per_s": 12.34},
             "per_user": {"tok_s_user_median": 42.0},
             "slo": {"good_fraction": 0.95, "goodput_req_s": 11.7, "goodput_tok_s": 11728.3, "met": True}}
    buf = io.StringIO()
    console = Console(file=buf, width=80)                   # what Rich picks for a pipe or a file
    assert not console.is_terminal
    print_wide(console, levels_table([level], with_slo=True))
    text = buf.getvalue()
    assert "…" not in text and "rate=16/s max C=128" in text
    for figure in ("12345.6", "3456.7", "11728.3", "goodput tok/s", "TPOT p95"):
        assert figure in text
    assert max(len(line) for line in text.splitlines()) > 80 and console.width == 80
