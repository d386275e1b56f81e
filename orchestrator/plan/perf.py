"""The performance floor, pure: is a measurement far below what the manifest expects, and what
likely made it so. A service can pass every readiness gate and still decode at half its speed
(operators found "81 tok/s expected, 35 seen" by hand): a layout or backend change, a host's NCCL
setting, another vLLM. The measuring is probe/perf.py's; the plan step is plan/service.py's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from orchestrator.config.manifest import Manifest, Performance
from orchestrator.errors import DeployFailed
from orchestrator.host.records import ServiceRecord
from orchestrator.probe.perf import Measured


class BelowFloor(DeployFailed):
    """The service serves, but far below the throughput its manifest expects (on_below: fail)."""

    kind = "perf"


@dataclass(frozen=True)
class Shortfall:
    figure: str                 # "single stream", "32 streams"
    expected: float
    floor: float                # the least that is not "far below"
    measured: float | None      # None: it could not be measured

    def describe(self) -> str:
        got = f"{self.measured:.1f} tok/s" if self.measured is not None else "no figure"
        return f"{self.figure}: {got}, expected {self.expected:g} (far below under {self.floor:.1f})"


def shortfalls(perf: Performance, got: Measured) -> list[Shortfall]:
    """Each expected figure the measurement missed by more than the manifest's floor allows."""
    out = []
    if perf.single_stream_tok_s is not None:
        floor = perf.single_stream_tok_s * perf.floor
        if got.single_stream_tok_s is None or got.single_stream_tok_s < floor:
            out.append(Shortfall("single stream", perf.single_stream_tok_s, floor, got.single_stream_tok_s))
    if perf.concurrency is not None and perf.concurrency_tok_s is not None:
        floor = perf.concurrency_tok_s * perf.floor
        if got.concurrency_tok_s is None or got.concurrency_tok_s < floor:
            out.append(Shortfall(f"{perf.concurrency} streams", perf.concurrency_tok_s, floor, got.concurrency_tok_s))
    return out


def expected_text(perf: Performance) -> str:
    parts = []
    if perf.single_stream_tok_s is not None:
        parts.append(f"{perf.single_stream_tok_s:g} tok/s single stream")
    if perf.concurrency is not None:
        parts.append(f"{perf.concurrency_tok_s:g} tok/s at {perf.concurrency} streams")
    return " and ".join(parts)


def _flags(argv: Sequence[str]) -> set[str]:
    """The flags of an argv with their values, e.g. {'--kv-cache-dtype fp8', '--trust-remote-code'}."""
    out, i = set(), 0
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("-"):
            if "=" not in tok and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                out.add(f"{tok} {argv[i + 1]}")
                i += 1
            else:
                out.add(tok)
        i += 1
    return out


def likely_causes(m: Manifest, argv: Sequence[str], origins: Mapping[str, str],
                  vllm_version: str | None, previous: ServiceRecord | None) -> list[str]:
    """What most likely explains a shortfall, most specific first: what changed since the last
    good measurement of this model on this host (its service record), then layout and backends and
    where they come from, then the host's NCCL settings, then what no configuration shows."""
    causes = []
    prev_perf = (previous.perf if previous is not None else None) or {}
    if previous is not None and prev_perf.get("ok") and prev_perf.get("single_stream_tok_s"):
        since = f"since {prev_perf['single_stream_tok_s']} tok/s was measured ({previous.deployed_at or '?'})"
        before, now = _flags(previous.argv), _flags(argv)
        added, removed = sorted(now - before), sorted(before - now)
        if added or removed:
            causes.append(f"the vLLM command line changed {since}: "
                          + ", ".join([f"+{f}" for f in added] + [f"-{f}" for f in removed]))
        if previous.vllm_version and vllm_version and previous.vllm_version != vllm_version:
            causes.append(f"vLLM changed from {previous.vllm_version} to {vllm_version} {since}")
    v = m.vllm
    if v.decode_context_parallel_size > 1:
        causes.append(f"the layout: decode context parallel {v.decode_context_parallel_size} trades single-stream "
                      "speed for KV capacity (a layout without it decodes faster)")
    if v.pipeline_parallel_size > 1:
        causes.append(f"the layout: pipeline parallel {v.pipeline_parallel_size} adds a hop per token")
    for name in ("attention_backend", "moe_backend", "kv_cache_dtype"):
        origin = origins.get(f"vllm.{name}")
        if origin and not origin.startswith("requires.hardware"):
            causes.append(f"vllm.{name} {getattr(v, name)} comes from {origin}, not the manifest")
    if m.env.get("NCCL_P2P_DISABLE") == "1":
        where = origins.get("env.NCCL_P2P_DISABLE", "the manifest's env")
        causes.append(f"NCCL_P2P_DISABLE=1 ({where}) routes GPU traffic through host memory: better at high "
                      "concurrency, slower for a single stream")
    host_nccl = sorted(k for k, o in origins.items() if k.startswith("env.NCCL_") and not o.startswith("requires."))
    if host_nccl:
        causes.append("the host's NCCL settings (" + ", ".join(k[4:] for k in host_nccl) + ") differ from where "
                      "the expected figure was measured")
    causes.append("something no configuration shows: another process on the GPUs, a power or clock limit "
                  "(nvidia-smi -q -d PERFORMANCE,POWER), a PCIe link below its width (nvidia-smi -q -d PCIE)")
    return causes
