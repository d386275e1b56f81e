"""Version traps: combinations of flags that a given vLLM release accepts on the command line and
then dies of, after the download and usually after the whole load. The flag parser cannot see
them (each flag alone is fine), so preflight checks the rendered argv against this table and the
host's vLLM version before anything is downloaded.

Every row names the release that fixed it, the exact message the service dies with, what was
checked to establish the versions (the released wheels' source), and its public sources.
docs/preflight.md shows the table. Pure data and functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from orchestrator.plan.versions import version_key


def flag_value(argv: Sequence[str], *flags: str) -> str | None:
    """The value of the first of `flags` in argv (`--x v` or `--x=v`; `_` and `-` alike)."""
    for i, tok in enumerate(argv):
        key, eq, val = tok.partition("=")
        if key.replace("_", "-") in flags:
            if eq:
                return val
            return argv[i + 1] if i + 1 < len(argv) else None
    return None


def _int(value: str | None, default: int = 1) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def _fp8_kv(argv: Sequence[str]) -> str | None:
    dtype = flag_value(argv, "--kv-cache-dtype") or ""
    return f"--kv-cache-dtype {dtype}" if dtype.startswith("fp8") else None


def _fp8_kv_with_dcp(argv: Sequence[str]) -> list[str]:
    kv = _fp8_kv(argv)
    dcp = _int(flag_value(argv, "--decode-context-parallel-size", "-dcp"))
    return [kv, f"--decode-context-parallel-size {dcp}"] if kv and dcp > 1 else []


def _fp8_kv_with_triton_mla(argv: Sequence[str]) -> list[str]:
    kv = _fp8_kv(argv)
    backend = (flag_value(argv, "--attention-backend") or "").upper()
    return [kv, f"--attention-backend {backend}"] if kv and backend == "TRITON_MLA" else []


@dataclass(frozen=True)
class Trap:
    key: str
    what: str                                   # the combination, in words
    fixed_in: str                               # first vLLM release without the trap
    symptom: str                                # what the service prints when it dies
    when: str                                   # when in the start it strikes
    applies: Callable[[Sequence[str]], list[str]]   # argv -> the tokens that make the combination
    fields: tuple[str, ...]                     # the manifest fields involved
    fix: str
    evidence: str                               # how the versions were established
    sources: tuple[str, ...]                    # public references

    def hit(self, vllm_version: str | None, argv: Sequence[str]) -> list[str]:
        """The tokens that spring the trap on this version ([] when it does not apply)."""
        if not vllm_version or version_key(vllm_version) >= version_key(self.fixed_in):
            return []
        return self.applies(argv)


TRAPS: tuple[Trap, ...] = (
    Trap(
        key="dcp-fp8-kv",
        what="FP8 KV cache with decode context parallel (MLA models: Kimi-K2.x, DeepSeek-V3)",
        fixed_in="0.25.0",
        symptom='AssertionError: DCP not support fp8 kvcache now. (RuntimeError: Worker failed with '
                'error \'DCP not support fp8 kvcache now.\')',
        when="at the first decode step, after the whole load (36 min for Kimi-K2.5 INT4)",
        applies=_fp8_kv_with_dcp,
        fields=("vllm.kv_cache_dtype", "vllm.decode_context_parallel_size"),
        fix="run vLLM >= 0.25.0, or drop one of the two (kv_cache_dtype auto, or no decode context "
            "parallel), and set the manifest's min_vllm_version to 0.25.0",
        evidence="the assert is in vllm/model_executor/layers/attention/mla_attention.py of the 0.19.1 "
                 "and 0.24.0 wheels, and in neither 0.25.0, 0.32.0 nor 0.33.0",
        sources=("https://github.com/vllm-project/vllm/issues/32010",
                 "https://github.com/vllm-project/vllm/pull/44044")),
    Trap(
        key="triton-mla-fp8-kv",
        what="FP8 KV cache with the TRITON_MLA attention backend (the MLA backend of SM120 GPUs)",
        fixed_in="0.18.0",
        symptom='NotImplementedError: TritonMLA V1 with FP8 KV cache not yet supported',
        when="while the engine builds the model, after the download",
        applies=_fp8_kv_with_triton_mla,
        fields=("vllm.kv_cache_dtype", "vllm.attention_backend"),
        fix="run vLLM >= 0.18.0, or use kv_cache_dtype auto (bf16 KV: about 2.4x less context)",
        evidence="vllm/v1/attention/backends/mla/triton_mla.py raises it in the 0.17.1 wheel and lists "
                 "fp8 among its KV cache dtypes from 0.18.0",
        sources=("https://github.com/vllm-project/vllm/pull/34597",
                 "https://github.com/vllm-project/vllm/issues/35577")),
)


def springs(vllm_version: str | None, argv: Sequence[str]) -> list[tuple[Trap, list[str]]]:
    """The traps this argv walks into on this vLLM version, with the tokens responsible."""
    out = []
    for trap in TRAPS:
        tokens = trap.hit(vllm_version, argv)
        if tokens:
            out.append((trap, tokens))
    return out
