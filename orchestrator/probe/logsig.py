"""Reading vLLM's start-up log: fatal signatures (the messages users report, e.g. vllm-project/vllm#18538
unrecognized arguments, #49804 flashinfer mismatch, #20305 GPU memory held by another process) and
progress markers. Pure functions over lines; the readiness gate feeds them the service log as it grows."""

from __future__ import annotations

import re
from dataclasses import dataclass

from orchestrator.fmt import printable


@dataclass(frozen=True)
class Signature:
    key: str
    pattern: re.Pattern
    meaning: str
    fix: str


def _sig(key: str, pattern: str, meaning: str, fix: str) -> Signature:
    return Signature(key, re.compile(pattern), meaning, fix)


# Order matters: the first match on a line wins; root causes before generic wrappers.
FATAL: list[Signature] = [
    _sig("unrecognized-arguments", r"error: unrecognized arguments: ",
         "the installed vLLM does not accept a flag (removed or misspelt)",
         "remove or rename the flag in the manifest; `vllm-orch check MODEL --host H` validates flags "
         "with the host's own vLLM before anything is downloaded"),
    _sig("argparse", r"vllm[^:]*: error: (argument |invalid )",
         "vLLM rejected an argument value", "fix the value in the manifest (see the message)"),
    _sig("flashinfer-mismatch", r"flashinfer-cubin version \(.*\) does not match flashinfer version",
         "flashinfer-python and flashinfer-cubin are at different versions",
         "install the same version of both packages in the vLLM venv (pip install "
         "flashinfer-python==X flashinfer-cubin==X)"),
    _sig("gpu-memory-busy", r"Free memory on device .* is less than desired GPU memory utilization",
         "other processes (often leftover VLLM::Worker processes) hold GPU memory",
         "free the GPUs (`vllm-orch deploy` kills leftover vLLM workers) or lower gpu_memory_utilization"),
    _sig("trust-remote-code",
         r"contains custom code which must be executed|pass the argument `?trust_remote_code=True`? to allow",
         "the model needs --trust-remote-code", "set vllm.trust_remote_code: true in the manifest"),
    _sig("cuda-oom", r"(torch\.(cuda\.)?OutOfMemoryError|CUDA out of memory)",
         "the GPUs ran out of memory", "lower gpu_memory_utilization, max_model_len or max_num_batched_tokens"),
    _sig("no-kv-memory", r"No available memory for the cache blocks",
         "weights and activations left no room for the KV cache",
         "raise gpu_memory_utilization or use more GPUs / fp8 KV cache"),
    # vLLM's own wording, checked on the real server (the CPU build): "the model's" in 0.32, "the
    # models's" in older releases.
    _sig("kv-cache-below-max-len", r"To serve at least one request with the models?'s max seq len",
         "the KV cache cannot hold one request of max_model_len tokens",
         "lower vllm.max_model_len, or give the KV cache more memory (gpu_memory_utilization, fp8 KV cache)"),
    _sig("max-model-len-too-long", r"User-specified max_model_len \(\d+\) is greater than the derived max_model_len",
         "max_model_len is longer than the model supports (max_position_embeddings)",
         "lower vllm.max_model_len to the model's limit (the message names it)"),
    _sig("nccl-calloc", r"NCCL error: Failed to CUDA calloc",
         "NCCL could not allocate (NCCL graph XML with gpu-util 0.95)", "lower gpu_memory_utilization to <= 0.93"),
    _sig("no-attention-backend", r"No valid attention backend found",
         "no attention kernel for this GPU and attention type", "choose vllm.attention_backend (e.g. TRITON_MLA on SM120)"),
    _sig("deepgemm-sm120", r"deepgemm/csrc/apis/layout\.hpp:\d+\): Unknown SF transformation",
         "DeepGEMM does not support this checkpoint on SM120", "set env VLLM_USE_DEEP_GEMM=0 and VLLM_MOE_USE_DEEP_GEMM=0"),
    _sig("flashinfer-jit", r"CalledProcessError: Command '\['ninja'.*flashinfer",
         "FlashInfer's JIT build failed (on SM120 needs CUDA toolkit >= 12.9)",
         "install a matching CUDA toolkit or prebuilt flashinfer kernels"),
    _sig("dcp-fp8-kv", r"DCP not support fp8 kvcache",
         "this vLLM (< 0.25.0) cannot decode with FP8 KV cache and decode context parallel together "
         "(vllm-project/vllm#32010)",
         "run vLLM >= 0.25.0, or set kv_cache_dtype auto or decode_context_parallel_size 1; preflight's "
         "version-traps check refuses this combination before the download"),
    _sig("triton-mla-fp8-kv", r"TritonMLA V1 with FP8 KV cache not yet supported",
         "this vLLM (< 0.18.0) has no FP8 KV cache in the TRITON_MLA backend (vllm-project/vllm#34597)",
         "run vLLM >= 0.18.0 or set kv_cache_dtype auto"),
    _sig("nan-probability", r"probability tensor contains either `?inf`?, `?nan`? or element < 0",
         "NaN in sampling (flashinfer FP4 MoE race on SM120)", "use vllm.moe_backend: marlin"),
    # Multi-node (vLLM's own runtime over torch.distributed): the ranks meet in rank 0's TCPStore on
    # --master-port; DP engines handshake with the head on --data-parallel-rpc-port. torch's
    # messages (socket.cpp / TCPStore.cpp / gloo's pair.cc) and vLLM's (v1/engine/core.py).
    _sig("head-unreachable",
         r"The client socket has timed out after \d+ms while trying to connect to \(",
         "this node's ranks never reached the head's rendezvous (--master-addr:--master-port) within "
         "the process group timeout",
         "check that the head is up and that this node can reach its cluster address and master port "
         "(firewall, route, NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME naming the right NIC)"),
    _sig("join-timeout", r"Timed out after \d+ seconds waiting for clients\. \d+/\d+ clients joined",
         "the head waited for every rank and some never joined (a node not started, or unable to "
         "reach the head)", "start every node (workers before or with the head) and check the nodes "
         "not reported as joined; their logs name the cause"),
    _sig("collective-timeout", r"Watchdog caught collective operation timeout: WorkNCCL\(",
         "a rank waited in an NCCL collective longer than the process group's timeout "
         "(--distributed-timeout-seconds) and torch's watchdog aborted it: a peer was still loading or "
         "compiling, or hung", "give multinode.collective_timeout_seconds (or loading.other_seconds) at "
         "least the slowest node's compile time; read the other nodes' logs"),
    _sig("dp-handshake-timeout", r"Did not receive response from front-end process within \d+ minutes",
         "this node's data-parallel engines got no answer from the head's --data-parallel-address:"
         "--data-parallel-rpc-port", "start the head, and check that this node reaches that address and port"),
    _sig("weights-mismatch", r"Attempted to load weight \(.*\) into parameter \(",
         "the checkpoint's tensor shapes do not match the model (on a multi-node service: this node "
         "holds another revision of the weights)",
         "download the manifest's revision on every node (the deploy verifies the files are identical "
         "before any start)"),
    _sig("peer-closed", r"Connection closed by peer \[",
         "a rank on another node of this service died or went away (its node's log has the root cause)",
         "read the other nodes' logs; restart the service on every node"),
    _sig("head-gone", r"Failed to recv, got 0 bytes\. Connection was likely closed",
         "the head of this multi-node service died or went away", "read the head's log; restart the service "
         "on every node"),
    _sig("cuda-error", r"CUDA error: (an illegal memory access|unspecified launch failure)",
         "a GPU kernel faulted on this rank", "read the traceback; check the GPU with nvidia-smi "
         "(Xid errors in the kernel log) and restart"),
    _sig("engine-core-failed", r"Engine core initialization failed|EngineCore failed to start",
         "the engine failed to start (the root cause is earlier in the log)", "read the log lines above"),
]

