"""/tokenize and /detokenize of the simulated vLLM server: vLLM 0.33's request and response shapes,
its errors (unknown model, missing fields, both template switches), and counts that agree with the
completions' usage.prompt_tokens. The error bodies are the ones vLLM 0.33's source builds
(serve/engine/serving.py _check_model, exception_handling/handlers/validation.py), checked by hand
against vLLM's CPU build serving a tiny model."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from orchestrator.sim import vllm_server as vs
from tests.plugins.sim_hosts import SimServer, make_model


def post(port: int, path: str, body) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 method="POST", headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_detokenize_shapes_and_usage_agreement(sim_host):
    model = make_model(sim_host.dir, "generic", "acme/small-dense", custom_code=False)
    with SimServer(sim_host, [str(model), "--served-model-name", "small", "--max-model-len", "4096"]) as srv:
        srv.wait_ready()
        text = "Explain a rate limiter, step by step: tokens, buckets and refill."
        status, tok = post(srv.port, "/tokenize", {"model": "small", "prompt": text})
        assert status == 200 and set(tok) == {"count", "max_model_len", "tokens", "token_strs"}
        assert tok["max_model_len"] == 4096 and tok["token_strs"] is None
        assert tok["count"] == len(tok["tokens"]) == len(vs.tokenize(text)) + 1    # <s> by default

        status, bare = post(srv.port, "/tokenize", {"prompt": text, "add_special_tokens": False,
                                                    "return_token_strs": True})
        assert status == 200 and bare["count"] == tok["count"] - 1       # model is optional
        assert "".join(bare["token_strs"]) == text
        status, det = post(srv.port, "/detokenize", {"model": "small", "tokens": bare["tokens"]})
        assert status == 200 and det == {"prompt": text}

        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
        status, chat = post(srv.port, "/tokenize", {"model": "small", "messages": messages})
        assert status == 200
        status, done = post(srv.port, "/v1/chat/completions",
                            {"model": "small", "messages": messages, "max_tokens": 4})
        assert status == 200 and done["usage"]["prompt_tokens"] == chat["count"]
        status, comp = post(srv.port, "/v1/completions", {"model": "small", "prompt": text, "max_tokens": 4})
        assert status == 200 and comp["usage"]["prompt_tokens"] == tok["count"]
        status, nogen = post(srv.port, "/tokenize", {"messages": messages, "add_generation_prompt": False})
        assert nogen["count"] == chat["count"] - 3

        status, err = post(srv.port, "/tokenize", {"model": "nope", "prompt": "x"})
        assert status == 404 and err == {"error": {
            "message": "The model `nope` does not exist. Valid aliases: small.",
            "type": "NotFoundError", "param": "model", "code": 404}}
        status, err = post(srv.port, "/detokenize", {"model": "nope", "tokens": [1]})
        assert status == 404 and err["error"]["type"] == "NotFoundError"
        status, err = post(srv.port, "/tokenize", {"model": "small"})
        assert status == 400 and err["error"]["type"] == "Bad Request"
        assert err["error"]["param"] == "body.prompt" and err["error"]["message"].startswith("2 validation errors:")
        status, err = post(srv.port, "/detokenize", {"model": "small"})
        assert status == 400 and err["error"]["param"] == "body.tokens"
        status, err = post(srv.port, "/detokenize", {"tokens": [-1]})
        assert status == 400 and err["error"]["param"] == "body.tokens.0"
        assert post(srv.port, "/detokenize", {"tokens": [10**9]}) == (200, {"prompt": ""})
        status, err = post(srv.port, "/tokenize", {"messages": messages, "add_generation_prompt": True,
                                                   "continue_final_message": True})
        assert status == 400 and err["error"]["type"] == "BadRequestError" and err["error"]["param"] is None
        assert "Cannot set both" in err["error"]["message"]
