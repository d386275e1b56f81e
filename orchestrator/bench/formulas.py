"""The definitions behind every number, written verbatim into each result file and docs/benchmarking.md.

Names follow vLLM/AIPerf usage (TTFT, TPOT, ITL, ICL) - not guidellm's, whose "TPOT" includes the
first token and whose "ITL" is what we call TPOT (guidellm's docs/guides/metrics.md; the confusion
costs users: vllm-project/vllm#6531, "inter-token latency is lower than TPOT").
"""

from __future__ import annotations

from orchestrator.bench.stats import PERCENTILE_METHOD

SCHEMA = "vllm-orch.bench.result/1"

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
    "queue_ms": "t_send - t_ready: from the moment the worker was free to send (its previous request "
                "ended) to the request's first byte written, including any reconnect.",
    "ttfb_ms": "first response byte - t_send.",
    "ttft_ms": "first token-bearing chunk - t_send (reasoning and tool calls count as tokens).",
    "ttfc_ms": "time to first content: first chunk with non-empty delta.content (or tool_calls) - "
               "t_send; equals TTFT for non-reasoning answers, null if no content came.",
    "e2e_ms": "last token-bearing chunk - t_send (not [DONE] nor the usage chunk).",
    "e2e_incl_queue_ms": "last token-bearing chunk - t_ready (latency including client queueing).",
    "tpot_ms": "(e2e - ttft) / (completion_tokens - 1), per request; null when completion_tokens < 2.",
    "tok_s_user": "per request 1000 / tpot_ms (decode rate seen by one user, excludes TTFT); the level "
                  "reports the median over window requests.",
    "tok_s_e2e": "per request completion_tokens / e2e (includes TTFT); level reports the median.",
    "itl_ms": "inter-token latency from tokens, not chunks: each gap between consecutive token-"
              "bearing chunks divided by the tokens of the later chunk, weighted by those tokens, "
              "pooled over the window requests (token-weighted).",
    "icl_ms": "inter-chunk latency: the raw gaps between consecutive token-bearing chunks, pooled.",
    "load_model": "closed loop: C workers, each with its own keep-alive connection, send the next "
                  "request as soon as the previous one ends. Warm-up lasts >= warmup_s and >= "
                  "warmup_requests completions; the window then lasts >= duration_s and until >= "
                  "min_requests window requests completed (default max(20, 2*C)); then no new "
                  "requests are sent and in-flight ones drain.",
    "window_requests": "requests sent inside [window start, window end); all latency statistics and "
                       "error counts of a level are over these.",
    "output_tok_s": "steady-state aggregate output throughput: tokens of token-bearing chunks that "
                    "arrived inside [window start, window end], from any successful request "
                    "(warm-up ones included), / window seconds. Warm-up ramp and drain tail excluded.",
    "output_tok_s_se": "standard error of output_tok_s: the window is cut into 5 equal slices, SE = "
                       "std(slice rates) / sqrt(5). Used by `bench compare` as the noise estimate.",
    "requests_per_s": "successful requests whose last token arrived inside the window / window seconds.",
    "errors": "by kind, over window requests: http_<status>, stream_error (an error event or "
              "unparseable data in the stream), timeout, empty (no generated token), disconnect "
              "(connection closed mid-stream), connect.",
    "percentiles": PERCENTILE_METHOD + "; every summary carries its sample count n, and "
                   "p99_low_n=true when n < 100 (the p99 is then close to the max).",
    "server_metrics": "/metrics scraped before and after each level (counters: after - before) and "
                      "every metrics_interval_s during the window (gauges: mean and max). vLLM's "
                      "per-engine series (one per DP rank) combine as in status: requests and "
                      "counters are sums, kv_cache_usage_perc is the mean over engines and "
                      "kv_cache_usage_perc_max the fullest engine. "
                      "generation_tokens_delta is compared with the sum of usage.completion_tokens of "
                      "all the level's requests (warm-up and drain included).",
    "client_self_check": "a heartbeat task sleeps 10 ms and records its oversleep (event-loop lag); "
                         "client CPU% = process CPU seconds / wall seconds over the window. A level is "
                         "invalid when loop-lag p99 > lag_p99_limit_ms or CPU% > cpu_limit_pct (per "
                         "client process): the client, not the server, may have been the bottleneck.",
}
