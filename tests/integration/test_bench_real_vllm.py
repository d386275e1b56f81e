"""The bench against a REAL vLLM server (vLLM's CPU build serving a tiny model): prompts sized to
exact lengths through vLLM's own /tokenize and /detokenize, and a closed and an open-loop level
measured end to end. Needs the real-vLLM test tier (tests/plugins/real_vllm.py, marker real_vllm);
without it the module is skipped at collection."""

from __future__ import annotations

import json

import pytest

real = pytest.importorskip("tests.plugins.real_vllm", reason="the real-vLLM test tier is not in this tree")

from orchestrator.bench.options import BenchOptions  # noqa: E402
from orchestrator.bench.runner import run_benchmark  # noqa: E402

pytestmark = pytest.mark.real_vllm


def test_exact_prompt_lengths_and_levels_against_real_vllm(real_vllm, tiny_model, tmp_path):
    model = tiny_model()
    with real.RealServer(real_vllm, model, ["--served-model-name", "tiny"], log_dir=tmp_path) as srv:
        srv.wait_ready()
        url = srv.url("")
        # vLLM's own error for an unknown model, as the simulators copy it
        import urllib.error
        import urllib.request

        req = urllib.request.Request(url + "/tokenize", data=b'{"model": "nope", "prompt": "x"}',
                                     headers={"content-type": "application/json"}, method="POST")
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(req, timeout=30)
        err = json.loads(exc.value.read())["error"]
        assert exc.value.code == 404 and err["type"] == "NotFoundError" and err["param"] == "model"
        assert err["message"].startswith("The model `nope` does not exist.")

        for name, kw in (("closed", {"concurrency": [2], "input_tokens": 60}),
                         ("open", {"rates": [4.0], "input_tokens": 37, "max_tokens": "4:12"})):
            opts = BenchOptions(**{"max_tokens": 8, "warmup_s": 0.5, "duration_s": 2.0, "min_requests": 6,
                                   "slo": {"ttft": 5000.0}, **kw})
            r = run_benchmark(url, "tiny", opts, {}, tmp_path / name)
            prompts = r.data["metadata"]["prompts"]
            assert prompts["exact"] and prompts["off_target"] == 0, prompts
            rows = [json.loads(x) for x in (r.out_dir / "requests.jsonl").read_text().splitlines()]
            assert {row["prompt_tokens"] for row in rows} == {kw["input_tokens"]}
            L = r.levels[0]
            assert L["requests"]["errors"] == 0 and L["requests"]["ok"] >= 6
            assert L["tokens"]["prompt_off_target"] == 0 and L["slo"]["requests"] == L["requests"]["window"]
        with pytest.raises(Exception, match="below what the chat template and the request nonce take"):
            run_benchmark(url, "tiny", BenchOptions(concurrency=[1], input_tokens=3, duration_s=0.5,
                                                    warmup_s=0.0), {}, tmp_path / "too-short")
