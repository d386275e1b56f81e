"""The definitions behind every number, written verbatim into each result file and docs/benchmarking.md.

Names follow vLLM/AIPerf usage (TTFT, TPOT, ITL, ICL) - not guidellm's, whose "TPOT" includes the
first token and whose "ITL" is what we call TPOT (guidellm's docs/guides/metrics.md; the confusion
costs users: vllm-project/vllm#6531, "inter-token latency is lower than TPOT").
"""

from __future__ import annotations

from orchestrator.bench.stats import PERCENTILE_METHOD

SCHEMA = "vllm-orch.bench.result/2"

FORMULAS: dict[str, str] = {
    "clock": "time.perf_counter_ns(), stamped in the transport's data_received callback when bytes "
             "arrive, before any HTTP/SSE/JSON parsing. An SSE event gets the stamp of the read that "
             "completed it.",
    "token_bearing_chunk": "an SSE chunk whose delta has non-empty content, reasoning_content/"
                           "reasoning or tool_calls, or whose per-chunk usage grew. Role-only frames, "
                           "empty deltas, the usage-only chunk and [DONE] are not token-bearing.",
    "output_tokens": "usage.completion_tokens from the server (includes reasoning on vLLM). If the "
                     "server sent no usage, the number of token-bearing chunks, with tokens_source="
                     "'chunks' and a warning. Never max_tokens. Reasoning tokens are never added on top.",
    "reasoning_tokens": "usage.completion_tokens_details.reasoning_tokens when sent (source 'usage'); "
                        "otherwise the tokens of chunks carrying only reasoning (source 'chunks').",
    "tokens_per_chunk": "with stream_options.continuous_usage_stats: the growth of usage."
                        "completion_tokens on that chunk (exact). Without: 1 per token-bearing chunk, "
                        "scaled so the request's chunks sum to usage.completion_tokens.",
    "chunk_count_discrepancy_pct": "100 * (token-bearing chunks - completion_tokens) / "
                                   "completion_tokens; flagged when |value| > 10 (multi-token chunks "
                                   "from speculative decoding/MTP/stream intervals, or bad usage).",
    "queue_ms": "t_send - t_ready, client-side waiting: closed loop, from the moment the worker was "
                "free (its previous request ended) to the request's first byte written, including any "
                "reconnect; open loop, from the instant the request was due on the arrival schedule "
                "(a late timer, a full --max-concurrency cap and a connect all count).",
    "ttfb_ms": "first response byte - t_send.",
    "ttft_ms": "first token-bearing chunk - t_send (reasoning and tool calls count as tokens).",
    "ttfc_ms": "time to first content: first chunk with non-empty delta.content (or tool_calls) - "
               "t_send; equals TTFT for non-reasoning answers, null if no content came.",
    "e2e_ms": "last token-bearing chunk - t_send (not [DONE] nor the usage chunk).",
    "e2e_incl_queue_ms": "last token-bearing chunk - t_ready (latency including client queueing; in "
                         "open loop this is the latency a user arriving on schedule saw).",
    "tpot_ms": "(e2e - ttft) / (completion_tokens - 1), per request; null when completion_tokens < 2.",
    "tok_s_user": "per request 1000 / tpot_ms (decode rate seen by one user, excludes TTFT); the level "
                  "reports the median over window requests.",
    "tok_s_e2e": "per request completion_tokens / e2e (includes TTFT); level reports the median.",
    "itl_ms": "inter-token latency from tokens, not chunks: each gap between consecutive token-"
              "bearing chunks divided by the tokens of the later chunk, weighted by those tokens, "
              "pooled over the window requests (token-weighted).",
    "icl_ms": "inter-chunk latency: the raw gaps between consecutive token-bearing chunks, pooled.",
    "load_model": "closed loop: C workers, each with its own keep-alive connection, send the next "
                  "request as soon as the previous one ends (with ramp_up_s R, worker k starts at "
                  "k*R/C). Warm-up lasts >= max(warmup_s, R) and >= warmup_requests completions; the "
                  "window then lasts >= duration_s and until >= min_requests window requests "
                  "completed (default max(20, 2*C)); then no new requests are sent and in-flight ones "
                  "drain.",
    "open_loop": "request rate r: W = round(r*warmup_s) warm-up arrivals (>= warmup_requests) then "
                 "N = max(min_requests, round(r*duration_s)) window arrivals, due on an absolute "
                 "schedule drawn up front: gaps gamma(shape=burstiness, mean 1/r) (burstiness 1: "
                 "Poisson) or constant 1/r, rescaled so the schedule spans exactly (W+N)/r (as vLLM's "
                 "bench does); with ramp_up_s R the rate rises linearly from 0 over R (time-changed "
                 "schedule). A request goes out when due, on an idle or new connection, or when one "
                 "of max_concurrency slots is free. Window: [due time of arrival W, end of the "
                 "schedule). Rate inf: all due at once (through the cap, if any); the window is the whole burst, "
                 "[first window send, last token], drain included, as vLLM's bench measures it.",
    "window_requests": "closed loop: requests sent inside [window start, window end); open loop: "
                       "arrivals W..W+N-1. All latency statistics, error counts and SLO figures of a "
                       "level are over these.",
    "output_lengths": "max_tokens per request: fixed N, uniform integers in [A, B], or a normal "
                      "(mean, std) clipped to [max(1, mean-3std), mean+3std]; drawn once from the seed "
                      "(request i asks for table[i % 4096]) and recorded per request.",
    "prompt_tokens": "with the server's /tokenize (vLLM): every prompt is cut or extended so the "
                     "chat-templated message, nonce included, is exactly input_tokens tokens; "
                     "usage.prompt_tokens is checked against it per request (prompt_off_target). "
                     "Without /tokenize: about 4 characters per token, a warning, and the real counts "
                     "from usage.prompt_tokens.",
    "output_tok_s": "steady-state aggregate output throughput: tokens of token-bearing chunks that "
                    "arrived inside [window start, window end], from any successful request "
                    "(warm-up ones included), / window seconds. Warm-up ramp and drain tail excluded.",
    "output_tok_s_se": "standard error of output_tok_s: the window is cut into 5 equal slices, SE = "
                       "std(slice rates) / sqrt(5). Used by `bench compare` as the noise estimate.",
    "requests_per_s": "successful requests whose last token arrived inside the window / window seconds.",
    "errors": "by kind, over window requests: http_<status>, stream_error (an error event or "
              "unparseable data in the stream), timeout, empty (no generated token), disconnect "
              "(connection closed mid-stream), connect. Requests cut off after an abort are "
              "'cancelled', counted apart.",
    "abort": "a level stops sending when its failed requests reach max_errors, or exceed "
             "max_error_rate of its finished requests (judged from 10 finished on); requests still "
             "running 5 s later are cancelled. The level is reported with aborted = the reason.",
    "slo": "a request is good when it succeeded and meets every objective given: TTFT, TPOT, E2E, "
           "and ITL as its longest inter-token gap per token (a one-token answer has no TPOT/ITL). "
           "good_fraction = good / window requests (failed ones count against); goodput_req_s = "
           "good / window seconds; goodput_tok_s = completion tokens of good requests / window "
           "seconds. A level meets the SLO when good_fraction >= slo_percentile/100.",
    "search": "the highest concurrency (or rate) meeting the SLO: the lower bound, the upper bound, "
              "then geometric bisection between the highest level that met it and the lowest that "
              "missed it, until they are within search_precision (or 1 stream) or search_levels "
              "levels ran. Assumes the SLO is met below a knee and missed above it.",
    "percentiles": PERCENTILE_METHOD + "; p50, p90, p95 and p99; every summary carries its sample "
                   "count n, and p99_low_n=true when n < 100 (the p99 is then close to the max).",
    "server_metrics": "/metrics scraped before and after each level (counters: after - before) and "
                      "every metrics_interval_s during the window (gauges: mean and max). vLLM's "
                      "per-engine series (one per DP rank) combine as in status: requests and "
                      "counters are sums, kv_cache_usage_perc is the mean over engines and "
                      "kv_cache_usage_perc_max the fullest engine. "
                      "generation_tokens_delta is compared with the sum of usage.completion_tokens of "
                      "all the level's requests (warm-up and drain included).",
    "client_self_check": "a heartbeat task sleeps 10 ms and records its oversleep (event-loop lag); "
                         "client CPU% = process CPU seconds / wall seconds over the window, per client "
                         "process. Verdict: ok below lag_p99_warn_ms and cpu_warn_pct; marginal (still "
                         "valid, with a warning naming the margin) up to lag_p99_limit_ms and "
                         "cpu_limit_pct; invalid above either limit: the client, not the server, may "
                         "have been the bottleneck.",
}
