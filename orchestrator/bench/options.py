"""BenchOptions: every knob of a benchmark run, with defaults that are safe for real deployments."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128)

# Client self-check thresholds: past either, the client (not the server) may be the bottleneck and
# the level is marked invalid. Loop lag is the oversleep of a 10 ms heartbeat; it includes asyncio's
# 1 ms timer granularity and the OS wake-up latency, which reached 4-7 ms at p99 on an idle 2-vCPU
# VM, so 5 ms (the natural first guess) would flag idle clients: 10 ms (one inter-token gap of a
# 100 tok/s stream) is the limit. 80% of one core leaves headroom for bursts. Judgement calls both.
LAG_P99_LIMIT_MS = 10.0
CPU_LIMIT_PCT = 80.0


@dataclass
class BenchOptions:
    concurrency: list[int] = field(default_factory=lambda: list(DEFAULT_LEVELS))
    max_tokens: int = 512
    ignore_eos: bool = True            # vLLM extension: generate exactly max_tokens
    min_tokens: int | None = None      # vLLM extension; None: not sent
    temperature: float = 0.0
    input_tokens: int = 256            # approximate prompt length (built-in prompts)
    prompts_file: Path | None = None   # one prompt per line instead of the built-in set
    warmup_s: float = 10.0             # per level, before the measurement window opens
    warmup_requests: int = 0           # ... and at least this many requests completed
    duration_s: float = 60.0           # the window lasts at least this long ...
    min_requests: int | None = None    # ... and until this many window requests completed
    timeout_s: float = 600.0           # per request
    max_level_s: float = 3600.0        # hard cap per level (warm-up + window), then drain
    continuous_usage: bool = True      # stream_options.continuous_usage_stats: exact tokens per chunk
    extra_body: dict = field(default_factory=dict)
    api_key: str | None = None
    label: str = ""
    seed: int = 0
    save_chunks: bool = False          # per-request chunk arrival times in the JSONL
    scrape_metrics: bool = True
    metrics_interval_s: float = 5.0
    processes: int = 1                 # 0: auto (one process per 256 streams)
    lag_p99_limit_ms: float = LAG_P99_LIMIT_MS
    cpu_limit_pct: float = CPU_LIMIT_PCT

    def window_min_requests(self, concurrency: int) -> int:
        """Requests a level must complete inside its window: default max(20, 2 x C)."""
        return self.min_requests if self.min_requests is not None else max(20, 2 * concurrency)

    def processes_for(self, concurrency: int) -> int:
        if self.processes > 0:
            return min(self.processes, concurrency)
        return max(1, min(concurrency, -(-concurrency // 256)))

    def to_json(self) -> dict:
        d = asdict(self)
        d["prompts_file"] = str(self.prompts_file) if self.prompts_file else None
        d["api_key"] = "***" if self.api_key else None
        return d
