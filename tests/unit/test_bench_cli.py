"""`vllm-orch bench` option errors name the option, and options that do not go together are refused
before anything is sent."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from orchestrator.cli.main import cli
from orchestrator.errors import ConfigError

BASE = ["bench", "--url", "http://127.0.0.1:9", "--model", "m"]


@pytest.mark.parametrize("args, named", [
    (["-c", "0"], "'-c' / '--concurrency': levels must be >= 1, got '0'"),
    (["-c", "1,x"], "'-c' / '--concurrency'"),
    (["--rate", "0,2"], "'--rate': rates must be > 0"),
    (["--rate", "fast"], "'--rate'"),
    (["--max-tokens", "0"], "'--max-tokens': must be >= 1"),
    (["--max-tokens", "900:100"], "'--max-tokens': range needs 1 <= A <= B"),
    (["--slo", "ttft=soon"], "'--slo'"),
    (["--slo", "latency=1s"], "'--slo'"),
    (["--max-concurrency", "0"], "'--max-concurrency'"),
    (["--burstiness", "0"], "'--burstiness'"),
    (["--timeout", "0"], "'--timeout'"),
    (["--processes", "-1"], "'--processes'"),
    (["--input-tokens", "0"], "'--input-tokens'"),
    (["--max-error-rate", "150"], "'--max-error-rate'"),
])
def test_bad_values_name_the_option(args, named):
    res = CliRunner().invoke(cli, BASE + args)
    assert res.exit_code == 2, res.output
    assert named in res.output


@pytest.mark.parametrize("args, message", [
    (["-c", "4", "--rate", "2"], "give -c/--concurrency (closed loop) or --rate (open loop), not both"),
    (["--max-concurrency", "8"], "--max-concurrency applies to open-loop levels"),
    (["--burstiness", "0.5"], "--burstiness applies to open-loop levels"),
    (["--rate", "2", "--arrivals", "constant", "--burstiness", "2"], "--arrivals constant has none"),
    (["--rate", "inf", "--ramp-up", "5"], "--ramp-up with --rate inf needs --max-concurrency"),
    (["--search"], "--search needs --slo"),
    (["--search", "--slo", "ttft=1s", "-c", "8"], "--search needs two finite bounds in -c/--concurrency"),
    (["--search", "--slo", "ttft=1s", "--rate", "1,inf"], "--search needs two finite bounds in --rate"),
    (["--search-levels", "4"], "--search-levels applies to --search"),
    (["--slo-percentile", "99"], "--slo-percentile applies to --slo"),
    (["--min-tokens", "10", "--max-tokens", "16:64"], "--min-tokens with a --max-tokens range"),
])
def test_combinations_that_do_not_go_together(args, message):
    res = CliRunner().invoke(cli, BASE + args)
    assert isinstance(res.exception, ConfigError), res.output
    assert message in str(res.exception)
