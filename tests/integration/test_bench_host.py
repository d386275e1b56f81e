"""`vllm-orch bench --host H`: endpoint and served name from the active deployment, the summary
recorded in the host's history, and `status` showing the last single-stream and peak figures."""

from __future__ import annotations

import json
import subprocess
import sys

from orchestrator.host.state import read_history

from .deployhelp import cli_env, deploy, entry, on_port, write_models


def test_bench_against_a_deployed_host_is_recorded_and_shown_by_status(sim_host, tmp_path):
    e, m = entry(sim_host), on_port("minimax-m25")
    assert deploy(e, m).ok
    models = write_models(tmp_path / "models", [m])
    env = cli_env(sim_host, models)
    out = tmp_path / "bench"
    run = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "bench", "--host", "sim", "-c", "1,2",
                          "--max-tokens", "32", "--duration", "1", "--warmup", "0", "--min-requests", "2",
                          "--out", str(out)], env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["metadata"]["host_label"] == "SIMULATED" and result["metadata"]["host"] == "sim"
    assert result["metadata"]["served_name"] == m.served_name
    record = read_history(sim_host.host, e)[-1].shown()
    assert record["operation"] == "bench" and record["single_stream_tok_s"] > 10
    status = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "status", "--host", "sim", "--json"],
                            env=env, capture_output=True, text=True, timeout=60)
    host = json.loads(status.stdout)[0]
    assert host["last_bench"]["single_stream_tok_s"] == record["single_stream_tok_s"]
    assert host["last_bench"]["peak_output_tok_s"] == record["peak_output_tok_s"]
    text = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "status", "--host", "sim"],
                          env=env, capture_output=True, text=True, timeout=60).stdout
    assert "last bench" in text and "single stream" in text and "peak" in text