# A rank that joined the service's torch.distributed world: each worker logs it once its process
# group exists, i.e. once every rank reached the head's store (vllm/distributed/parallel_state.py,
# initialize_model_parallel). vllm-orch's own join wait reads it on every node.
JOINED = re.compile(r"rank \d+ in world size \d+ is assigned as ")

# Lines that show loading progress (for the live view); (regex, phase label).
PROGRESS: list[tuple[re.Pattern, str]] = [
    # "took" first: "Loading weights took" also matches the loading pattern (vLLM's CPU build logs
    # no "Model loading took", so that line alone marks the end of loading there).
    (re.compile(r"Loading weights took|Model loading took"), "weights loaded"),
    (re.compile(r"Loading (safetensors checkpoint shards|weights)"), "loading weights"),
    (re.compile(r"torch\.compile (takes|took)|Compiling a graph"), "compiling"),
    # "GPU KV cache size" on GPUs; vLLM's CPU build logs "CPU KV cache size" (kv_cache_utils.py).
    (re.compile(r"[GC]PU KV cache size|Available KV cache memory"), "KV cache"),
    (re.compile(r"Capturing CUDA graph|Graph capturing finished"), "CUDA graphs"),
    (re.compile(r"Starting vLLM (API )?server"), "starting API server"),
    (re.compile(r"Application startup complete"), "API server up"),
]

# The start-up ledger: vLLM 0.33's own figures in its start-up lines (each source line named), by phase.
LEDGER: list[tuple[str, re.Pattern]] = [
    # model_executor/model_loader/weight_utils.py:538 (a start that downloads itself; vllm-orch's
    # own download is the run's `download` step)
    ("download_s", re.compile(r"Time spent downloading weights for .*: ([\d.]+) seconds")),
    ("weights_s", re.compile(r"Loading weights took ([\d.]+) seconds")),           # default_loader.py:507
    ("model_load_s", re.compile(r"Model loading took [\d.]+ GiB memory and ([\d.]+) seconds")),   # gpu_model_runner.py:5089
    ("compile_s", re.compile(r"torch\.compile took ([\d.]+) s in total")),          # compilation/monitor.py:62
    ("graphs_s", re.compile(r"Graph capturing finished in ([\d.]+) secs")),         # gpu_model_runner.py:6517
    # the CUDA-graph pool that capture took, per GPU: a sleeping worker keeps it on the GPU unless
    # --sleep-mode-offload-cudagraph (config/model.py sleep_mode_offload_cudagraph, default False)
    ("graphs_gib", re.compile(r"Graph capturing finished in [\d.]+ secs, took ([\d.]+) GiB")),
    ("init_engine_s", re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")),  # core.py:413
]


def clean(line: str) -> str:
    """A log line as it is matched and shown: the one sanitiser (`fmt.printable`: colours and every
    other escape sequence removed, control characters shown as `\\x1b`), trailing space dropped."""
    return printable(line.rstrip()).rstrip()


def fatal_in(line: str) -> Signature | None:
    line = clean(line)
    for sig in FATAL:
        if sig.pattern.search(line):
            return sig
    return None


def ledger(lines: list[str]) -> dict[str, float]:
    """vLLM's own start-up figures (LEDGER) from its log lines, the last of each (a worker's line
    is printed by every rank: they agree within a rounding)."""
    out: dict[str, float] = {}
    for line in lines:
        for key, pattern in LEDGER:
            m = pattern.search(line)
            if m:
                out[key] = float(m.group(1))
    return out


def phase_of(line: str) -> str | None:
    for pattern, label in PROGRESS:
        if pattern.search(line):
            return label
    return None


def root_cause(lines: list[str]) -> tuple[Signature | None, str | None]:
    """The most specific fatal signature in a log (root causes beat the generic wrapper)."""
    found: list[tuple[int, Signature, str]] = []
    for line in lines:
        sig = fatal_in(line)
        if sig:
            found.append((FATAL.index(sig), sig, clean(line)))
    if not found:
        return None, None
    _, sig, line = min(found, key=lambda t: t[0])
    return sig, line
