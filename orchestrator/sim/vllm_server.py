#!/usr/bin/env python3
"""SIMULATED vLLM 0.33 OpenAI-compatible server (`vllm serve`), for hosts without a GPU.

Installed as `<hostdir>/bin/vllm`; finds its host folder as the parent of its own folder
(`VLLM_SIM_HOST_DIR` overrides, for tests). Self-contained, stdlib only, Python >= 3.9, so it also
runs inside minimal Debian containers. It behaves like vLLM 0.33 wherever the orchestrator can see:

- argv: the real flag set of vLLM 0.33.0 (extracted from the 0.33.0 wheel's engine/arg_utils.py and
  entrypoints/common/cli_args.py), parsed with argparse the way FlexibleArgumentParser does
  (`--x_y` == `--x-y`, `--json-arg.key value`, `--model X`, `-O3`, --enable-x/--disable-x pairs).
  Removed flags (--enable-reasoning, --swap-space, --guided-decoding-backend,
  --disable-log-requests) fail with argparse's own `vllm: error: unrecognized arguments: ...`, exit 2.
- start-up: the real log lines and prefixes of 0.33 (`(APIServer pid=N) INFO 11-29 09:05:12
  [entry.py:139] Starting vLLM server on http://...`); the port is bound but not listening while
  loading (connects are refused), then uvicorn's "Application startup complete.".
- processes: vLLM's titles (see Launch.start_engine): one GPU worker per rank
  (`VLLM::Worker[_DP<d>][_TP<t>][_EP<e>]`, or `VLLM::EngineCore` alone at world size 1), engine
  cores `VLLM::EngineCore[_DP<d>]`, and with data parallelism `VLLM::DPCoordinator` and
  `VLLM::APIServer_<i>`. GPU holders are registered in `<hostdir>/gpu-procs/`, which the fake
  nvidia-smi reads. Workers outlive a SIGKILLed server and keep "holding" memory; a SIGTERMed
  server stops them. A start fails with the real "Free memory on device ..." error when other live
  holders leave too little memory.
- serving: /health, /v1/models, /version, /metrics, /tokenize, /detokenize, /v1/chat/completions
  (stream or not), /v1/completions, with per-model token rates (PROFILES below) paced on an
  absolute schedule; a DP-N service runs N engines (own queue, KV cache and metrics series `engine="0".."N-1"`).
- auth: with --api-key / VLLM_API_KEY, /v1/* answers 401 `{"error":"Unauthorized"}` without the
  key, exactly as vLLM's middleware does; /health, /metrics and /version stay open.
- shutdown: SIGTERM with `--shutdown-timeout N` (N > 0) drains: requests in flight finish (new
  ones are refused) for up to N s, then the engine and workers stop; N = 0 aborts them. vLLM 0.33's
  `[shutdown]` log lines. A GPU worker that dies on its own (e.g. SIGTERMed by a KillMode=control-
  group stop while the server drains) kills the engine like vLLM's worker monitor: requests in
  flight fail, /health answers 503 and the server exits.
- torch.compile cache: under VLLM_CACHE_ROOT (else $XDG_CACHE_HOME/vllm, else ~/.cache/vllm) per
  configuration; a start that finds it logs vLLM's "Directly load the compiled graph(s) ... from
  the cache" and compiles in a fifth of the time.
- multi-node (see MULTINODE_LINES for every line and its source): TP/PP across nodes
  (--nnodes/--node-rank/--master-addr/--master-port, --headless on ranks > 0): the head's rank 0
  listens on --master-port like torch's TCPStore, headless ranks connect with retries up to the
  process group timeout (--distributed-timeout-seconds, else VLLM_SIM_JOIN_TIMEOUT_S, else 600 s),
  the head loads only when all joined and serves only when every node loaded; DP across nodes
  (--data-parallel-size-local/-start-rank/-address/-rpc-port, --headless): remote engine cores
  handshake with the head's front end. A node that goes away while they join or load takes the
  others down with torch's / gloo's lines. Once serving (TP/PP), as the real vLLM does: the head
  does not notice a lost node while idle (/health 200); its next request fails (TP: HTTP 500 at once,
  PP: after VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS) and the head exits; a headless node outlives its
  head, silent, until stopped. Headless nodes never serve HTTP.
- sleep mode (see Sleeper): with VLLM_SERVER_DEV_MODE=1 the development routes (DEV_ROUTES, outside
  the API key) and /sleep, /wake_up, /is_sleeping with 0.33's parameters, answers and log lines; a
  sleep frees each GPU but for its CUDA context (level 1 keeps the weights in host RAM), a wake
  takes the weights back at the host-to-device rate (level 1) or from the page cache and disk
  (level 2) and fails while another process holds the memory; without --enable-sleep-mode it frees
  nothing. Faults wake-fails, wake-corrupt and vram-leak are consumed by the endpoint they hit.
- faults from `<hostdir>/faults.json`, consumed at start (see FAULTS); an entry with `times: N`
  fires at N starts (a failure that comes back at every restart). Each fault that takes effect is
  logged to `<hostdir>/logs/faults-fired.jsonl` (what, PID, when) for tests and benchmarks.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HOST_DIR = Path(os.environ.get("VLLM_SIM_HOST_DIR") or Path(__file__).resolve().parent.parent)
GiB = 1 << 30
MiB = 1 << 20
LOAD_BYTES_PER_S = 253e6     # field report: 547 GB loaded in 36 min at speed 1
# The 36 min as the simulator splits them: 80% reading the weights from disk (DISK_BYTES_PER_S),
# then torch.compile and CUDA graph capture 10% each. Weights in the page cache load at
# CACHE_BYTES_PER_S: safetensors' mmap path from the page cache measures ~4 GB/s
# (scitix/InstantTensor#1). All rates are multiplied by the host's speed.
DISK_BYTES_PER_S = LOAD_BYTES_PER_S / 0.8
CACHE_BYTES_PER_S = 4e9
CPU_BYTES_PER_WORKER = 12 << 30   # CPU memory of one GPU worker (inventory default cpu_memory_per_gpu_gib)
CUDA_CONTEXT_MIB = 530       # what a process holds right after CUDA init
GRAPH_POOL_MIB = 532         # what CUDA graph capture takes per GPU ("... took 0.52 GiB")
NCCL_BUFFERS_MIB = 256       # NCCL's (and the custom all-reduce's) buffers of a multi-GPU worker


def _read_json(path: Path, default):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


SIM = _read_json(HOST_DIR / "sim.json", {})
# A simulated engine venv (orchestrator/sim/engines.py) runs this server as its own version, with its
# own packages; otherwise the host's vLLM is the version in sim.json, its packages the host folder's.
ENGINE_VERSION = os.environ.get("VLLM_SIM_VLLM_VERSION")
VERSION = ENGINE_VERSION or str(SIM.get("vllm_version", "0.33.0"))
FINGERPRINT = f"vllm-{VERSION}-{random.getrandbits(32):08x}"   # "vllm-<version>-<8 hex>", per server


def version_before(version: str, release: str) -> bool:
    """version < release, release parts only (0.24.0+cu130 < 0.25.0; an rc counts as its release)."""
    def parts(v):
        return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])
    return parts(version) < parts(release)

SCALE = max(1, int(SIM.get("scale") or 1))     # the host's files are 1/SCALE of the real sizes

# --------------------------------------------------------------------------------------------
# Per-layout profiles. `agg` is the aggregate decode rate (tokens/s summed over streams) at a given
# number of concurrent streams; between points it is interpolated linearly in log2(C), beyond the
# last point it stays flat (saturation). A stream's rate is agg(C) / C. `source` says where each
# figure comes from: public pages only (the rtx6kpro wiki, vLLM recipes, issue threads); points no
# public page gives are marked as chosen (smooth curves between the cited ones).
# size: real checkpoint bytes (used when the model folder has no model.safetensors.index.json);
# kv_per_gib: KV tokens per GiB of KV memory per GPU at bf16 (fp8 doubles it; DCP multiplies it),
# calibrated on the rtx6kpro logs (MiniMax TP4: 23.62 GiB -> 399,424 tokens; Kimi fp8: ~449,600).
RTX6KPRO_KIMI = "https://github.com/voipmonitor/rtx6kpro/blob/main/models/kimi-k25.md"
RTX6KPRO_MINIMAX = "https://github.com/voipmonitor/rtx6kpro/blob/main/models/minimax-m25.md"
PROFILES: dict[str, dict[str, Any]] = {
    "kimi-k25-int4": {
        "layers": 61, "size": 547e9, "arch": "KimiK25ForConditionalGeneration", "max_len": 262144,
        "kv_per_gib": 10200, "prefill": 9000.0, "custom_code": True,
        "source": "C=1: 79 tok/s, TP8 DCP1 FP8 KV Triton MLA on 8x RTX PRO 6000 (" + RTX6KPRO_KIMI
                  + ", 'Peak decode tok/s by backend'); C>=2: chosen, saturating near 1500",
        "agg": [(1, 79.0), (2, 146), (4, 265), (8, 440), (16, 675), (32, 940), (64, 1230),
                (128, 1480)]},
    "kimi-k25-int4-dcp8": {
        "layers": 61, "size": 547e9, "arch": "KimiK25ForConditionalGeneration", "max_len": 262144,
        "kv_per_gib": 10200, "prefill": 8000.0, "custom_code": True,
        "source": "C=1: 62 tok/s, single batch at 0K context, FP8 KV, DCP 8, normal NCCL (Grimulkan, "
                  + RTX6KPRO_KIMI + ", 'Single-batch decode speed'); C=100: 900 tok/s total (Festr, "
                  "same page, 'High concurrency', 40K-token contexts); between: chosen",
        "agg": [(1, 62.0), (2, 115), (4, 205), (8, 335), (16, 495), (32, 660), (64, 800),
                (100, 900)]},
    "kimi-k25-nvfp4": {
        "layers": 61, "size": 540e9, "arch": "KimiK25ForConditionalGeneration", "max_len": 262144,
        "kv_per_gib": 10200, "prefill": 8000.0, "custom_code": True,
        "source": "chosen: 61.3 / 800 / 1238 tok/s at C=1/32/128 (the benchmark calibration in "
                  "docs/benchmarking.md is pinned to them); the public figure is 53-55 tok/s "
                  "single stream for this checkpoint on SGLang (" + RTX6KPRO_KIMI + ")",
        "agg": [(1, 61.3), (2, 116), (4, 215), (8, 370), (16, 570), (32, 800), (64, 1040),
                (128, 1238)]},
    "minimax-m25-ep": {
        "layers": 62, "size": 230e9, "arch": "MiniMaxM2ForCausalLM", "max_len": 196608,
        "kv_per_gib": 16910, "prefill": 20000.0, "custom_code": True,
        "source": "C=1: 84 tok/s, near the public ~86 tok/s of FP8 on 8 GPUs with EP and tuned MoE "
                  "kernels (SGLang, " + RTX6KPRO_MINIMAX + "); C=128: 4000 tok/s, chosen below the "
                  "page's 5,000-10,000 tok/s high-concurrency figures; between: chosen",
        "agg": [(1, 84.0), (2, 162), (4, 310), (8, 580), (16, 1050), (32, 1800), (64, 2900),
                (128, 4000)]},
    "minimax-m25": {
        "layers": 62, "size": 230e9, "arch": "MiniMaxM2ForCausalLM", "max_len": 196608,
        "kv_per_gib": 16910, "prefill": 20000.0, "custom_code": True,
        "source": "chosen: 84 tok/s single stream (the public TP4 figure is ~71 tok/s on SGLang, "
                  + RTX6KPRO_MINIMAX + "), saturating at 2500 tok/s without expert parallel",
        "agg": [(1, 84.0), (2, 158), (4, 290), (8, 500), (16, 820), (32, 1250), (64, 1850),
                (128, 2500)]},
    "generic": {
        "layers": 32, "size": 16e9, "arch": "LlamaForCausalLM", "max_len": 32768,
        "kv_per_gib": 8000, "prefill": 20000.0, "custom_code": False,
        "source": "chosen: a small dense model on one GPU",
        "agg": [(1, 100.0), (8, 650), (32, 1800), (128, 3200)]},
}
SLOW_DECODE = 35 / 81     # the `slow-decode` fault: "81 tok/s expected, 35 seen"


def pick_profile(name_or_path: str, expert_parallel: bool, dcp: int = 1) -> str:
    """Profile key from a repo id / config `_name_or_path` (e.g. 'nvidia/Kimi-K2.5-NVFP4') and the
    layout (decode context parallel costs Kimi INT4 single-stream speed)."""
    n = name_or_path.lower()
    if "kimi" in n:
        if "nvfp4" in n:
            return "kimi-k25-nvfp4"
        return "kimi-k25-int4-dcp8" if dcp > 1 else "kimi-k25-int4"
    if "minimax" in n:
        return "minimax-m25-ep" if expert_parallel else "minimax-m25"
    return "generic"


def aggregate_rate(profile: dict, concurrency: int) -> float:
    pts = profile["agg"]
    c = max(1, concurrency)
    if c <= pts[0][0]:
        return pts[0][1] * c / pts[0][0]
    for (c0, r0), (c1, r1) in zip(pts, pts[1:]):
        if c <= c1:
            f = (math.log2(c) - math.log2(c0)) / (math.log2(c1) - math.log2(c0))
            return r0 + f * (r1 - r0)
    return pts[-1][1]


def stream_rate(profile: dict, concurrency: int) -> float:
    return aggregate_rate(profile, concurrency) / max(1, concurrency)


# --------------------------------------------------------------------------------------------
# Faults (consumed from faults.json at start; `model` null matches any model).
FAULTS = {
    "crash-flashinfer": "flashinfer / flashinfer-cubin version mismatch RuntimeError after some loading",
    "crash-gpu-memory": "'Free memory on device cuda:0 ... less than desired GPU memory utilization'",
    "crash-unrecognized-args": "argparse 'vllm: error: unrecognized arguments: ...', exit 2",
    "crash-trust-remote-code": "'... contains custom code which must be executed ...' ValueError",
    "hang": "stops logging part-way through loading weights and stays alive (NCCL-hang look-alike)",
    "hang-after-ready": "serves, then (after `after` s, default 5; or once the file `trigger` names exists) "
                        "the engine stops making progress: "
                        "/health stays 200, requests never finish, /metrics stays as the last step left "
                        "it (an NCCL deadlock after deploy)",
    "crash-no-kv-memory": "'No available memory for the cache blocks' at the end of the load (KV OOM)",
    "die-after-ready": "engine core dies a few seconds after the server became ready",
    "garbage": "serves random junk tokens instead of sensible answers",
    "slow-start": "loading takes 5x longer (`factor`, default 5)",
    "slow-decode": "decodes at 35/81 of the layout's rate (a layout or backend change, a bad NCCL "
                   "setting: '81 tok/s expected, 35 seen')",
    "unreachable-head": "multi-node: this node's ranks cannot reach the head (--master-addr or "
                        "--data-parallel-address): they retry, then fail with torch's 'The client "
                        "socket has timed out after ...ms' (DP: 'Did not receive response from "
                        "front-end process within 5 minutes')",
    "rank-crash-loading": "multi-node: a rank on this node crashes while loading weights (CUDA "
                          "illegal memory access); the other nodes die with it",
    "wrong-revision": "multi-node: this node holds another revision of the weights: loading fails "
                      "with 'Attempted to load weight (...) into parameter (...)'; the others die",
    "slow-compile": "multi-node: this node's torch.compile takes `seconds` (default 30) longer (a cold "
                    "compile cache): the other nodes' ranks wait for it in a collective, which torch "
                    "aborts after --distributed-timeout-seconds (else 600 s)",
    # sleep mode (consumed at /sleep or /wake_up, not at start: see SLEEP_FAULTS)
    "wake-corrupt": "the next /wake_up succeeds but the engine answers junk afterwards (corrupted "
                    "weights after a wake, seen in the field)",
    "wake-fails": "the next /wake_up fails: HTTP 500, the engine stays asleep (a CUDA error while "
                  "remapping its memory)",
    "vram-leak": "from the next /sleep on, every sleep leaves `mib` (default 2048) MiB more per GPU "
                 "behind than the CUDA context (vllm issue #36651: memory grows over sleep/wake cycles)",
}
# Faults of a live process's sleep and wake: consumed by the endpoint that fires them.
SLEEP_FAULTS = ("wake-corrupt", "wake-fails", "vram-leak")


def fault_fired(fault: str, **extra) -> None:
    """Note a fault taking effect (tests and benchmarks measure from it; vLLM itself logs nothing)."""
    try:
        (HOST_DIR / "logs").mkdir(parents=True, exist_ok=True)
        with open(HOST_DIR / "logs" / "faults-fired.jsonl", "a") as f:
            f.write(json.dumps(dict({"fault": fault, "pid": os.getpid(), "at": time.time()}, **extra)) + "\n")
    except OSError:
        pass


def _write_whole(path: Path, text: str) -> None:
    """Replace a shared file atomically; as the service user of a systemd SIMULATED host, whose
    folder is root's (orchestrator/sim/manager.py), rewrite it in place (the caller holds its lock)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(str(tmp), str(path))
    except PermissionError:
        with open(str(path), "r+") as f:
            f.write(text)
            f.truncate()


# Where vllm-orch keeps its records on the simulated hosts: a process host's folder, a container's default.
STATE_DIRS = (HOST_DIR / "state", Path("/var/lib/vllm-orch/state"))


def own_service(argv: list) -> dict:
    """The installed record (installed/NAME.json) of the service this server is, proven, not guessed
    from a shared value: under systemd its own cgroup names the unit (vllm-NAME.service); on a
    process host the start script vllm-orch installed for it execs exactly this argv (`set -- ...`).
    Services of one checkpoint share its weights folder, and during a swap two services name one
    port, so neither tells them apart. {} when no record proves it (a server started by hand)."""
    try:
        cgroup = Path("/proc/self/cgroup").read_text()
    except OSError:
        cgroup = ""
    unit = re.search(r"/(vllm-[^/\s]+\.service)\s*$", cgroup, re.M)
    same_argv = []
    for folder in STATE_DIRS:
        try:
            records = sorted((folder / "installed").glob("*.json"))
        except OSError:
            continue
        for path in records:
            rec = _read_json(path, {})
            if not isinstance(rec, dict) or not isinstance(rec.get("unit"), str):
                continue
            if unit:
                if Path(rec["unit"]).name == unit.group(1):
                    return rec
            elif rec["unit"].endswith(".sh") and _script_argv(Path(rec["unit"]))[1:] == list(argv[1:]):
                same_argv.append(rec)
    if len(same_argv) <= 1:
        return same_argv[0] if same_argv else {}
    # two installed services of one checkpoint, served name, port and flags (two manifests of one port):
    # the log its start script writes to (`setsid SCRIPT >> LOG_DIR/vllm-NAME.log`) tells them apart
    try:
        log = Path(os.readlink("/proc/self/fd/1")).name
    except OSError:
        return {}
    mine = [r for r in same_argv if log == f"vllm-{r.get('service')}.log"]
    return mine[0] if len(mine) == 1 else {}


def _script_argv(script: Path) -> list:
    """The argv a start script of vllm-orch (templates/vllm-process.sh.j2) execs: its `set --` line."""
    try:
        lines = script.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        if line.startswith("set -- "):
            try:
                return shlex.split(line[len("set -- "):])
            except ValueError:
                return []
    return []


def fault_names(model: str, served: list, argv: list | None = None) -> list:
    """The names a fault may give for this server: the service it is and that service's model (its
    installed record, own_service), else the weights folder's name; the model argument; the served
    names."""
    rec = own_service(sys.argv if argv is None else argv)
    names = [v for v in (rec.get("service"), rec.get("model")) if isinstance(v, str) and v]
    return (names or [Path(model).name]) + [model, *served]


def consume_fault(model_names: list, only: tuple = ()) -> dict | None:
    """Take the first pending non-hub fault for one of these model names (or for any model): the
    entry is removed, or its `times` count lowered when more starts are to fail. A start takes any
    fault but the sleep-mode ones; the sleep endpoints take only theirs (`only`)."""
    path = HOST_DIR / "faults.json"
    if not path.exists():
        return None
    try:
        import fcntl
        lock = open(str(path) + ".lock", "a+")
        fcntl.flock(lock, fcntl.LOCK_EX)
    except (ImportError, OSError):
        lock = None
    try:
        faults = _read_json(path, [])
        for i, f in enumerate(faults):
            name = f.get("fault", "")
            if name.startswith("hub-") or name not in FAULTS:
                continue
            if (name not in only) if only else (name in SLEEP_FAULTS):
                continue
            if f.get("model") in (None, "", *model_names):
                if int(f.get("times") or 1) > 1:
                    f["times"] = int(f["times"]) - 1
                else:
                    del faults[i]
                _write_whole(path, json.dumps(faults, indent=1))
                return dict(f)
        return None
    finally:
        if lock:
            lock.close()


# --------------------------------------------------------------------------------------------
# Argument parsing: the vLLM 0.33.0 flag set. `a|b` are aliases of one option.
_FLAG_OPTS = """
--aggregate-engine-logging --allow-credentials --allow-deprecated-quantization --async-scheduling
--cohere-is-reasoning-model --cudagraph-metrics --data-parallel-external-lb|-dpe
--data-parallel-hybrid-lb|-dph --data-parallel-multi-port-external-lb|-dpm --dcp-q-replicate
--disable-cascade-attn --disable-chunked-mm-input --disable-custom-all-reduce
--disable-fastapi-docs --disable-hybrid-kv-cache-manager --disable-log-stats
--disable-nccl-for-dp-synchronization --disable-sliding-window --disable-uvicorn-access-log
--enable-auto-tool-choice --enable-batch-sharded-sampling --enable-chunked-prefill
--enable-cumem-allocator --enable-dbo --enable-elastic-ep --enable-ep-weight-filter --enable-eplb
--enable-expert-parallel|-ep --enable-fault-tolerance --enable-flash-late-interaction
--enable-flashinfer-autotune --enable-force-include-usage --enable-hc-sp
--enable-layerwise-nvtx-tracing --enable-log-deltas --enable-log-outputs --enable-log-requests
--enable-logging-iteration-details --enable-lora --enable-mamba-cache-stochastic-rounding
--enable-mamba-shared-prefix-checkpoint --enable-mfu-metrics --enable-mixed-moe-lora-format
--enable-mm-embeds --enable-moe-shared-loras --enable-nccl-comm-suspend --enable-offline-docs
--enable-per-request-metrics --enable-prefix-caching --enable-prompt-embeds
--enable-prompt-tokens-details --enable-request-id-headers --enable-return-routed-experts
--enable-scale-out --enable-server-load-tracking --enable-shm-tensor-arena --enable-sleep-mode
--enable-ssl-refresh --enable-tokenizer-info-endpoint --enable-tower-connector-lora
--enable-trace-replay --enforce-eager --exclude-tools-when-tool-choice-none
--fail-on-environ-validation --fully-sharded-loras --interleave-mm-strings --jit-monitor-verbose
--kv-cache-metrics --kv-sharing-fast-prefill --language-model-only --log-error-stack
--long-prefill-token-threshold-adaptive --mm-device-do-normalize --mm-encoder-only --monokernel
--numa-bind --ray-workers-use-nsight --return-sampling-mask --return-tokens-as-token-ids
--scheduler-reserve-full-isl --skip-mm-profiling --skip-tokenizer-init
--sleep-mode-offload-cudagraph --specialize-active-lora --swa-bounded-replay --tokens-only
--trust-remote-code --trust-request-chat-template --trust-request-mm-kwargs --use-fp64-gumbel
--use-replayssm --use-tqdm-on-load
"""
_FLAG0_OPTS = """
--grpc --headless
"""
_LIST_OPTS = """
--allowed-media-domains --api-key --collect-detailed-traces --cpu-offload-params
--cudagraph-capture-sizes --ignore-patterns --kv-cache-dtype-skip-layers --logits-processors
--lora-modules --lora-target-modules --numa-bind-cpus --numa-bind-nodes --offload-params
--served-model-name --sleep-preserve-parameter-names
"""
_OPTVAL_OPTS = """
--hf-token
"""
_VALUE_OPTS = """
--additional-config --all2all-backend --allowed-headers --allowed-local-media-path
--allowed-methods --allowed-origins --anthropic-disabled-thinking-effort --api-server-count|-asc
--attention-backend --attention-config|-ac --aux-output-config --block-size --chat-template
--chat-template-content-format --code-revision --cohere-format --compilation-config|-cc --config
--config-format --convert --cp-kv-cache-interleave-size --cpu-distributed-timeout-seconds
--cpu-offload-gb --custom-histogram-buckets --data-parallel-address|-dpa
--data-parallel-backend|-dpb --data-parallel-rank|-dpn --data-parallel-rpc-port|-dpp
--data-parallel-size-local|-dpl --data-parallel-size|-dp --data-parallel-start-rank|-dpr
--data-parallel-supervisor-port --dbo-decode-token-threshold --dbo-prefill-token-threshold
--dcp-comm-backend --dcp-kv-cache-interleave-size --decode-context-parallel-size|-dcp
--default-chat-template-kwargs --default-mm-loras --device-ids --diffusion-config|-dc
--disable-access-log-for-endpoints --distributed-executor-backend --distributed-timeout-seconds
--download-dir --dp-supervisor-probe-failure-threshold --dp-supervisor-probe-interval-s
--dp-supervisor-probe-timeout-s --dp-sync-interval --dtype --ec-manager-config --ec-transfer-config
--elastic-ep-max-dp-size --engram-config --eplb-config --expert-placement-strategy
--fault-tolerance-config --fingerprint-mode --fingerprint-value --gdn-prefill-backend
--generation-config --gpu-memory-utilization|--device-memory-utilization --grpc-port
--h11-max-header-count --h11-max-incomplete-event-size --hf-config-path --hf-overrides --host
--io-processor-plugin --ir-op-priority --jit-monitor-mode --kda-decode-backend
--kda-prefill-backend --kernel-config --kv-cache-dtype --kv-cache-memory-bytes
--kv-cache-metrics-sample --kv-events-config --kv-offloading-backend --kv-offloading-size
--kv-transfer-config --limit-mm-per-prompt --linear-backend --load-format --log-config-file
--log-level --logging-config --logprobs-mode --long-prefill-token-threshold --lora-dtype
--mamba-backend --mamba-block-size --mamba-cache-dtype --mamba-cache-mode
--mamba-cache-philox-rounds --mamba-ssm-cache-dtype --mamba-ssu-algorithm --master-addr
--master-port --max-cpu-loras --max-cudagraph-capture-size --max-log-len --max-logprobs
--max-lora-cls-labels --max-lora-rank --max-loras --max-model-len --max-num-active-seqs
--max-num-batched-tokens --max-num-queued-reqs --max-num-queued-tokens --max-num-scheduled-tokens
--max-num-seqs --max-parallel-loading-workers --media-io-kwargs --middleware
--mm-encoder-attn-backend --mm-encoder-attn-dtype --mm-encoder-fp8-scale-path
--mm-encoder-fp8-scale-save-margin --mm-encoder-fp8-scale-save-path --mm-encoder-tp-mode
--mm-hasher-algorithm --mm-ipc-gpu-memory-gb --mm-processor-cache-gb --mm-processor-cache-type
--mm-processor-device --mm-processor-kwargs --mm-shm-cache-max-object-size-mb --mm-tensor-ipc
--model-class-overrides --model-impl --model-loader-extra-config --moe-backend --nnodes|-n
--node-rank|-r --num-gpu-blocks-override --offload-backend --offload-group-size
--offload-num-in-group --offload-prefetch-step --optimization-level --otlp-traces-endpoint
--override-generation-config --per-request-spec-decode-metrics --performance-mode
--pipeline-parallel-size|-pp --pooler-config --port --prefill-context-parallel-size|-pcp
--prefill-schedule-interval --prefix-cache-retention-interval --prefix-caching-hash-algo
--prefix-match-unit --profiler-config --pt-load-map-location --quantization-config
--quantization|-q --reasoning-config --reasoning-effort-map --reasoning-parser
--reasoning-parser-plugin --renderer-num-workers --replayssm-buffer-len --response-role --revision
--root-path --runner --safetensors-load-strategy --safetensors-prefetch-block-size
--safetensors-prefetch-num-threads --scheduler-cls --scheduling-policy --seed
--show-hidden-metrics-for-version --shutdown-timeout --sleep-mode-backend
--sparse-indexer-topk-backend --spec-method --spec-model --spec-tokens --speculative-config|-sc
--sse-keep-alive-interval --ssl-ca-certs --ssl-cert-reqs --ssl-certfile --ssl-ciphers --ssl-keyfile
--stream-interval --structured-outputs-config --tensor-parallel-size|-tp --tokenizer
--tokenizer-mode --tokenizer-revision --tool-call-parser --tool-parser-plugin --tool-server
--tool-strict-level --ubatch-size --uds --uvicorn-log-level --video-pruning-method
--video-pruning-rate --watchdog-config --watermark --watermark-config --weight-transfer-config
--worker-cls --worker-extension-cls
"""
_SUBCOMMANDS = ["chat", "complete", "serve", "launch", "bench", "collect-env", "download-kernels",
                "preload", "run-batch", "snapshot"]


class EnableDisableAction(argparse.Action):
    """vLLM's BooleanOptionalAction variant: --x / --no-x, and --enable-x pairs with --disable-x."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.pop("nargs", None)
        extra = []
        for opt in option_strings:
            if opt.startswith("--"):
                extra.append("--no-" + opt[2:])
                for a, b in (("--enable-", "--disable-"), ("--disable-", "--enable-")):
                    if opt.startswith(a):
                        extra.append(b + opt[len(a):])
        self.negative = set(extra)
        super().__init__(list(option_strings) + extra, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string not in self.negative)


# Flags whose presence follows the version: (flag, first release with it, first release without it).
# --shutdown-timeout: added by vllm PR #34730, released in v0.18.0. --swap-space: in EngineArgs
# 0.15.0-0.17.1, absent from 0.18.0 on (unsloth-zoo #1210; absent from the 0.24.0 and 0.33.0 wheels'
# engine/arg_utils.py). A version outside a flag's range fails on it with argparse's own
# "unrecognized arguments".
VERSIONED_FLAGS = [("--shutdown-timeout", "0.18.0", None), ("--swap-space", None, "0.18.0")]


def has_flag(flag: str) -> bool:
    for name, since, until in VERSIONED_FLAGS:
        if name == flag:
            return (since is None or not version_before(VERSION, since)) and \
                (until is None or version_before(VERSION, until))
    return True


def start_line(addr: str, port: int) -> tuple[str, str]:
    """(logger location, text) of the API server's start line, as this version words it: 0.33.0 logs
    `[entry.py:139] Starting vLLM server on URL` (entrypoints/launchers/api_server/entry.py), 0.24.0
    the same words from `[api_server.py:581]` (entrypoints/openai/api_server.py); older releases
    `Starting vLLM API server 0 on URL` (api_server.py). Where between them the words changed is not
    pinned down: the simulator takes 0.20.0, a chosen boundary (and the old line's number is chosen)."""
    url = f"http://{addr}:{port}"
    if version_before(VERSION, "0.20.0"):
        return "api_server.py:1874", f"Starting vLLM API server 0 on {url}"
    if version_before(VERSION, "0.33.0"):
        return "api_server.py:581", f"Starting vLLM server on {url}"
    return "entry.py:139", f"Starting vLLM server on {url}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm", description="vLLM CLI")
    parser.add_argument("-v", "--version", action="version", version=VERSION)
    subs = parser.add_subparsers(required=False, dest="subparser")
    for name in _SUBCOMMANDS:
        if name != "serve":
            subs.add_parser(name, help=f"vllm {name} (not simulated)")
            continue
        add_serve(subs)
    return parser


def add_serve(subs: Any, parser_class: Any = None) -> argparse.ArgumentParser:
    """The `serve` sub-parser with this version's flags (also what the simulated vllm wheel's
    ServeSubcommand.subparser_init builds for argcheck.py: orchestrator/sim/engines.py)."""
    serve = subs.add_parser("serve", usage="vllm serve [model_tag] [options]",
                            help="Launch a local OpenAI-compatible API server.",
                            **({"parser_class": parser_class} if parser_class else {}))
    serve.add_argument("model_tag", nargs="?")
    serve.add_argument("--model", dest="model")

    def opts(table):
        return [o.split("|") for o in table.split()]

    for names in opts(_FLAG_OPTS):
        serve.add_argument(*names, action=EnableDisableAction, default=None)
    for names in opts(_FLAG0_OPTS):
        serve.add_argument(*names, action="store_true", default=False)
    for names in opts(_LIST_OPTS):
        serve.add_argument(*names, nargs="+", default=None)
    for names in opts(_OPTVAL_OPTS):
        serve.add_argument(*names, nargs="?", const=True, default=None)
    for names in opts(_VALUE_OPTS):
        if has_flag(names[0]):
            serve.add_argument(*names, default=None)
    for flag, _since, _until in VERSIONED_FLAGS:
        if has_flag(flag) and flag not in _VALUE_OPTS.split():
            serve.add_argument(flag, default=None)
    return serve


def _value_options() -> set:
    out = set()
    for table in (_VALUE_OPTS, _LIST_OPTS):
        for o in table.split():
            out.update(o.split("|"))
    return out


def normalize_argv(args: list) -> list:
    """What FlexibleArgumentParser.parse_args does before argparse sees the args."""
    if args[:1] == ["serve"]:
        for i, a in enumerate(args):
            if a == "--model" and i + 1 < len(args):
                args = ["serve", args[i + 1], *args[1:i], *args[i + 2:]]
                break
            if a.startswith("--model="):
                args = ["serve", a[len("--model="):], *args[1:i], *args[i + 1:]]
                break
    out = []
    for a in args:
        if a.startswith("--"):
            key, eq, val = a.partition("=")
            head, dot, tail = key[2:].partition(".")
            out.append("--" + head.replace("_", "-") + dot + tail + eq + val)
        elif a.startswith("-O") and a != "-O":
            out += ["--optimization-level", a[3:] if a[2:3] == "=" else a[2:]]
        elif a == "-O":
            out.append("--optimization-level")
        else:
            out.append(a)
    # --json-arg.key value  ->  --json-arg '{"key": value}' (merged per option)
    dicts: dict = {}
    final, skip = [], set()
    known = _value_options()
    for i, a in enumerate(out):
        if i in skip:
            continue
        if a.startswith("--") and "." in a.split("=", 1)[0]:
            key, eq, val = a.partition("=")
            base, _, path = key.partition(".")
            if base in known:
                if not eq and i + 1 < len(out):
                    val = out[i + 1]
                    skip.add(i + 1)
                try:
                    parsed = json.loads(val)
                except ValueError:
                    parsed = val
                node = dicts.setdefault(base, {})
                parts = path.split(".")
                for p in parts[:-1]:
                    node = node.setdefault(p, {})
                node[parts[-1].rstrip("+")] = parsed
                continue
        final.append(a)
    for base, d in dicts.items():
        final += [base, json.dumps(d)]
    return final


# --------------------------------------------------------------------------------------------
# Logging in vLLM's format: "(APIServer pid=N) INFO 11-29 09:05:12 [entry.py:139] message".
def log(proc: tuple, level: str, where: str, msg: str) -> None:
    name, pid = proc
    stamp = time.strftime("%m-%d %H:%M:%S")
    sys.stdout.write(f"({name} pid={pid}) {level} {stamp} [{where}] {msg}\n")
    sys.stdout.flush()


def log_raw(proc: tuple, text: str) -> None:
    name, pid = proc
    for line in text.rstrip("\n").split("\n"):
        sys.stdout.write(f"({name} pid={pid}) {line}\n")
    sys.stdout.flush()


def log_uvicorn(text: str) -> None:
    """uvicorn's own lines carry no process prefix (as the real server's log shows)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def traceback_text(frames: list, exc: str) -> str:
    site = "/usr/local/lib/python3.12/dist-packages"
    lines = ["Traceback (most recent call last):"]
    for file, line, func, code in frames:
        lines.append(f'  File "{site}/{file}", line {line}, in {func}')
        lines.append(f"    {code}")
    lines.append(exc)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# GPU memory bookkeeping shared with the fake nvidia-smi (gpu-procs/<pid>-<gpu>.json).
def proc_start_time(pid: int):
    """When the process started, in seconds after boot (None if it is gone). With the PID this
    names one process - PIDs are reused - and it is what the fake nvidia-smi compares. Boot-relative
    (/proc/<pid>/stat field 22), so a wall-clock step does not change it."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
    return round(ticks / os.sysconf("SC_CLK_TCK"), 2)


def gpu_used_mib() -> dict:
    """MiB in use per GPU index as the simulated driver reports it: the fake nvidia-smi beside
    this program counts only live holders (a killed worker frees its memory, a zombie too)."""
    import subprocess
    smi = HOST_DIR / "bin" / "nvidia-smi"
    try:
        out = subprocess.run([sys.executable, str(smi), "--query-gpu=index,memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    used = {}
    for line in out.splitlines():
        idx, _, mib = line.partition(",")
        if idx.strip().isdigit() and mib.strip().isdigit():
            used[int(idx)] = int(mib)
    return used


def register_gpu(pid: int, title: str, gpu: int, used_mib: int, start_time, cpu_bytes: int = 0) -> None:
    d = HOST_DIR / "gpu-procs"
    d.mkdir(parents=True, exist_ok=True)
    entry = {"pid": pid, "process_name": title, "gpu_index": gpu, "used_mib": int(used_mib),
             "start_time": start_time, "cpu_bytes": int(cpu_bytes)}
    tmp = d / f".{pid}-{gpu}.tmp"
    tmp.write_text(json.dumps(entry))
    os.replace(tmp, d / f"{pid}-{gpu}.json")


# A GPU holder is its own small program beside this one (the host's bin/, the engine wheel's vllm/,
# or orchestrator/sim/): started as this file, each of a deploy's eight or more holders compiled all
# of it and imported asyncio first, about 90 ms of CPU apiece where the holder needs 15.
HOLDER = Path(__file__).resolve().with_name("gpu_holder.py")


def spawn_holder(title: str, exit_with_parent: bool = False):
    import subprocess
    env = dict(os.environ, VLLM_SIM_HOLDER_TITLE=title, VLLM_SIM_HOST_DIR=str(HOST_DIR),
               VLLM_SIM_EXIT_WITH_PARENT="1" if exit_with_parent else "0", VLLM_SIM_PARENT_PID=str(os.getpid()))
    return subprocess.Popen([title, str(HOLDER)], executable=sys.executable, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def await_titles(holders) -> None:
    """Wait until each (process, title) holder has taken its title. vLLM's workers call
    setproctitle before they touch a GPU, so a process that holds GPU memory always has its title;
    a holder takes its own at interpreter start, which a loaded machine delays: its memory is
    registered only after that (a reader of /proc/PID/comm saw `python` in between)."""
    deadline = time.monotonic() + 60
    for proc, title in holders:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/comm") as f:
                    if f.read().strip() == title[:15]:
                        break
            except OSError:
                break
            time.sleep(0.01)


def dist_version(dist: str):
    if ENGINE_VERSION:          # an engine venv: its own installed packages
        from importlib import metadata
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None
    norm = dist.replace("-", "_").lower()
    for d in (HOST_DIR / "site-packages").glob("*.dist-info"):
        if d.name.lower().startswith(norm + "-"):
            for line in (d / "METADATA").read_text().splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    return None


# --------------------------------------------------------------------------------------------
# Answers: a few canned replies to smoke prompts, otherwise coherent filler.
CANNED = [
    (re.compile(r"\b2\s*\+\s*2\b"), "4"),
    (re.compile(r"capital of france", re.I), "Paris"),
    (re.compile(r"\b(reply|answer|respond|say)\b[^.]*\b(ok|okay)\b", re.I), "OK"),
    (re.compile(r"^\s*(hi|hello|hey)\b", re.I), "Hello! How can I help you today?"),
]
FILLER = (
    "Serving a large language model well is mostly about keeping the accelerators busy while "
    "every request still gets a fair share of them. The scheduler batches the decode steps of "
    "many requests together, so the cost of reading the weights is shared, and the key-value "
    "cache keeps what each request has already seen. When the cache fills up, new requests wait "
    "in the queue until running ones finish. Longer prompts take longer to prefill, and a higher "
    "concurrency raises the total throughput while each single stream gets a little slower. "
    "Careful measurements report the time to the first token, the time between tokens and the "
    "tokens per second, for one stream and for many, because each tells a different story. "
)
_TOKEN_RE = re.compile(r"\s*[A-Za-z0-9]+|\s*[^A-Za-z0-9\s]|\s+")


def tokenize(text: str) -> list:
    return _TOKEN_RE.findall(text)


def filler_tokens(n: int, offset: int = 0) -> list:
    base = tokenize(FILLER)
    return [base[(offset + i) % len(base)] for i in range(n)]


def junk_tokens(n: int) -> list:
    alphabet = "qxzjvkwy0123456789#@$%&"
    return [" " + "".join(random.choice(alphabet) for _ in range(random.randint(2, 7)))
            for _ in range(n)]


def answer_for(prompt: str) -> tuple:
    """(reasoning text, content text) for the last user message."""
    short = " ".join(prompt.split())[:80]
    for rx, reply in CANNED:
        if rx.search(prompt):
            return (f"A simple question; the answer is {reply}.", reply)
    return (f"The user asks: \"{short}\". I will give a clear, well organised explanation.",
            FILLER.strip())


# --------------------------------------------------------------------------------------------
# /tokenize and /detokenize with vLLM 0.33's shapes (vllm/entrypoints/serve/tokenize/protocol.py):
#   {model?, prompt, add_special_tokens=true, return_token_strs=false}              (completion form)
#   {model?, messages, add_generation_prompt=true, continue_final_message=false,
#    add_special_tokens=false, return_token_strs=false}                              (chat form)
#   -> 200 {count, max_model_len, tokens, token_strs}
#   {model?, tokens} -> 200 {prompt};  an unknown model -> 404 NotFoundError (param "model").
# The ids count exactly what the completions endpoints report as usage.prompt_tokens: a chat
# message is <|im_start|> role \n content <|im_end|> (4 tokens around the content), the generation
# prompt <|im_start|> assistant \n (3), a completion prompt gets <s> (1).
SPECIAL_PIECES = ["<s>", "<|im_start|>", "<|im_end|>", "\n"]
_PIECE_IDS: dict = {}
_PIECES: list = []


def piece_id(piece: str) -> int:
    """Ids are given to pieces on first sight (specials and the filler text first): stable for
    the life of the server, like a vocabulary, without shipping one."""
    i = _PIECE_IDS.get(piece)
    if i is None:
        i = _PIECE_IDS[piece] = len(_PIECES)
        _PIECES.append(piece)
    return i


for _p in SPECIAL_PIECES + tokenize(FILLER):
    piece_id(_p)


def message_texts(msgs: list) -> list:
    """The text of each chat message (content parts joined), as the chat template sees it."""
    texts = []
    for m in msgs:
        c = m.get("content")
        if isinstance(c, list):
            c = " ".join(p.get("text", "") for p in c if isinstance(p, dict))
        texts.append(str(c or ""))
    return texts


def encode_chat(msgs: list, add_generation_prompt: bool = True,
                continue_final_message: bool = False, add_special_tokens: bool = False) -> list:
    bos, start, end, nl = (piece_id(p) for p in SPECIAL_PIECES)
    ids = [bos] if add_special_tokens else []
    texts = message_texts(msgs)
    for i, (m, text) in enumerate(zip(msgs, texts)):
        ids += [start, piece_id(str(m.get("role") or "user")), nl]
        ids += [piece_id(p) for p in tokenize(text)]
        if not (continue_final_message and i == len(msgs) - 1):
            ids.append(end)
    if add_generation_prompt:
        ids += [start, piece_id("assistant"), nl]
    return ids


def encode_prompt(text: str, add_special_tokens: bool = True) -> list:
    return ([piece_id("<s>")] if add_special_tokens else []) + [piece_id(p) for p in tokenize(text)]


def _api_error(message: str, kind: str, code: int, param=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _model_error(model, served: list):
    """vLLM 0.33's check for the request's model (serve/engine/serving.py, _check_model)."""
    if model and model not in served:
        return 404, _api_error(f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.",
                               "NotFoundError", 404, "model")
    return None


def _validation_error(body, missing: list) -> tuple:
    """FastAPI's 400 as vLLM renders it (exception_handling/handlers/validation.py)."""
    given = f"<dict of {len(body) if isinstance(body, dict) else 0} items>"
    lines = [f"  {{'type': 'missing', 'loc': 'body.{f}', 'msg': 'Field required', 'input': '{given}'}}"
             for f in missing]
    label = "error" if len(lines) == 1 else "errors"
    return 400, _api_error(f"{len(lines)} validation {label}:\n" + "\n".join(lines), "Bad Request", 400,
                           f"body.{missing[0]}")


def tokenize_endpoint(body, served: list, max_model_len: int) -> tuple:
    """(status, JSON object) for POST /tokenize."""
    if not isinstance(body, dict) or not ("messages" in body or "prompt" in body):
        return _validation_error(body, ["prompt", "messages"])
    err = _model_error(body.get("model"), served)
    if err:
        return err
    if "messages" in body:
        gen, cont = body.get("add_generation_prompt", True), body.get("continue_final_message", False)
        if gen and cont:
            return 400, _api_error("Cannot set both `continue_final_message` and "
                                   "`add_generation_prompt` to True.", "BadRequestError", 400)
        ids = encode_chat(body.get("messages") or [], gen, cont, body.get("add_special_tokens", False))
    else:
        ids = encode_prompt(str(body.get("prompt")), body.get("add_special_tokens", True))
    strs = [_PIECES[i] for i in ids] if body.get("return_token_strs") else None
    return 200, {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize_endpoint(body, served: list) -> tuple:
    """(status, JSON object) for POST /detokenize. Ids outside the vocabulary decode to nothing,
    as the real tokenizer does; negative ones fail validation (ge=0)."""
    if not isinstance(body, dict) or not isinstance(body.get("tokens"), list):
        return _validation_error(body, ["tokens"])
    err = _model_error(body.get("model"), served)
    if err:
        return err
    for i, t in enumerate(body["tokens"]):
        if not isinstance(t, int) or t < 0:
            return 400, _api_error(f"1 validation error:\n  {{'type': 'greater_than_equal', 'loc': "
                                   f"'body.tokens.{i}', 'msg': 'Input should be greater than or equal "
                                   f"to 0', 'input': '{t}', 'ctx': {{'ge': 0}}}}", "Bad Request", 400,
                                   f"body.tokens.{i}")
    return 200, {"prompt": "".join(_PIECES[t] for t in body["tokens"] if t < len(_PIECES))}


# --------------------------------------------------------------------------------------------
def go_float(v) -> str:
    """A sample value or `le` bound as prometheus_client writes it (its floatToGoString)."""
    d = float(v)
    if math.isinf(d):
        return "+Inf" if d > 0 else "-Inf"
    if math.isnan(d):
        return "NaN"
    text = repr(d)
    dot = text.find(".")
    if d > 0 and dot > 6:            # Go switches to exponents sooner than Python
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


class Histogram:
    def __init__(self, name: str, doc: str, buckets: list):
        self.name, self.doc, self.buckets = name, doc, buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0
        self.created = time.time()

    def observe(self, v: float) -> None:
        self.total += 1
        self.sum += v
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def samples(self, labels: dict) -> list:
        out = [(f"{self.name}_bucket", dict(labels, le=go_float(b)), c)
               for b, c in zip(self.buckets, self.counts)]
        out.append((f"{self.name}_bucket", dict(labels, le="+Inf"), self.total))
        return out + [(f"{self.name}_count", labels, self.total), (f"{self.name}_sum", labels, self.sum)]


class EngineCore:
    """One engine (one DP rank): its scheduler queue, KV cache and the metrics vLLM labels with
    `engine="<rank>"`."""

    def __init__(self, index: int, cfg: dict):
        self.index = index
        self.running = 0
        self.waiting = 0
        self.admitted = 0          # requests holding one of max_num_seqs slots (the decode batch's size)
        self.kv_in_use = 0
        self.slots = asyncio.Semaphore(cfg["max_num_seqs"])     # max_num_seqs is per engine
        # the engine's prefill capacity: one prefill at a time, first come first served (Engine.run)
        self.prefill_lane = asyncio.Lock()
        self.counters = {"prompt": 0, "generation": 0, "preemptions": 0,
                         "prefix_queries": 0, "prefix_hits": 0}
        self.success: dict = {}
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.",
                              [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0])
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.",
                             [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                              2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0])
        # a finished request's decode time over its tokens after the first (vllm/v1/metrics/stats.py:
        # mean_time_per_output_token, 0 for a one-token answer), on the inter-token buckets
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              list(self.itl.buckets))
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                              40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0])

    def finished(self, reason: str) -> None:
        self.success[reason] = self.success.get(reason, 0) + 1


class EngineDead(Exception):
    """vLLM's EngineDeadError: the engine (a worker) died; every request in flight fails."""


class Aborted(Exception):
    """The request was aborted by a shutdown (mode abort, or the drain window ran out)."""


class Engine:
    """Request scheduling, token pacing and metrics over the service's engines: one per DP rank,
    each with its own queue and KV cache; a request goes to the least loaded engine (vLLM's DP
    load balancing scores engines by waiting * 4 + running)."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.profile = PROFILES[cfg["profile"]]
        self.cores = [EngineCore(i, cfg) for i in range(max(1, cfg["dp"]))]
        self.started = time.time()
        self.hung = False          # fault hang-after-ready: no step makes progress any more
        self.frozen: str | None = None   # /metrics as the last step before the hang published it
        self.draining = False      # shutdown: new requests are refused
        self.aborting = False      # shutdown (abort mode, or the drain ran out): requests end now
        self.dead = False          # a worker died: every request fails
        self.paused = False        # asleep (any level): requests are accepted, not scheduled
        # vllm:engine_sleep_state's one label at 1 (v1/metrics/loggers.py record_sleep_state): "awake",
        # "weights_offloaded" (level 1), "discard_all" (level 2), None (a level-0 pause: all at 0)
        self.sleep_state: str | None = "awake"
        # /sleep's pause modes (vllm/v1/engine/core.py pause_scheduler): every request gets a
        # ticket; "abort" ends those before `abort_below` (finish_reason abort), "wait" lets those
        # before `pause_ticket` run to their end while later ones queue, "keep" holds them all
        self.tickets = 0
        self.pause_ticket = 0
        self.abort_below = 0
        self.hold_all = False
        self.live: set[int] = set()
        # TP/PP across nodes, a node lost while serving: nothing happens until a step needs its
        # ranks; then this (Launch.lost_peer_step) fails the step the way vLLM does
        self.lost_peer: Callable[[], Awaitable[None]] | None = None

    @property
    def in_flight(self) -> int:
        return sum(c.running + c.waiting for c in self.cores)

    @property
    def running(self) -> int:
        return sum(c.running for c in self.cores)

    @property
    def batch(self) -> int:
        """The concurrency the profiles' figures are for: every request admitted to a slot, also
        while its prefill waits for the ones ahead (the profiles are whole-service figures at C)."""
        return sum(c.admitted for c in self.cores)

    def pick(self) -> EngineCore:
        return min(self.cores, key=lambda c: (c.waiting * 4 + c.running, c.index))

    def plan(self, prompt: str, prompt_tokens: int, body: dict) -> tuple:
        """[(kind, token)] and finish_reason for one request."""
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        room = max(1, self.cfg["max_model_len"] - prompt_tokens)
        limit = min(int(limit), room) if limit else room
        min_tokens = int(body.get("min_tokens") or 0)
        ignore_eos = bool(body.get("ignore_eos"))
        if self.cfg["garbage"]:
            reasoning, content = [], junk_tokens(random.randint(20, 60))
        else:
            r_text, c_text = answer_for(prompt)
            reasoning = tokenize(r_text) if self.cfg["reasoning"] else []
            content = tokenize(c_text)
        seq = [("reasoning", t) for t in reasoning] + [("content", t) for t in content]
        want = len(seq)
        if ignore_eos:
            want = limit
        elif want < min_tokens:
            want = min_tokens
        if want > len(seq):
            extra = (junk_tokens(want - len(seq)) if self.cfg["garbage"]
                     else filler_tokens(want - len(seq), len(seq)))
            if not content and reasoning:
                extra[0] = "\n\n" + extra[0].lstrip()
            seq += [("content", t) for t in extra]
        finish = "stop"
        if len(seq) > limit:
            seq, finish = seq[:limit], "length"
        elif ignore_eos and len(seq) >= limit:
            finish = "length"
        return seq, finish

    async def run(self, core: EngineCore, seq: list, prompt_tokens: int, emit):
        """Pace `seq` like the real engine: queue, prefill (TTFT), then decode at the profile's
        per-stream rate for the service's current concurrency (the profiles are whole-service
        figures), on an absolute schedule (no drift).

        Prefill as vLLM V1's scheduler does it (vllm/v1/core/sched/scheduler.py `schedule`):
        running requests are scheduled first, each step has a budget of max_num_batched_tokens,
        and a prefill in progress takes its chunk of that budget before any waiting request is
        admitted. So one long prompt occupies the engine for prompt_tokens / the layout's prefill
        rate, and a request behind it (the health check's one-token probe too) waits in the queue
        (vllm:num_requests_waiting) until the prefills ahead of it are done: one prefill lane per
        engine, first come first served, in chunks of max_num_batched_tokens. Each chunk's KV
        blocks are allocated as it is scheduled (vllm:kv_cache_usage_perc rises step by step);
        vllm:prompt_tokens counts a prompt only when its prefill ends (its first token: a step
        with no new token publishes no IterationStats, vllm/v1/engine/async_llm.py)."""
        loop = asyncio.get_running_loop()
        t_arrive = loop.time()
        core.waiting += 1
        admitted = lane = running = False
        held = done = 0
        ticket = self.tickets
        self.tickets += 1
        self.live.add(ticket)
        try:
            await core.slots.acquire()
            admitted = True
            core.admitted += 1
            await asyncio.sleep(0.015)        # the request's own scheduling overhead (in parallel)
            while self.held(ticket):
                await asyncio.sleep(0.05)          # vLLM's paused scheduler holds them
            self._check_alive(ticket)
            await core.prefill_lane.acquire()
            lane = True
            core.waiting -= 1
            core.running += 1
            running = True
            core.counters["prefix_queries"] += prompt_tokens
            if self.lost_peer is not None:
                await self.lost_peer()
            budget = max(1, self.cfg.get("max_num_batched_tokens") or 8192)
            while True:
                self._check_alive(ticket)
                while (self.hung or self.hold_all) and not (self.dead or self.aborting):
                    await asyncio.sleep(0.2 if self.hung else 0.05)
                self._check_alive(ticket)
                chunk = min(budget, prompt_tokens - held)
                await asyncio.sleep(chunk / self.profile["prefill"])
                held += chunk
                core.kv_in_use += chunk
                if held >= prompt_tokens:
                    break
            core.prefill_lane.release()
            lane = False
            t = t_first = loop.time()
            core.ttft.observe(t - t_arrive)
            core.counters["prompt"] += prompt_tokens
            for i, item in enumerate(seq):
                while (self.hung or self.hold_all) and not (self.dead or self.aborting):  # the API server
                    await asyncio.sleep(0.2 if self.hung else 0.05)                      # still ends requests
                self._check_alive(ticket)                                                # it aborts
                if self.lost_peer is not None:
                    await self.lost_peer()
                if i:
                    itl = 1.0 / (stream_rate(self.profile, self.batch) * self.cfg["decode_factor"])
                    t += itl
                    delay = t - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    core.itl.observe(itl)
                await emit(item)
                if not i:
                    # The decode steps follow the first token's step: a first token written late
                    # (a busy API server) moves them along, as a real engine's next step starts after
                    # the last; otherwise the first gap would shrink and the decode rate look higher.
                    t = loop.time()
                done += 1
                core.kv_in_use += 1
                core.counters["generation"] += 1
            core.tpot.observe((loop.time() - t_first) / (done - 1) if done > 1 else 0.0)
        finally:
            self.live.discard(ticket)
            if lane:
                core.prefill_lane.release()
            if admitted:
                core.admitted -= 1
                core.slots.release()
            if running:
                core.running -= 1
            else:
                core.waiting -= 1
            core.kv_in_use -= held + done
            core.e2e.observe(loop.time() - t_arrive)

    def _check_alive(self, ticket: int | None = None) -> None:
        if self.dead:
            raise EngineDead()
        if self.aborting or (ticket is not None and ticket < self.abort_below):
            raise Aborted()

    def held(self, ticket: int) -> bool:
        """Whether the paused scheduler holds this request back (not for a dead or aborting
        engine): all of them in "keep" mode, and in the others those that came after the pause
        ("wait" drains the ones before it; "abort" ended them)."""
        if self.dead or self.aborting or ticket < self.abort_below:
            return False
        return self.paused and (self.hold_all or ticket >= self.pause_ticket)

    def before_pause(self) -> int:
        """Requests that came before the pause and have not ended."""
        return sum(1 for t in self.live if t < self.pause_ticket)

    def pause(self, mode: str) -> int:
        """pause_scheduler(mode) of vLLM 0.33 (vllm/v1/engine/core.py) begins: new requests queue;
        "abort" ends the ones before it, "keep" holds every one. The requests it aborted."""
        self.pause_ticket = self.tickets
        self.paused = True
        if mode == "keep":
            self.hold_all = True
            return 0
        if mode == "abort":
            self.abort_below = self.pause_ticket
            return self.before_pause()
        return 0

    async def drained(self) -> None:
        """Until the requests from before the pause have ended (drained, or their aborts sent)."""
        while self.before_pause() and not self.dead:
            await asyncio.sleep(0.02)

    def resume(self) -> None:
        self.paused = self.hold_all = False

    def metrics(self) -> str:
        """/metrics as vLLM 0.33 serves it with prometheus_client 0.26: one series per engine
        (labels `engine`, `model_name`, sorted), counters named `*_total`. A single API server
        serves the process registry, whose counters and histograms also carry `*_created`
        series; several API servers (the default with DP > 1) serve the multiprocess registry,
        which has none (vllm/v1/metrics/prometheus.py). The engine's series move only when its
        core publishes a step's stats (the scheduler's every step, vllm/v1/core/sched/scheduler.py
        "We must return the stats even if there are no request outputs this step"): a hung engine
        (a collective that never returns) publishes nothing, its series stay as they were."""
        if self.frozen is not None:
            return self.frozen
        cfg = self.cfg
        created = cfg["api_servers"] == 1
        out: list = []
        if not cfg.get("log_stats", True):
            # --disable-log-stats: AsyncLLM makes no StatLoggerManager (vllm/v1/engine/async_llm.py,
            # `if self.log_stats:`), so no PrometheusStatLogger registers a vllm:* family; /metrics
            # still answers 200 with prometheus_client's own process collectors (single API server)
            return self.process_metrics() if created else ""

        def fmt(labels: dict) -> str:
            return ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))

        def family(name: str, kind: str, doc: str, samples: list) -> None:
            out.extend([f"# HELP {name} {doc}", f"# TYPE {name} {kind}"])
            out.extend(f"{n}{{{fmt(lab)}}} {go_float(v)}" for n, lab, v in samples)

        def per_core(name: str, kind: str, doc: str, value_of) -> None:
            family(name, kind, doc, [(name, self.labels(c), value_of(c)) for c in self.cores])
            if kind == "counter" and created:
                base = name[:-len("_total")]
                family(f"{base}_created", "gauge", doc,
                       [(f"{base}_created", self.labels(c), self.started) for c in self.cores])

        per_core("vllm:num_requests_running", "gauge",
                 "Number of requests in model execution batches.", lambda c: c.running)
        per_core("vllm:num_requests_waiting", "gauge",
                 "Number of requests waiting to be processed.", lambda c: c.waiting)
        family("vllm:engine_sleep_state", "gauge",
               "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
               "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
               [("vllm:engine_sleep_state", dict(self.labels(c), sleep_state=state), float(state == self.sleep_state))
                for state in ("awake", "weights_offloaded", "discard_all") for c in self.cores])
        per_core("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                 lambda c: min(1.0, c.kv_in_use / max(1, cfg["kv_tokens"])))
        per_core("vllm:prefix_cache_queries_total", "counter",
                 "Prefix cache queries, in terms of number of queried tokens.",
                 lambda c: c.counters["prefix_queries"])
        per_core("vllm:prefix_cache_hits_total", "counter",
                 "Prefix cache hits, in terms of number of cached tokens.",
                 lambda c: c.counters["prefix_hits"])
        per_core("vllm:num_preemptions_total", "counter",
                 "Cumulative number of preemption from the engine.",
                 lambda c: c.counters["preemptions"])
        per_core("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                 lambda c: c.counters["prompt"])
        per_core("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
                 lambda c: c.counters["generation"])
        doc = "Count of successfully processed requests."
        family("vllm:request_success_total", "counter", doc,
               [("vllm:request_success_total", dict(self.labels(c), finished_reason=r),
                 c.success.get(r, 0))
                for r in ("stop", "length", "abort", "error", "repetition") for c in self.cores])
        for kind in ("ttft", "itl", "tpot", "e2e"):
            h0 = getattr(self.cores[0], kind)
            family(h0.name, "histogram", h0.doc,
                   [row for c in self.cores for row in getattr(c, kind).samples(self.labels(c))])
            if created:
                family(f"{h0.name}_created", "gauge", h0.doc,
                       [(f"{h0.name}_created", self.labels(c), getattr(c, kind).created)
                        for c in self.cores])
        family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
               [("vllm:cache_config_info",
                 {"block_size": "16", "cache_dtype": cfg["kv_dtype"], "engine": str(c.index),
                  "enable_prefix_caching": "True",
                  "gpu_memory_utilization": str(cfg["util"]),
                  "num_gpu_blocks": str(cfg["kv_tokens"] // 16)}, 1.0) for c in self.cores])
        return "\n".join(out) + "\n"

    @staticmethod
    def process_metrics() -> str:
        """prometheus_client's default registry without vLLM's families: its python_info gauge."""
        v = sys.version_info
        return ("# HELP python_info Python platform information\n# TYPE python_info gauge\n"
                f'python_info{{implementation="CPython",major="{v.major}",minor="{v.minor}",'
                f'patchlevel="{v.micro}",version="{v.major}.{v.minor}.{v.micro}"}} 1.0\n')

    def labels(self, core: EngineCore) -> dict:
        return {"engine": str(core.index), "model_name": self.cfg["served"][0]}


# --------------------------------------------------------------------------------------------
# vllm/entrypoints/serve/middleware/authenticate.py (0.33.0): what the API key guards, and the
# body of its 401 (a starlette JSONResponse, compact JSON). /health, /metrics, /version, /ping,
# /load and the docs stay open.
GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")
UNAUTHORIZED_BODY = b'{"error":"Unauthorized"}'


class Server:
    """The HTTP side: a small HTTP/1.1 implementation on asyncio streams (keep-alive, chunked)."""

    ROUTES = [("/openapi.json", "HEAD, GET"), ("/docs", "HEAD, GET"), ("/redoc", "HEAD, GET"),
              ("/health", "GET"), ("/load", "GET"), ("/ping", "GET"), ("/ping", "POST"),
              ("/tokenize", "POST"), ("/detokenize", "POST"), ("/v1/models", "GET"),
              ("/version", "GET"), ("/v1/responses", "POST"), ("/v1/chat/completions", "POST"),
              ("/v1/completions", "POST"), ("/metrics", "GET")]

    def __init__(self, cfg: dict, engine: Engine):
        self.cfg, self.engine = cfg, engine
        self.healthy = True
        self.created = int(time.time())
        # set when the first decode step kills the engine (a version trap)
        self.on_decode: Callable[[], None] | None = None
        self.sleeper: Sleeper | None = None    # the dev endpoints, with VLLM_SERVER_DEV_MODE=1

    async def handle(self, reader, writer):
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                try:
                    method, target, version = line.decode("latin-1").split()
                except ValueError:
                    break
                headers = {}
                while True:
                    h = await reader.readline()
                    if h in (b"\r\n", b"\n", b""):
                        break
                    k, _, v = h.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = b""
                if headers.get("content-length"):
                    body = await reader.readexactly(int(headers["content-length"]))
                elif headers.get("transfer-encoding", "").lower() == "chunked":
                    while True:
                        size = int((await reader.readline()).strip() or b"0", 16)
                        if size == 0:
                            await reader.readline()
                            break
                        body += await reader.readexactly(size)
                        await reader.readline()
                conn = headers.get("connection", "").lower()
                keep = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
                path, _, query = target.partition("?")
                await self.route(method, path, headers, body, writer, query)
                if not keep:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            pass
        finally:
            try:
                writer.close()
            except Exception:
                pass

    async def respond(self, writer, status: int, body: bytes = b"",
                      ctype: str = "application/json", extra: dict | None = None):
        reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
                  405: "Method Not Allowed", 503: "Service Unavailable"}.get(status, "Error")
        head = [f"HTTP/1.1 {status} {reason}",
                "date: " + time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime()),
                "server: uvicorn", f"content-length: {len(body)}"]
        if body or ctype != "application/json":
            head.append(f"content-type: {ctype}")
        for k, v in (extra or {}).items():
            head.append(f"{k}: {v}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await writer.drain()

    async def json(self, writer, status: int, obj) -> None:
        await self.respond(writer, status, json.dumps(obj).encode())

    def error(self, message: str, kind: str, code: int, param=None) -> dict:
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}

    def authorized(self, method: str, path: str, headers: dict) -> bool:
        """vLLM 0.33's AuthenticationMiddleware (with --api-key / VLLM_API_KEY): OPTIONS and paths
        outside GUARDED_PREFIX pass; otherwise the Authorization header must be "<scheme> <key>"
        with scheme "bearer" in any case and key one of the configured keys."""
        keys = self.cfg["api_keys"]
        if not keys or method == "OPTIONS" or not path.startswith(GUARDED_PREFIX):
            return True
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and any(
            [hmac.compare_digest(token.encode(), k.encode()) for k in keys])

    async def route(self, method, path, headers, body, writer, query: str = ""):
        if not self.authorized(method, path, headers):
            return await self.respond(writer, 401, UNAUTHORIZED_BODY)
        if self.sleeper is not None and any(path == r for r, _ in DEV_ROUTES):
            return await self.dev_route(method, path, body, writer, query)
        if path == "/health" and method in ("GET", "HEAD"):
            return await self.respond(writer, 200 if self.healthy else 503)
        if path == "/ping":
            return await self.respond(writer, 200 if self.healthy else 503)
        if path == "/version" and method == "GET":
            return await self.json(writer, 200, {"version": VERSION})
        if path == "/load" and method == "GET":
            return await self.json(writer, 200, {"server_load": self.engine.running})
        if path == "/metrics" and method == "GET":
            return await self.respond(writer, 200, self.engine.metrics().encode(),
                                      "text/plain; version=0.0.4; charset=utf-8")
        if path == "/v1/models" and method == "GET":
            data = [{"id": n, "object": "model", "created": self.created, "owned_by": "vllm",
                     "root": self.cfg["model"], "parent": None,
                     "max_model_len": self.cfg["max_model_len"],
                     "permission": [{"id": f"modelperm-{random.getrandbits(64):016x}",
                                     "object": "model_permission", "created": self.created,
                                     "allow_create_engine": False, "allow_sampling": True,
                                     "allow_logprobs": True, "allow_search_indices": False,
                                     "allow_view": True, "allow_fine_tuning": False,
                                     "organization": "*", "group": None, "is_blocking": False}]}
                    for n in self.cfg["served"]]
            return await self.json(writer, 200, {"object": "list", "data": data})
        if path in ("/v1/chat/completions", "/v1/completions") and method == "POST":
            return await self.completions(path, body, writer)
        if path in ("/tokenize", "/detokenize") and method == "POST":
            try:
                req = json.loads(body or b"{}")
            except ValueError:
                req = None
            status, obj = (tokenize_endpoint(req, self.cfg["served"], self.cfg["max_model_len"])
                           if path == "/tokenize" else detokenize_endpoint(req, self.cfg["served"]))
            return await self.json(writer, status, obj)
        if any(path == r for r, _ in self.ROUTES):
            return await self.json(writer, 405, {"detail": "Method Not Allowed"})
        return await self.json(writer, 404, {"detail": "Not Found"})

    async def dev_route(self, method, path, body, writer, query: str) -> None:
        """vLLM 0.33's development endpoints (entrypoints/serve/dev/, entrypoints/rl/), registered
        only with VLLM_SERVER_DEV_MODE=1 and, being outside GUARDED_PREFIX, open to anyone who
        reaches the port whatever --api-key says. The sleep ones act; the others answer as if they
        had done their work (what they do is beside the point: that a client can call them)."""
        sleeper = self.sleeper
        assert sleeper is not None
        if not any(path == r and method in m.split(", ") for r, m in DEV_ROUTES):
            return await self.json(writer, 405, {"detail": "Method Not Allowed"})
        params = query_params(query)
        if path == "/sleep":
            bad = []
            level_s = (params.get("level") or ["1"])[-1]
            mode = (params.get("mode") or ["abort"])[-1]
            try:
                level = int(level_s)
            except ValueError:
                level = None
                bad.append({"type": "int_parsing", "loc": ["query", "level"],
                            "msg": "Input should be a valid integer, unable to parse string as an "
                                   "integer", "input": level_s})
            if level is not None and not 0 <= level <= 2:
                kind, op, lim = ("less_than_equal", "less than or equal to", 2) if level > 2 else (
                    "greater_than_equal", "greater than or equal to", 0)
                bad.append({"type": kind, "loc": ["query", "level"],
                            "msg": f"Input should be {op} {lim}", "input": level_s,
                            "ctx": {"le" if level > 2 else "ge": lim}})
            if mode not in PAUSE_MODES:
                bad.append({"type": "literal_error", "loc": ["query", "mode"],
                            "msg": "Input should be " + ", ".join(f"'{m}'" for m in PAUSE_MODES[:-1])
                                   + f" or '{PAUSE_MODES[-1]}'", "input": mode,
                            "ctx": {"expected": ", ".join(f"'{m}'" for m in PAUSE_MODES[:-1])
                                    + f" or '{PAUSE_MODES[-1]}'"}})
            if bad or level is None:
                return await self.json(writer, 422, {"detail": bad})
            try:
                await sleeper.sleep(level, mode)
            except WakeFailed as e:
                return await self.json(writer, 500, self.error(str(e), "InternalServerError", 500))
            return await self.json(writer, 200, {"status": "sleeping", "level": level})
        if path == "/wake_up":
            tags = params.get("tags") or None
            try:
                awake = await sleeper.wake_up(tags)
            except WakeFailed as e:
                return await self.json(writer, 500, self.error(str(e), "InternalServerError", 500))
            return await self.json(writer, 200, {"status": "awake" if awake else "sleeping",
                                                 "tags": tags})
        if path == "/is_sleeping":
            return await self.json(writer, 200, {"is_sleeping": sleeper.is_sleeping})
        if path == "/collective_rpc":      # entrypoints/serve/dev/rpc/api_router.py
            try:
                rpc = json.loads(body or b"")
            except ValueError as e:
                return await self.json(writer, 400, self.error(f"JSON decode error: {e}", "BadRequestError", 400))
            if not isinstance(rpc, dict):
                return await self.json(writer, 400, self.error("Request body must be a JSON object",
                                                               "BadRequestError", 400))
            if rpc.get("method") is None:
                return await self.json(writer, 400, self.error("Missing 'method' in request body",
                                                               "BadRequestError", 400))
            if rpc["method"] == "reload_weights":
                try:
                    results = await sleeper.reload_weights()
                except WakeFailed as e:
                    return await self.json(writer, 500, self.error(str(e), "InternalServerError", 500))
                return await self.json(writer, 200, {"results": results})
            return await self.json(writer, 200, {"results": [None] * max(1, len(sleeper.workers))})
        if path == "/server_info":
            return await self.json(writer, 200, {"vllm_config": f"model={self.cfg['model']}"})
        if path == "/is_paused":
            return await self.json(writer, 200, {"is_paused": self.engine.paused})
        return await self.json(writer, 200, {"status": "ok"})

    async def completions(self, path, raw, writer):
        chat = path.endswith("chat/completions")
        if self.engine.dead or self.engine.draining:
            # vLLM's engine core turns away new work once shutdown started (its request is aborted
            # at once); a dead engine fails every request
            return await self.json(writer, 503 if self.engine.draining else 500, self.error(
                "The server is shutting down" if self.engine.draining else
                "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                "ServiceUnavailableError" if self.engine.draining else "InternalServerError",
                503 if self.engine.draining else 500))
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return await self.json(writer, 400, self.error("Invalid JSON body", "BadRequestError",
                                                           400))
        model = body.get("model") or self.cfg["served"][0]
        if model not in self.cfg["served"]:
            return await self.json(writer, 404, self.error(
                f"The model `{model}` does not exist. Valid aliases: {', '.join(self.cfg['served'])}.",
                "NotFoundError", 404, "model"))
        if chat:
            msgs = body.get("messages") or []
            texts = message_texts(msgs)
            prompt = next((str(m.get("content")) for m in reversed(msgs)
                           if m.get("role") == "user"), texts[-1] if texts else "")
            prompt_tokens = sum(len(tokenize(t)) + 4 for t in texts) + 3
        else:
            prompt = str(body.get("prompt") or "")
            prompt_tokens = len(tokenize(prompt)) + 1
        if prompt_tokens >= self.cfg["max_model_len"]:
            return await self.json(writer, 400, self.error(
                f"This model's maximum context length is {self.cfg['max_model_len']} tokens. "
                f"However, your request has {prompt_tokens} input tokens. Please reduce the length "
                "of the input messages.", "BadRequestError", 400))
        if self.on_decode is not None:
            dying, self.on_decode = self.on_decode, None
            dying()
        if not self.healthy:   # vLLM's EngineDeadError answer
            return await self.json(writer, 500, self.error(
                "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                "InternalServerError", 500))
        seq, finish = self.engine.plan(prompt, prompt_tokens, body)
        if not chat:   # no reasoning split for the completions API
            seq = [("content", t) for _, t in seq]
        rid = ("chatcmpl-" if chat else "cmpl-") + "%032x" % random.getrandbits(128)
        created = int(time.time())
        name = model
        obj = "chat.completion" if chat else "text_completion"
        n_reason = sum(1 for k, _ in seq if k == "reasoning")
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + len(seq),
                                 "completion_tokens": len(seq), "prompt_tokens_details": None,
                                 "completion_tokens_details": None}
        if chat and self.cfg["reasoning"]:
            usage["completion_tokens_details"] = {"reasoning_tokens": n_reason}
        if body.get("stream"):
            return await self.stream(writer, body, seq, finish, prompt_tokens, rid, created,
                                     name, obj, chat, usage)
        parts: dict[str, list[str]] = {"reasoning": [], "content": []}

        async def collect(item):
            parts[item[0]].append(item[1])

        core = self.engine.pick()
        try:
            await self.engine.run(core, seq, prompt_tokens, collect)
        except EngineDead:
            core.finished("error")
            return await self.json(writer, 500, self.error(
                "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                "InternalServerError", 500))
        except Aborted:
            finish = "abort"
        core.finished(finish)
        content = "".join(parts["content"]).lstrip()
        reasoning = "".join(parts["reasoning"]).lstrip() or None
        # Shapes as the real server answers (checked by the contract test against vLLM's CPU build):
        # `reasoning` (not reasoning_content), no empty tool_calls, the token-id fields as null.
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": content,
                                              "refusal": None, "annotations": None,
                                              "audio": None, "function_call": None,
                                              "reasoning": reasoning},
                      "logprobs": None, "finish_reason": finish, "stop_reason": None,
                      "token_ids": None, "routed_experts": None}
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish,
                      "stop_reason": None, "prompt_logprobs": None}
        if body.get("return_token_ids"):      # the completion's token ids (protocol.py return_token_ids)
            choice["token_ids"] = [piece_id(t) for _, t in seq[:len(parts["content"]) + len(parts["reasoning"])]]
        await self.json(writer, 200, {"id": rid, "object": obj, "created": created,
                                      "model": name, "choices": [choice], "usage": usage,
                                      "service_tier": None, "system_fingerprint": FINGERPRINT,
                                      "prompt_logprobs": None, "prompt_token_ids": None,
                                      "prompt_text": None, "kv_transfer_params": None,
                                      "ec_transfer_params": None, "metrics": None})

    async def stream(self, writer, body, seq, finish, prompt_tokens, rid, created, name, obj,
                     chat, usage):
        head = ["HTTP/1.1 200 OK",
                "date: " + time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime()),
                "server: uvicorn", "content-type: text/event-stream; charset=utf-8",
                "transfer-encoding: chunked"]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(payload) -> None:
            data = f"data: {payload}\n\n".encode()
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()

        def chunk(choice, usage_value=None, **top):
            # Chunks carry no "usage" key until the final usage-only chunk (vLLM sends usage on
            # every chunk only with continuous_usage_stats); that one has the fingerprint.
            c = {"id": rid, "object": chunk_obj, "created": created, "model": name,
                 "choices": [choice] if choice else [], **top}
            if usage_value is not None:
                c["usage"] = {k: v for k, v in usage_value.items() if v is not None}
                c["system_fingerprint"] = FINGERPRINT
            return json.dumps(c)

        if chat:
            await send(chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None},
                             prompt_token_ids=None, prompt_text=None))
        state = {"first_content": True, "n": 0}

        async def emit(item):
            kind, tok = item
            state["n"] += 1
            last = state["n"] == len(seq)
            if chat:
                if kind == "content" and state["first_content"]:
                    tok = tok.lstrip()
                    state["first_content"] = False
                delta = {"reasoning": tok} if kind == "reasoning" else {"content": tok}
                choice = {"index": 0, "delta": delta, "logprobs": None,
                          "finish_reason": finish if last else None, "token_ids": None}
                if last:
                    choice["stop_reason"] = None
            else:
                choice = {"index": 0, "text": tok, "logprobs": None,
                          "finish_reason": finish if last else None, "stop_reason": None}
            await send(chunk(choice))

        core = self.engine.pick()
        try:
            try:
                await self.engine.run(core, seq, prompt_tokens, emit)
            except EngineDead:
                await send(json.dumps({"error": {"message": "EngineCore encountered an issue. See stack "
                                                 "trace (above) for the root cause.",
                                                 "type": "InternalServerError", "code": 500}}))
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                core.finished("error")
                return
            except Aborted:
                finish = "abort"
                await send(chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "abort"}
                                 if chat else {"index": 0, "text": "", "logprobs": None,
                                               "finish_reason": "abort", "stop_reason": None}))
            if not seq:
                await send(chunk({"index": 0, "delta": {"content": ""}, "logprobs": None,
                                  "finish_reason": finish}))
            if include_usage:
                await send(chunk(None, usage))
            await send("[DONE]")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            core.finished(finish)
        except (ConnectionError, OSError):
            core.finished("abort")
            raise


# --------------------------------------------------------------------------------------------
class StartupFailed(Exception):
    pass


# --------------------------------------------------------------------------------------------
# Sleep mode (vLLM 0.33: entrypoints/serve/dev/sleep/api_router.py, v1/executor/abstract.py,
# v1/worker/gpu_worker.py, device_allocator/cumem.py and sleep_mode_backend.py). The endpoints
# exist only with VLLM_SERVER_DEV_MODE=1 (entrypoints/launchers/api_server/routers.py), outside
# the API key's GUARDED_PREFIX. Level 1 copies the weights to pinned host RAM and drops the rest
# (KV cache, graphs' runtime pool), level 2 drops everything; each GPU keeps its CUDA context.
# Without --enable-sleep-mode the cumem allocator pools nothing: /sleep answers 200 and frees
# 0 GiB (vLLM's own line says so). A wake needs the memory back: when another process holds it
# the remap fails (HTTP 500) and the engine stays asleep.
DEV_ROUTES = [("/reset_prefix_cache", "POST"), ("/reset_mm_cache", "POST"),
              ("/reset_encoder_cache", "POST"), ("/collective_rpc", "POST"),
              ("/server_info", "GET"), ("/sleep", "POST"), ("/release_kv_cache_memory", "POST"),
              ("/wake_up", "POST"), ("/is_sleeping", "GET"),
              # entrypoints/rl/online/api_router.py (registered with them): weights replaced
              # over HTTP by anyone who reaches the port
              ("/pause", "POST"), ("/resume", "POST"), ("/abort_requests", "POST"),
              ("/is_paused", "GET"), ("/init_weight_transfer_engine", "POST"),
              ("/shutdown_weight_transfer_engine", "POST"), ("/start_weight_update", "POST"),
              ("/start_draft_weight_update", "POST"), ("/update_weights", "POST"),
              ("/finish_weight_update", "POST"), ("/update_weight_version", "POST"),
              ("/weight_info", "GET"), ("/weight_checker", "POST"), ("/get_world_size", "GET")]
PAUSE_MODES = ("abort", "wait", "keep")     # vllm/v1/engine/__init__.py PauseMode
H2D_BYTES_PER_S = 50e9      # pinned host RAM <-> one GPU, per GPU and in parallel: PCIe 5 x16,
                            # ~50 GB/s each way for pinned copies (the issue's 547 GB / 8 links in 1.4 s)
SLEEP_TAGS = ("weights", "kv_cache")    # v1/executor/abstract.py SLEEP_TAGS


def pinned_backup_bytes(w_bytes: float, layers: int) -> int:
    """Host RAM one worker's level-1 backup pins. cumem backs up each allocation with its own
    pinned `torch.empty` (device_allocator/cumem.py sleep), and PyTorch's pinned host allocator
    rounds each block up to a power of two (CachingHostAllocator); freed blocks stay cached, so a
    wake gives none of it back while the process lives. The simulated worker's weights are
    `layers` MoE layers, each two fused expert tensors (w13: 2/3 of the layer, w2: 1/3): Kimi-K2.5
    at TP8 is ~712 and ~356 MiB per rank, pinned as 1 GiB and 512 MiB (1.44x)."""
    layers = max(1, int(layers))
    per_layer = w_bytes / layers

    def pow2(n: float) -> int:
        return 1 << max(0, math.ceil(math.log2(max(n, 1))))
    return layers * (pow2(per_layer * 2 / 3) + pow2(per_layer / 3))
# Each sleep-mode log line the simulator prints: its `file:line` prefix -> (the source file under
# vllm/, the format string at or just after that line). tests/integration/test_sleep_contract.py
# pins them to the real 0.33.0 source.
SLEEP_LOG_SOURCES = {
    "__init__.py:44": ("entrypoints/serve/__init__.py", "SECURITY WARNING: Development endpoints are enabled! "),
    "api_router.py:50": ("entrypoints/serve/dev/sleep/api_router.py", "wake up the engine with tags: %s"),
    "abstract.py:402": ("v1/executor/abstract.py", "Executor is already sleeping."),
    "abstract.py:408": ("v1/executor/abstract.py", "It took %.6f seconds to fall asleep."),
    "abstract.py:414": ("v1/executor/abstract.py", "Executor is not sleeping."),
    "abstract.py:419": ("v1/executor/abstract.py", "Tag %s is not in sleeping tags %s"),
    "abstract.py:426": ("v1/executor/abstract.py", "It took %.6f seconds to wake up tags %s."),
    "gpu_worker.py:335": ("v1/worker/gpu_worker.py", "Sleep mode freed %s GiB memory, %s GiB memory is still in use."),
    "cumem.py:282": ("device_allocator/cumem.py", "CuMemAllocator: sleep freed %.2f GiB memory in total, of which "),
    "sleep_mode_backend.py:202": ("device_allocator/sleep_mode_backend.py", "Using sleep-mode backend: %s"),
    "core.py:1027": ("v1/engine/core.py", "Waiting for in-flight requests to complete before sleeping..."),
    "inplace.py:91": ("model_executor/model_loader/reload/inplace.py", "Reloading weights inplace..."),
    "inplace.py:113": ("model_executor/model_loader/reload/inplace.py", "Reloading and processing weights took %.2f seconds"),
}


def dev_mode() -> bool:
    """envs.VLLM_SERVER_DEV_MODE: bool(int(os.getenv("VLLM_SERVER_DEV_MODE", "0")))."""
    try:
        return bool(int(os.environ.get("VLLM_SERVER_DEV_MODE", "0")))
    except ValueError:
        return False


def live_speed(cfg: dict) -> float:
    """The host's speed now (`vllm-orch sim up --speed` rewrites sim.json; a sleeping server lives
    on across it): VLLM_SIM_SPEED, else sim.json's, else the speed the server started with."""
    env = os.environ.get("VLLM_SIM_SPEED")
    speed = float(env) if env else float(_read_json(HOST_DIR / "sim.json", {}).get("speed") or cfg["speed"])
    return max(speed, 1e-9)


def query_params(query: str) -> dict:
    from urllib.parse import parse_qs
    return parse_qs(query, keep_blank_values=True)


class WakeFailed(Exception):
    pass


class Sleeper:
    """One server's sleep state: which level it sleeps at, its cycles, what a leak left behind."""

    def __init__(self, launch: Launch, cfg: dict):
        self.launch, self.cfg = launch, cfg
        self.level = 0              # the level of the last sleep (what a wake of the weights finds)
        self.paused_only = False    # /sleep?level=0: the scheduler alone is paused
        self.cycles = 0
        self.leak_mib = 0.0         # fault vram-leak: MiB per GPU left behind per sleep
        self.left_mib = 0.0         # what the leaks so far hold on each GPU
        self.backend_logged = False
        self.corrupted = False      # fault wake-corrupt: until reload_weights reads the weights again
        self.sleeping: set = set()  # the executor's sleeping tags (abstract.py sleeping_tags)
        self.junk = False           # a level-2 wake mapped the weights back empty: until reload_weights
        self.base_garbage = bool(cfg["garbage"])   # the start's own fault "garbage" (a reload keeps it)
        self.reload_logged = False  # inplace.py logs its two lines once per process (info_once)
        self.pinned = 0             # bytes per worker PyTorch's pinned host allocator holds (cached after a wake)
        self.falling: asyncio.Event | None = None   # set when a sleep under way (draining) has ended

    @property
    def workers(self) -> list:
        return self.launch.holders

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping) or self.paused_only

    def _names(self) -> list:
        return fault_names(self.cfg["model"], list(self.cfg["served"]))

    async def sleep(self, level: int, mode: str = "abort") -> None:
        """vLLM 0.33's sleep (vllm/v1/engine/core.py EngineCore.sleep): the scheduler pauses in
        `mode` (/sleep's default "abort" ends the requests in flight, "wait" lets them finish
        first, "keep" holds them), then level 1 or 2 frees the GPU memory. A second /sleep while
        one drains waits for it (the executor then says it sleeps already)."""
        launch, engine = self.launch, self.launch.engine
        if self.falling is not None:
            engine.pause(mode)                  # a later "abort" ends what the first still drains
            await self.falling.wait()
        if level == 0:
            engine.pause(mode)
            self.paused_only = True
            engine.sleep_state = None       # async_llm.py sleep: record_sleep_state(1, 0)
            await engine.drained()
            return
        if "weights" in self.sleeping:
            log(launch.ec, "WARNING", "abstract.py:402", "Executor is already sleeping.")
            return
        self.falling = asyncio.Event()
        try:
            await self._sleep(level, mode)
        finally:
            self.falling.set()
            self.falling = None

    async def _sleep(self, level: int, mode: str) -> None:
        launch, engine = self.launch, self.launch.engine
        engine.pause(mode)
        if mode == "wait" and engine.before_pause():        # abort's and keep's pause completes at once
            log(launch.ec, "INFO", "core.py:1027", "Waiting for in-flight requests to complete "
                "before sleeping...")
        await engine.drained()
        if not self.backend_logged:
            self.backend_logged = True
            log(launch.w0, "INFO", "sleep_mode_backend.py:202", "Using sleep-mode backend: cumem")
        fault = consume_fault(self._names(), only=("vram-leak",))
        if fault:
            self.leak_mib = float(fault.get("mib") or 2048)
            fault_fired("vram-leak", mib=self.leak_mib)
        started = time.monotonic()
        w_bytes = launch.w_mib * MiB
        if self.cfg["sleep_mode"] and level == 1:
            self._pin(w_bytes)
        if self.cfg["sleep_mode"]:
            # level 1: the weights are copied out (D2H, every GPU in parallel) before the unmap
            if level == 1:
                await asyncio.sleep(w_bytes / (H2D_BYTES_PER_S * live_speed(self.cfg)))
            self.left_mib += self.leak_mib
            kept = self.resident_mib() + self.left_mib
            pooled = [launch.full_mib(g) - self.resident_mib() for (_p, _t, g, _s) in launch.holders]
            for (p, title, gpu, st) in launch.holders:
                register_gpu(p.pid, title, gpu, int(kept), st, int(CPU_BYTES_PER_WORKER + self.pinned) // SCALE)
            refresh_meminfo()
            freed = (pooled[0] - self.left_mib) * MiB if pooled else 0
            total = pooled[0] * MiB if pooled else 0
            log(launch.w0, "INFO", "cumem.py:282", "CuMemAllocator: sleep freed "
                f"{total / GiB:.2f} GiB memory in total, of which "
                f"{(w_bytes if level == 1 else 0) / GiB:.2f} GiB is backed up in CPU and the rest "
                f"{(total - (w_bytes if level == 1 else 0)) / GiB:.2f} GiB is discarded directly.")
            in_use = kept * MiB
        else:
            freed = 0
            in_use = launch.full_mib(launch.holders[0][2]) * MiB if launch.holders else 0
            log(launch.w0, "INFO", "cumem.py:282", "CuMemAllocator: sleep freed 0.00 GiB memory "
                "in total, of which 0.00 GiB is backed up in CPU and the rest 0.00 GiB is "
                "discarded directly.")
        log(launch.w0, "INFO", "gpu_worker.py:335", f"Sleep mode freed {round(freed / GiB, 2)} GiB "
            f"memory, {round(in_use / GiB, 2)} GiB memory is still in use.")
        self.level = level
        self.sleeping = set(SLEEP_TAGS)
        engine.sleep_state = "weights_offloaded" if level == 1 else "discard_all"
        self.cycles += 1
        log(launch.ec, "INFO", "abstract.py:408",
            f"It took {time.monotonic() - started:.6f} seconds to fall asleep.")

    def resident_mib(self) -> int:
        """What a sleeping worker keeps on its GPU but for leaks: its CUDA context, its CUDA-graph
        pool (vLLM 0.33 captures graphs outside the cumem pool that sleep unmaps unless
        --sleep-mode-offload-cudagraph: config/vllm.py use_cumem_cudagraph_pool) and, with more
        than one GPU, NCCL's buffers (untouched by sleep without --enable-nccl-comm-suspend)."""
        graphs = 0 if self.cfg.get("offload_graphs") else GRAPH_POOL_MIB
        nccl = NCCL_BUFFERS_MIB if len(self.launch.holders) > 1 else 0
        return CUDA_CONTEXT_MIB + graphs + nccl

    def _pin(self, w_bytes: float) -> None:
        """Level 1 pins each worker's backup (rounded, cached: `pinned_backup_bytes`); what the
        cache holds already is reused. Host RAM short of it: the pinned allocation fails in the
        middle of the sleep (PyTorch's CUDA host allocator raises "out of memory"), the engine dies
        half unmapped, as the real one does."""
        want = pinned_backup_bytes(w_bytes, int(PROFILES[self.cfg["profile"]].get("layers") or 1))
        more = max(0, want - self.pinned) * max(1, len(self.launch.holders))
        available = read_meminfo().get("MemAvailable")
        if more and available is not None and more > available * SCALE:
            self.launch.die(self.launch.server, cause=(
                [("vllm/v1/worker/gpu_worker.py", 329, "sleep", "allocator.sleep(offload_tags=(\"weights\",) "
                  "if level == 1 else tuple())"),
                 ("vllm/device_allocator/cumem.py", 268, "sleep", "cpu_backup_tensor = torch.empty(")],
                "RuntimeError: CUDA error: out of memory"))
            raise WakeFailed("CUDA error: out of memory")
        self.pinned = max(self.pinned, want)

    async def wake_up(self, tags: list | None) -> bool:
        """vLLM 0.33's wake (v1/engine/core.py wake_up, v1/executor/abstract.py, gpu_worker.py):
        "scheduling" alone resumes a level-0 pause; otherwise each named tag (None: every tag still
        asleep) is mapped back, and the scheduler resumes only once no tag sleeps (a partial wake
        answers "sleeping"). Level 1 copies the weights back from pinned RAM; level 2 maps the
        weights' memory back EMPTY (cumem restores only what it backed up): the engine answers junk
        until `reload_weights` (POST /collective_rpc) reads the checkpoint into it."""
        launch, engine = self.launch, self.launch.engine
        log(launch.api, "INFO", "api_router.py:50", f"wake up the engine with tags: {tags}")
        if tags is not None and "scheduling" in tags:
            tags = [t for t in tags if t != "scheduling"]
            if not tags and not self.sleeping:
                self.paused_only = False
                engine.sleep_state = "awake"
                engine.resume()
                return True
        if not self.sleeping:
            log(launch.ec, "WARNING", "abstract.py:414", "Executor is not sleeping.")
            return not self.paused_only
        for tag in tags or []:
            if tag not in self.sleeping:
                log(launch.ec, "WARNING", "abstract.py:419",
                    f"Tag {tag} is not in sleeping tags {tags_repr(self.sleeping)}")
                return False
        waking = set(tags) if tags else set(self.sleeping)
        fault = consume_fault(self._names(), only=("wake-fails", "wake-corrupt"))
        started = time.monotonic()
        # the memory must be free again: another process on these GPUs makes the remap fail
        used = gpu_used_mib()
        for (_p, _title, gpu, _st) in launch.holders:
            need = sum(self._tag_mib(t, gpu) for t in waking)
            if used.get(gpu, 0) + need > launch.total_mib(gpu) or (
                    fault and fault.get("fault") == "wake-fails"):
                if fault and fault.get("fault") == "wake-fails":
                    fault_fired("wake-fails")
                log_raw(launch.ec, traceback_text(
                    [("vllm/v1/executor/abstract.py", 424, "wake_up",
                      'self.collective_rpc("wake_up", kwargs=dict(tags=tags))'),
                     ("vllm/device_allocator/cumem.py", 350, "wake_up",
                      "create_and_map(handle)")],
                    "RuntimeError: CUDA Error: out of memory at "
                    "/workspace/csrc/cumem_allocator.cpp:62"))
                raise WakeFailed("CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:62")
        if self.cfg["sleep_mode"]:
            if "weights" in waking and self.level == 1:     # the backup is copied back
                await asyncio.sleep(launch.w_mib * MiB / (H2D_BYTES_PER_S * live_speed(self.cfg)))
            elif "weights" in waking:                       # level 2: mapped back, not filled
                self.junk = self.cfg["garbage"] = True
            self.sleeping -= waking
            self._register()
        else:
            self.sleeping -= waking
        if fault and fault.get("fault") == "wake-corrupt":
            fault_fired("wake-corrupt")
            self.corrupted = self.cfg["garbage"] = True
        log(launch.ec, "INFO", "abstract.py:426", f"It took {time.monotonic() - started:.6f} "
            f"seconds to wake up tags {tags if tags else tags_repr(waking)}.")
        if self.sleeping:
            return False
        self.paused_only = False
        engine.sleep_state = "awake"        # only once fully awake (async_llm.py wake_up)
        engine.resume()
        return True

    def _tag_mib(self, tag: str, gpu: int) -> float:
        """What waking `tag` maps back on `gpu`: the weights' share, or the rest of the pool."""
        w = self.launch.w_mib if self.cfg["sleep_mode"] else 0.0
        if tag == "weights":
            return w
        return max(0.0, self.launch.full_mib(gpu) - self.resident_mib() - w) if self.cfg["sleep_mode"] else 0.0

    def _register(self) -> None:
        """Each worker's GPU memory as the tags still asleep leave it; the pinned blocks stay cached."""
        for (p, title, gpu, st) in self.launch.holders:
            held = self.resident_mib() + self.left_mib + sum(
                self._tag_mib(t, gpu) for t in SLEEP_TAGS if t not in self.sleeping)
            register_gpu(p.pid, title, gpu, int(held), st, int(CPU_BYTES_PER_WORKER + self.pinned) // SCALE)
        refresh_meminfo()

    async def reload_weights(self) -> list:
        """collective_rpc("reload_weights") (v1/worker/gpu_worker.py -> model_loader/reload/inplace.py):
        every worker reads the checkpoint again into its mapped weights, from the page cache or the
        disk, and the junk of a level-2 wake (or a corrupted copy) is gone. With the weights still
        asleep their memory is not mapped: the copy faults and the engine dies, as on a GPU."""
        launch = self.launch
        if "weights" in self.sleeping and self.cfg["sleep_mode"]:
            launch.die(launch.server, cause=(
                [("vllm/v1/worker/gpu_worker.py", 638, "reload_weights",
                  "self.model_runner.reload_weights(*args, **kwargs)"),
                 ("vllm/model_executor/model_loader/reload/inplace.py", 95, "reload_weights",
                  "loaded_weights = model.load_weights(weights_iterator)")],
                "RuntimeError: CUDA error: an illegal memory access was encountered"))
            raise WakeFailed("CUDA error: an illegal memory access was encountered")
        if not self.reload_logged:
            log(launch.w0, "INFO", "inplace.py:91", "Reloading weights inplace...")
        started = time.monotonic()
        files = weight_files(self.cfg["model_dir"]) if self.cfg["model_dir"] else []
        served = sum(p.stat().st_size for p in files) or 1
        cached = sum(fincore(files).values()) if files else 0
        factor = self.cfg["size"] / served
        speed = live_speed(self.cfg)
        await asyncio.sleep(cached * factor / (CACHE_BYTES_PER_S * speed)
                            + (served - cached) * factor / (DISK_BYTES_PER_S * speed))
        for p in files:      # the read fills the page cache like any load
            Piece(p, 0, p.stat().st_size, 0).read()
        if self.junk or self.corrupted:
            self.cfg["garbage"] = self.base_garbage
        self.junk = self.corrupted = False
        if not self.reload_logged:
            self.reload_logged = True
            log(launch.w0, "INFO", "inplace.py:113",
                f"Reloading and processing weights took {time.monotonic() - started:.2f} seconds")
        return [None] * max(1, len(launch.holders))


def tags_repr(tags: set) -> str:
    """A set of tags as vLLM's logger prints it ("{'weights', 'kv_cache'}")."""
    return "{" + ", ".join(repr(t) for t in sorted(tags, key=("weights", "kv_cache").index)) + "}"


# The first decode of an MLA model with FP8 KV and DCP > 1 on vLLM < 0.25.0 (mla_attention.py).
DCP_FP8_DEATH = ([("vllm/v1/worker/gpu_model_runner.py", 3120, "execute_model",
                   "model_output = self.model("),
                  ("vllm/model_executor/layers/attention/mla_attention.py", 803, "forward_impl",
                   "assert not fp8_attention, \"DCP not support fp8 kvcache now.\"")],
                 "AssertionError: DCP not support fp8 kvcache now.")


# --------------------------------------------------------------------------------------------
# The host's memory: the fake nvidia-smi beside this program keeps <hostdir>/meminfo (one registry of
# live workers for GPU and CPU memory); imported from its installed file, as both always ship together.
_SMI: list[Any] = []    # the nvidia-smi module, once loaded


def refresh_meminfo() -> None:
    try:
        if not _SMI:
            from importlib.machinery import SourceFileLoader
            from importlib.util import module_from_spec, spec_from_loader
            loader = SourceFileLoader("_sim_nvidia_smi", str(HOST_DIR / "bin" / "nvidia-smi"))
            spec = spec_from_loader(loader.name, loader)
            if spec is None:
                raise ImportError(f"no module spec for {loader.path}")
            mod = module_from_spec(spec)
            loader.exec_module(mod)
            _SMI.append(mod)
        _SMI[0].write_meminfo(HOST_DIR)
    except (OSError, ImportError, SyntaxError, AttributeError):
        pass


def read_meminfo() -> dict:
    out = {}
    try:
        for line in (HOST_DIR / "meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if rest.split() and rest.split()[0].isdigit():
                out[key.strip()] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


# --------------------------------------------------------------------------------------------
# Loading the weights against the REAL page cache of the (scaled) files. vLLM 0.33's order: the
# folder's *.safetensors named in model.safetensors.index.json, in natural order (default_loader.py
# _prepare_weights, weight_utils.py safetensors_weights_iterator). What is cached when loading
# starts comes from util-linux fincore; cached bytes load at CACHE_BYTES_PER_S, the rest come from
# one simulated disk at DISK_BYTES_PER_S that every reader shares (the loader and, with
# --safetensors-load-strategy prefetch, vLLM's prefetch threads), in up to 16 pieces per shard. Every
# piece is then read for real, so the page cache afterwards is what vLLM's mmap reads leave.
PIECES = 16
MIN_PIECE = 64 << 10      # served bytes: tiny test files are one piece


def natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", os.path.basename(name))]


def weight_files(folder) -> list:
    if folder is None:
        return []
    files = [p for p in Path(folder).glob("*.safetensors") if p.is_file()]
    index = _read_json(Path(folder) / "model.safetensors.index.json", None)
    if isinstance(index, dict) and isinstance(index.get("weight_map"), dict):
        listed = set(index["weight_map"].values())
        files = [p for p in files if p.name in listed]
    return sorted(files, key=lambda p: natural_key(p.name))


def fincore(paths: list) -> dict:
    """{path: bytes in the page cache} from util-linux fincore ({} when it is missing)."""
    import subprocess
    if not paths:
        return {}
    try:
        out = subprocess.run(["fincore", "--json", "--bytes", "--output", "RES,FILE", *map(str, paths)],
                             capture_output=True, text=True, timeout=60)
        rows = json.loads(out.stdout).get("fincore") or []
    except (OSError, ValueError, subprocess.SubprocessError):
        sys.stderr.write("SIMULATED vLLM: fincore failed; every weight file counts as not cached\n")
        return {}
    return {str(r.get("file")): int(r.get("res") or 0) for r in rows}


def fs_type(path) -> str:
    """vLLM's _get_fs_type: the longest /proc/mounts mount point holding the path."""
    best, kind = "", ""
    try:
        resolved = os.path.realpath(str(path))
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and (resolved == parts[1] or resolved.startswith(os.path.join(parts[1], ""))) \
                    and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


class Piece:
    """One sixteenth of a shard: its served bytes [start, end), how many were not cached, and when
    it is (or will be) in the cache once a reader asked the disk for it."""

    def __init__(self, path, start: int, end: int, cold: int):
        self.path, self.start, self.end, self.cold = path, start, end, cold
        self.ready_at: float | None = None

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.start)
                f.read(self.end - self.start)
        except OSError:
            pass


async def sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


class WeightLoad:
    """The weight-loading phase of one start (see above); `factor` real bytes per served byte.
    Time is kept on absolute schedules (the disk's next free moment, the loader's clock) so that
    many short sleeps on a busy machine do not add up their overshoot."""

    def __init__(self, cfg: dict, w0, slow: float):
        self.cfg, self.w0 = cfg, w0
        speed = max(cfg["speed"], 1e-9) / slow
        self.disk_rate, self.cache_rate = DISK_BYTES_PER_S * speed, CACHE_BYTES_PER_S * speed
        self.files = weight_files(cfg["model_dir"])
        served = sum(p.stat().st_size for p in self.files)
        self.factor = cfg["size"] / served if served else 1.0
        cached = fincore(self.files)
        self.pieces = []
        for path in self.files:
            size = path.stat().st_size
            have = cached.get(str(path), 0)           # the warm-up and downloads fill a prefix
            n = max(1, min(PIECES, size // MIN_PIECE))
            bounds = [size * k // n for k in range(n + 1)]
            self.pieces.append([Piece(path, a, b, max(0, b - max(a, have))) for a, b in zip(bounds, bounds[1:])])
        if not self.files:        # no local folder: shards of the real size, all on disk
            n = max(1, int(cfg["size"] / 5e9))
            self.pieces = [[Piece(None, 0, int(cfg["size"] / n), int(cfg["size"] / n))] for _ in range(n)]
        self.count = len(self.pieces)
        self.disk_free = 0.0              # when the simulated disk has served every request so far
        self.clock = time.monotonic()     # where the loader is on its own schedule
        self.prefetch: asyncio.Future[None] | None = None
        self.total = served
        self.available = read_meminfo().get("MemAvailable")

    async def fetch(self, piece: Piece, asked_at: float) -> float:
        """Have the disk bring a piece into the page cache: requests are served in turn at the
        disk's rate, from when the reader asked on its own schedule (`asked_at`), so a reader that
        wakes late on a busy machine does not push the disk's schedule back. Returns when the
        piece is in the cache (0.0 for a piece cached from the start)."""
        if piece.ready_at is None:
            if piece.cold == 0:
                return 0.0
            start = max(asked_at, self.disk_free)
            piece.ready_at = self.disk_free = start + piece.cold * self.factor / self.disk_rate
            await sleep_until(piece.ready_at)
            if piece.path is not None:
                piece.read()
            piece.cold = 0
        await sleep_until(piece.ready_at)
        return piece.ready_at

    async def shard(self, i: int) -> None:
        """The loader's pass over shard i: pieces not cached come from the disk (the copy overlaps
        the read), cached ones at the page-cache rate."""
        for piece in self.pieces[i]:
            if piece.cold == 0 and piece.ready_at is None:
                self.clock += (piece.end - piece.start) * self.factor / self.cache_rate
                continue
            await sleep_until(self.clock)             # the loader reaches the piece, then asks
            self.clock = max(self.clock, await self.fetch(piece, self.clock))
        await sleep_until(self.clock)

    def start_prefetch(self, world: int) -> None:
        """vLLM's checkpoint prefetch (weight_utils.py), its log lines and its auto rule: each of the
        `world` ranks reads sorted_files[rank::world] with num_threads threads, in the background."""
        cfg, w0 = self.cfg, self.w0
        kind = fs_type(self.files[0]) if self.files else ""
        name = kind.upper() if kind else "unknown"
        avail = self.available if self.available is not None else 0
        fits = self.total <= 0.9 * avail
        gib = 1024 ** 3
        log(w0, "INFO", "weight_utils.py:1144", f"Filesystem type for checkpoints: {name}. Checkpoint size: "
            f"{self.total / gib:.2f} GiB. Available RAM: {avail / gib:.2f} GiB.")
        strategy = cfg.get("strategy")
        net = kind in ("nfs", "nfs4", "lustre")
        prefetch = strategy == "prefetch" or (strategy is None and net and fits)
        if strategy is None and not net:
            if fits:
                log(w0, "INFO", "weight_utils.py:1167", f"Auto-prefetch is disabled because the filesystem "
                    f"({name}) is not a recognized network FS (NFS/Lustre). If you want to force prefetching, "
                    "start vLLM with --safetensors-load-strategy=prefetch.")
            else:
                log(w0, "INFO", "weight_utils.py:1174", f"Auto-prefetch is disabled because the filesystem "
                    f"({name}) is not a recognized network FS (NFS/Lustre) and the checkpoint size "
                    f"({self.total / gib:.2f} GiB) exceeds 90% of available RAM ({avail / gib:.2f} GiB).")
        elif strategy is None and net and not fits:
            log(w0, "WARNING", "weight_utils.py:1157", f"Network filesystem ({name}) detected but checkpoint "
                f"total size ({self.total / gib:.2f} GiB) exceeds 90% of available RAM ({avail / gib:.2f} GiB). "
                "Skipping auto-prefetch.")
        elif strategy == "prefetch" and not fits:
            log(w0, "WARNING", "weight_utils.py:1184", "safetensors_load_strategy='prefetch' was explicitly "
                f"specified, but checkpoint total size ({self.total / gib:.2f} GiB) exceeds 90% of available "
                f"RAM ({avail / gib:.2f} GiB). This may cause out-of-memory errors.")
        if not prefetch or not self.files:
            return
        threads = cfg["prefetch_threads"]
        log(w0, "INFO", "weight_utils.py:1106", "Prefetching checkpoint files into page cache started "
            f"(in background, num_threads={threads}, block_size={cfg['prefetch_block']} bytes)")
        self.prefetch = asyncio.ensure_future(self._prefetch(max(1, world), threads))

    async def _prefetch(self, world: int, threads: int) -> None:
        t0 = time.monotonic()
        mine = list(range(self.count))[0::world]          # rank 0's files: the ones it logs about
        done = [0]
        next_pct = [10]

        async def one_file(i: int, gate) -> None:
            async with gate:
                for piece in self.pieces[i]:
                    await self.fetch(piece, t0)
            if i in mine:
                done[0] += 1
                pct = 100 * done[0] / len(mine)
                if next_pct[0] <= 100 and pct >= next_pct[0]:
                    log(self.w0, "INFO", "weight_utils.py:1078", f"Prefetching checkpoint files: "
                        f"{next_pct[0]}% ({done[0]}/{len(mine)})")
                    next_pct[0] += 10

        jobs = []
        for rank in range(world):
            gate = asyncio.Semaphore(threads)
            jobs += [one_file(i, gate) for i in range(rank, self.count, world)]
        await asyncio.gather(*jobs)
        log(self.w0, "INFO", "weight_utils.py:1101",
            f"Prefetching checkpoint files into page cache finished in {time.monotonic() - t0:.2f}s")


class Launch:
    """One `vllm serve` run: start-up sequence, serving, shutdown."""

    def __init__(self, args, fault, fault_args=None):
        self.args, self.fault, self.fault_args = args, fault, fault_args or {}
        self.api = ("APIServer", os.getpid())
        self.holders: list = []        # GPU holders: (Popen, title, gpu, start time)
        self.aux: list = []            # engine cores, DP coordinator, API servers (no GPU memory)
        self.engine_logs: list = []    # (log name, pid) of each engine core
        self.sock: socket.socket | None = None     # bound by start(), listening from serve()
        self.stopping = False
        self.tearing_down = False      # we stop our workers ourselves (a worker exit is expected)
        self.mesh: HeadListener | None = None        # TP/PP across nodes: the head's TCPStore
        self.handshake: HeadListener | None = None      # DP across nodes: the engines' handshake
        self.t0 = time.time()
        if fault:
            fault_fired(fault, **{k: v for k, v in self.fault_args.items() if k not in ("fault", "pid", "at")})

    # -- configuration -------------------------------------------------------------------------
    def configure(self) -> dict:
        a = self.args
        model = a.model_tag or a.model
        if not model:
            raise StartupFailed("ValueError: model must be provided")
        mpath = Path(model)
        if model.startswith(("/", "./", "../", "~")) and not mpath.is_dir():
            raise StartupFailed(traceback_text(
                [("vllm/transformers_utils/config.py", 612, "get_config",
                  "config_dict, config = config_parser.parse("),
                 ("huggingface_hub/utils/_validators.py", 154, "validate_repo_id",
                  "raise HFValidationError(")],
                "huggingface_hub.errors.HFValidationError: Repo id must be in the form "
                f"'repo_name' or 'namespace/repo_name': '{model}'. Use `repo_type` argument if "
                "needed."))
        cfg_json = _read_json(mpath / "config.json", {}) if mpath.is_dir() else {}
        ident = cfg_json.get("_name_or_path") or model
        ep = bool(a.enable_expert_parallel)
        key = pick_profile(ident, ep, int(a.decode_context_parallel_size or 1))
        prof = PROFILES[key]
        index = _read_json(mpath / "model.safetensors.index.json", {}) if mpath.is_dir() else {}
        size = float((index.get("metadata") or {}).get("total_size") or prof["size"])
        if not index and mpath.is_dir():   # a one-file checkpoint (no index): its real size
            size = float(sum(f.stat().st_size for f in mpath.glob("*.safetensors")) or size)
        tp = int(a.tensor_parallel_size or 1)
        pp = int(a.pipeline_parallel_size or 1)
        dp = int(a.data_parallel_size or 1)
        dcp = int(a.decode_context_parallel_size or 1)
        served = a.served_model_name or [model]
        max_len = a.max_model_len
        if max_len in (None, "auto", "-1"):
            max_len = int(cfg_json.get("max_position_embeddings") or prof["max_len"])
        else:
            m = re.fullmatch(r"(\d+)([kKmM]?)", str(max_len))
            if not m:
                raise StartupFailed(f"argument --max-model-len: invalid value: '{max_len}'")
            max_len = int(m.group(1)) * {"": 1, "k": 1000, "K": 1024, "m": 10**6,
                                         "M": 1 << 20}[m.group(2)]
        kv_dtype = a.kv_cache_dtype or "auto"
        speed = float(os.environ.get("VLLM_SIM_SPEED") or SIM.get("speed") or 1.0)
        # --api-key takes precedence over VLLM_API_KEY (vllm .../middleware/register.py)
        keys = [k for k in (a.api_key or [os.environ.get("VLLM_API_KEY")]) if k]
        # API server processes: the default is one per DP rank with internal load balancing
        # (vllm/entrypoints/cli/serve.py), one with an external load balancer
        external_lb = bool(a.data_parallel_external_lb) or a.data_parallel_rank is not None
        hybrid_lb = bool(a.data_parallel_hybrid_lb) or a.data_parallel_start_rank is not None
        if a.api_server_count is not None:
            api_servers = int(a.api_server_count)
        elif external_lb:
            api_servers = 1
        elif hybrid_lb:
            api_servers = int(a.data_parallel_size_local or 1)
        else:
            api_servers = dp
        if a.headless:
            if a.api_server_count is not None and int(a.api_server_count) > 0:
                raise StartupFailed(
                    f"ValueError: --api-server-count={a.api_server_count} cannot be used with "
                    "--headless (no API servers are started in headless mode).")
            api_servers = 0
        nodes = multinode_layout(a, tp, pp, dp)
        return {
            "model": model, "model_dir": mpath if mpath.is_dir() else None, "ident": ident,
            "profile": key, "size": size, "tp": tp, "pp": pp, "dp": dp, "dcp": dcp, "ep": ep,
            "served": served, "max_model_len": max_len, "kv_dtype": kv_dtype,
            "util": float(a.gpu_memory_utilization or 0.9), "speed": speed,
            "reasoning": bool(a.reasoning_parser), "api_keys": keys, "api_servers": api_servers,
            "log_stats": not a.disable_log_stats,
            "host": a.host, "port": int(a.port or 8000), "garbage": self.fault == "garbage",
            "attention_backend": (a.attention_backend or "").upper(),
            "decode_factor": SLOW_DECODE if self.fault == "slow-decode" else 1.0,
            "max_num_seqs": int(a.max_num_seqs or 256),
            "max_num_batched_tokens": int(a.max_num_batched_tokens or 8192), "custom_code": bool(
                cfg_json.get("auto_map")) if cfg_json else prof["custom_code"],
            "trust": bool(a.trust_remote_code), "architectures": cfg_json.get("architectures"),
            "shutdown_timeout": int(getattr(a, "shutdown_timeout", None) or 0),   # none before 0.18.0
            "strategy": a.safetensors_load_strategy,
            "sleep_mode": bool(a.enable_sleep_mode),
            "offload_graphs": bool(getattr(a, "sleep_mode_offload_cudagraph", False)),
            "dev_mode": dev_mode(),
            "prefetch_threads": int(a.safetensors_prefetch_num_threads or 8),
            "prefetch_block": int(a.safetensors_prefetch_block_size or 16 * MiB),
            **nodes,
        }

    # -- start-up --------------------------------------------------------------------------------
    async def start(self, cfg: dict) -> None:
        api = self.api
        log(api, "INFO", "utils.py:302", f"vLLM server version {VERSION}, serving model "
            f"{cfg['model']}")
        nondefault = {k: v for k, v in sorted(vars(self.args).items())
                      if v not in (None, False, []) and k not in ("subparser", "api_key")}
        log(api, "INFO", "utils.py:253", f"non-default args: {nondefault}")
        if self.fault == "crash-trust-remote-code" or (cfg["custom_code"] and not cfg["trust"]):
            m = cfg["model"]
            log_raw(api, traceback_text([
                ("vllm/entrypoints/cli/main.py", 112, "main", "args.dispatch_function(args)"),
                ("vllm/entrypoints/cli/serve.py", 142, "cmd", "uvloop.run(run_server(args))"),
                ("vllm/transformers_utils/config.py", 445, "parse",
                 "config = AutoConfig.from_pretrained("),
                ("transformers/dynamic_module_utils.py", 727, "resolve_trust_remote_code",
                 "raise ValueError(")],
                f"ValueError: The repository {m} contains custom code which must be executed to "
                f"correctly load the model. You can inspect the repository content at "
                f"https://hf.co/{m}.\nPlease pass the argument `trust_remote_code=True` to allow "
                "custom code to be run."))
            raise StartupFailed(None)
        prof = PROFILES[cfg["profile"]]
        arch = (cfg.get("architectures") or [prof["arch"]])[0]
        log(api, "INFO", "model.py:591", f"Resolved architecture: {arch}")
        log(api, "INFO", "model.py:1799", f"Using max model len {cfg['max_model_len']}")
        if cfg["kv_dtype"].startswith("fp8"):
            log(api, "INFO", "cache.py:232", "Using fp8 data type to store kv cache. It reduces the "
                "GPU memory footprint and boosts the performance. Meanwhile, it may cause accuracy "
                "drop without a proper scaling factor.")
        log(api, "INFO", "scheduler.py:245", "Chunked prefill is enabled with "
            f"max_num_batched_tokens={self.args.max_num_batched_tokens or 8192}.")
        # bind, but do not listen: connects are refused until the engine is up
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self.sock.bind((cfg["host"] or "0.0.0.0", cfg["port"]))
        engine = asyncio.ensure_future(self.start_engine(cfg))
        lost = asyncio.ensure_future(self.peer_lost())
        done, _ = await asyncio.wait({engine, lost}, return_when=asyncio.FIRST_COMPLETED)
        lost.cancel()
        if engine not in done:                 # another node's rank died while this one started
            engine.cancel()
            peer = lost.result()
            self.worker_crash(self.w0, self.ec, True, GLOO_FRAMES, gloo_closed(peer))
        engine.result()

    async def peer_lost(self) -> tuple:
        """(address, port) of the first other node whose connection dropped (waits forever on a
        single node, and for DP: the head's handshake does not watch remote engines)."""
        while self.mesh is None:
            await asyncio.sleep(0.05)
        return await asyncio.shield(self.mesh.lost)     # cancelling this must not cancel `lost`

    def gpus(self, cfg: dict) -> list:
        world = cfg["local_world"]        # this node's ranks (all of them on a single node)
        n_host = len(SIM.get("gpus") or []) or 8
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = ([int(x) for x in cvd.split(",") if x.strip().isdigit()] if cvd is not None
                   else list(range(n_host)))
        visible = [g for g in visible if g < n_host]
        if world > len(visible):
            raise StartupFailed(f"ValueError: World size ({world}) is larger than the number of "
                                f"available GPUs ({len(visible)}) in this node.")
        return visible[:world]

    def register(self, pid: int, title: str, gpu: int, used_mib: float, start_time) -> None:
        """A GPU worker's GPU memory, and its CPU memory (CPU_BYTES_PER_WORKER, scaled like the files)."""
        register_gpu(pid, title, gpu, int(used_mib), start_time, CPU_BYTES_PER_WORKER // SCALE)

    def full_mib(self, gpu: int) -> float:
        """What one worker holds once loaded: its share of --gpu-memory-utilization."""
        return self.cfg["util"] * self.total_mib(gpu) - 300

    def total_mib(self, gpu: int) -> int:
        for g in SIM.get("gpus") or []:
            if int(g.get("index", -1)) == gpu:
                return int(g.get("memory_total_mib", 97887))
        return 97887

    async def start_engine(self, cfg: dict) -> None:
        """Start the processes vLLM 0.33 starts, titled as its setproctitle calls title them:
        - world size across DP (TP x PP x DP) > 1 selects the multiproc executor: one engine core
          per DP rank, `VLLM::EngineCore` (`VLLM::EngineCore_DP<d>` with DP > 1, v1/engine/core.py)
          and one GPU worker per rank, `VLLM::Worker[_DP<d>][_PP<p>][_TP<t>][_DCP<c>][_EP<e>]`
          (v1/executor/multiproc_executor.py); at world size 1 the engine core holds the GPU.
        - DP > 1 adds `VLLM::DPCoordinator` (v1/engine/coordinator.py), and several API servers
          (the default with DP: one per rank) run as `VLLM::APIServer_<i>` (v1/utils.py).
        Only GPU workers (or a lone engine core) hold memory and outlive a killed server; the
        others exit with it."""
        dp = cfg["dp"]
        # The engine's log prefix is its process name: "EngineCore" (vLLM's own logs, checked on the
        # real server), "EngineCore_DP<n>" only with data parallelism.
        ec_name = "EngineCore_DP0" if dp > 1 else "EngineCore"
        gpus = self.gpus(cfg)
        multi = cfg["tp"] * cfg["pp"] * dp > 1
        titles = worker_titles(cfg, gpus)
        if multi:
            cores = [spawn_holder(f"VLLM::EngineCore_DP{d}" if dp > 1 else "VLLM::EngineCore",
                                  exit_with_parent=True) for d in cfg["engines"]]
            self.engine_logs = [(f"EngineCore_DP{d}" if dp > 1 else "EngineCore", c.pid)
                                for d, c in zip(cfg["engines"], cores)]
            self.aux += cores
            if dp > 1:
                self.aux.append(spawn_holder("VLLM::DPCoordinator", exit_with_parent=True))
            ec = self.engine_logs[0]
        if cfg["api_servers"] > 1:
            self.api_procs = [spawn_holder(f"VLLM::APIServer_{i}", exit_with_parent=True)
                              for i in range(cfg["api_servers"])]
            self.aux += self.api_procs
        for name, gpu in titles:
            proc = spawn_holder(f"VLLM::{name}")
            self.holders.append((proc, f"VLLM::{name}", gpu, proc_start_time(proc.pid)))
        if not multi:
            ec = (ec_name, self.holders[0][0].pid)
            self.engine_logs = [ec]
        workers = [(t[len("VLLM::"):] if multi else ec_name, p.pid)
                   for (p, t, _g, _s) in self.holders]
        w0 = workers[0]
        prof = PROFILES[cfg["profile"]]
        log(ec, "INFO", "core.py:118", engine_config_line(cfg))
        await_titles([(p, title) for (p, title, _g, _s) in self.holders])
        for (p, title, gpu, st) in self.holders:
            self.register(p.pid, title, gpu, CUDA_CONTEXT_MIB, st)
        refresh_meminfo()
        self.w0, self.ec = w0, ec
        if cfg["nnodes"] > 1 and cfg["engines_local"] == dp:      # TP/PP across nodes
            await self.rendezvous(cfg, workers)
        elif cfg["dp_remote"]:                                    # DP engines on other nodes
            await self.open_handshake(cfg)
        if multi:
            log_rank_lines(cfg, workers)
        if multi:
            log(w0, "INFO", "pynccl.py:148", "vLLM is using nccl==2.28.9")
        await asyncio.sleep(0.05)
        # the real start-up memory check (vllm/v1/worker/utils.py): free memory as the driver
        # reports it, i.e. after every live holder (ours hold their CUDA context by now)
        used = gpu_used_mib()
        for local, (p, title, gpu, st) in enumerate(self.holders):
            total = self.total_mib(gpu) * MiB
            requested = cfg["util"] * total
            free = total - used.get(gpu, 0) * MiB
            if self.fault == "crash-gpu-memory" and local == 0:
                free = min(free, requested * 0.55)
            if free < requested:
                self.worker_crash(workers[local] if multi else ec, ec, multi, [
                    ("vllm/v1/worker/gpu_worker.py", 314, "init_device",
                     "self.requested_memory = request_memory(init_snapshot, self.cache_config)"),
                    ("vllm/v1/worker/utils.py", 760, "request_memory", "raise ValueError(")],
                    f"ValueError: Free memory on device cuda:{local % len(self.holders)} "
                    f"({round(free / GiB, 2)}/{round(total / GiB, 2)} GiB) on startup is less "
                    f"than desired GPU memory utilization ({cfg['util']}, "
                    f"{round(requested / GiB, 2)} GiB). Decrease GPU memory utilization or "
                    "reduce GPU memory used by other processes.")
        # vLLM < 0.18.0 builds TRITON_MLA without FP8 KV support (vllm PR #34597): the model's
        # attention layers refuse it while the engine builds the model
        if (cfg["attention_backend"] == "TRITON_MLA" and cfg["kv_dtype"].startswith("fp8")
                and version_before(VERSION, "0.18.0")):
            self.worker_crash(w0, ec, multi, [
                ("vllm/v1/worker/gpu_model_runner.py", 3871, "load_model",
                 "self.model = model_loader.load_model("),
                ("vllm/v1/attention/backends/mla/triton_mla.py", 97, "__init__",
                 "raise NotImplementedError(")],
                "NotImplementedError: TritonMLA V1 with FP8 KV cache not yet supported")
        # loading weights: timed by the real page cache (WeightLoad), then compile and graphs
        slow = max(1.0, float(self.fault_args.get("factor") or 5.0)) if self.fault == "slow-start" else 1.0
        other_s = cfg["size"] / LOAD_BYTES_PER_S / max(cfg["speed"], 1e-9) * slow
        compile_s, graph_s = other_s * 0.1, other_s * 0.1
        n_gpu_shards = cfg["tp"] * cfg["pp"] * (cfg["dp"] if cfg["ep"] else 1)
        w_mib = cfg["size"] / n_gpu_shards / MiB
        self.w_mib = w_mib
        log(w0, "INFO", "gpu_model_runner.py:4979", f"Starting to load model {cfg['model']}...")
        if cfg["profile"] == "kimi-k25-nvfp4":
            log(w0, "INFO", "nvfp4.py:211", "Using 'FLASHINFER_B12X' NvFp4 MoE backend out of "
                "potential backends: ['FLASHINFER_TRTLLM', 'FLASHINFER_CUTEDSL', "
                "'FLASHINFER_CUTEDSL_BATCHED', 'FLASHINFER_CUTLASS', 'VLLM_CUTLASS', 'MARLIN', "
                "'EMULATION'].")
        load = WeightLoad(cfg, w0, slow)
        shards = load.count
        started = load.clock = time.monotonic()
        steps = max(4, min(shards, 20))
        step_at = [max(1, round(shards * i / steps)) for i in range(1, steps + 1)]
        fi, cubin = dist_version("flashinfer-python"), dist_version("flashinfer-cubin")
        fi_bad = (fi and cubin and fi != cubin
                  and os.environ.get("FLASHINFER_DISABLE_VERSION_CHECK") != "1")
        load.start_prefetch(len(self.holders))
        i = 0
        for done in range(1, shards + 1):
            await load.shard(done - 1)
            if done not in step_at:
                continue
            i += 1
            if self.fault == "crash-flashinfer" or fi_bad:
                if i > steps // 4:
                    fi = fi or "0.7.2.post1"
                    if not fi_bad:          # the release before: 0.7.2.post1 -> 0.7.2, 0.6.14 -> 0.6.13
                        cubin = fi.split(".post")[0] if ".post" in fi else fi.rsplit(".", 1)[0] + "." + str(max(0, int(
                            re.sub(r"\D.*", "", fi.rsplit(".", 1)[1]) or 1) - 1))
                    self.worker_crash(w0, ec, multi, [
                        ("vllm/v1/worker/gpu_model_runner.py", 5021, "load_model",
                         "self.sampler = Sampler(logprobs_mode=self.model_config.logprobs_mode)"),
                        ("vllm/v1/sample/ops/topk_topp_sampler.py", 38, "__init__",
                         "import flashinfer"),
                        ("flashinfer/__init__.py", 24, "<module>", "_check_cubin_version()")],
                        f"RuntimeError: flashinfer-cubin version ({cubin}) does not match "
                        f"flashinfer version ({fi}). Please install the same version of both "
                        "packages. Set FLASHINFER_DISABLE_VERSION_CHECK=1 to bypass this check.")
            if self.fault in LOAD_FAULTS and i > steps // 3:
                frames, exc = LOAD_FAULTS[self.fault]
                fault_fired(self.fault, phase="crashed")
                self.worker_crash(w0, ec, multi, frames, exc)
            if self.fault == "hang" and i > steps // 3:
                while True:
                    await asyncio.sleep(3600)
            el = time.monotonic() - started
            rate = done / el if el else 0.0
            left = (shards - done) / rate if rate else 0.0
            pct = int(100 * done / shards)
            log_raw(w0, f"Loading safetensors checkpoint shards: {pct:3d}% Completed | "
                        f"{done}/{shards} [{int(el) // 60:02d}:{int(el) % 60:02d}<"
                        f"{int(left) // 60:02d}:{int(left) % 60:02d}, {rate:5.2f}it/s]")
            if i % max(1, steps // 4) == 0 or i == steps:
                for (p, title, gpu, st) in self.holders:
                    self.register(p.pid, title, gpu, CUDA_CONTEXT_MIB + w_mib * i / steps, st)
        weights_s = load.clock - started      # on the simulated hardware's schedule (no CPU contention)
        log(w0, "INFO", "default_loader.py:507", f"Loading weights took {weights_s:.2f} seconds")
        w_gib = w_mib / 1024
        log(w0, "INFO", "gpu_model_runner.py:5089",
            f"Model loading took {w_gib:.2f} GiB memory and {time.time() - self.t0:.6f} seconds")
        total_gib = self.total_mib(self.holders[0][2]) / 1024
        budget_gib = cfg["util"] * total_gib
        if w_gib + 1 > budget_gib:
            self.worker_crash(w0, ec, multi, [
                ("vllm/v1/worker/gpu_model_runner.py", 5061, "load_model",
                 "self.model = model_loader.load_model("),
                ("torch/utils/_device.py", 104, "__torch_function__",
                 "return func(*args, **kwargs)")],
                f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.75 GiB. GPU 0 "
                f"has a total capacity of {total_gib:.2f} GiB of which 1.02 GiB is free. Including "
                f"non-PyTorch memory, this process has {total_gib - 1.02:.2f} GiB memory in use.")
        if self.mesh is not None:       # the profile run needs every node's ranks loaded
            await self.collective(cfg, w0, ec, multi, self.mesh.all_loaded())
        compile_s = await self.compile(cfg, w0, compile_s)
        log(w0, "INFO", "monitor.py:62", f"torch.compile took {compile_s:.2f} s in total")
        kv_gib = budget_gib - w_gib - 2.4
        if kv_gib <= 0.2 or self.fault == "crash-no-kv-memory":
            self.worker_crash(w0, ec, multi, [
                ("vllm/v1/worker/gpu_worker.py", 780, "determine_available_memory",
                 "raise ValueError(")],
                "ValueError: No available memory for the cache blocks. Try increasing "
                "`gpu_memory_utilization` when initializing the engine.")
        log(w0, "INFO", "gpu_worker.py:773", f"Available KV cache memory: {kv_gib:.2f} GiB")
        per_gib = prof["kv_per_gib"] * (2 if cfg["kv_dtype"].startswith("fp8") else 1)
        kv_tokens = int(kv_gib * per_gib * cfg["dcp"] * cfg["pp"]) // 16 * 16
        if kv_tokens < cfg["max_model_len"]:
            log_raw(ec, traceback_text([("vllm/v1/core/kv_cache_utils.py", 1098,
                                         "check_enough_kv_cache_memory", "raise ValueError(")],
                f"ValueError: To serve at least one request with the models's max seq len "
                f"({cfg['max_model_len']}), ({cfg['max_model_len'] / per_gib:.2f} GiB KV cache "
                f"is needed, which is larger than the available KV cache memory ({kv_gib:.2f} "
                f"GiB). Based on the available memory, the estimated maximum model length is "
                f"{kv_tokens}. Try increasing `gpu_memory_utilization` or decreasing "
                "`max_model_len` when initializing the engine."))
            self.engine_failed(ec)
        cfg["kv_tokens"] = kv_tokens           # per engine: each DP rank has its own cache
        for engine_core in self.engine_logs:
            log(engine_core, "INFO", "kv_cache_utils.py:1148", f"GPU KV cache size: "
                f"{kv_tokens:,} tokens, Maximum concurrency for {cfg['max_model_len']:,} tokens "
                f"per request: {kv_tokens / cfg['max_model_len']:.2f}x")
        for (p, title, gpu, st) in self.holders:
            self.register(p.pid, title, gpu, cfg["util"] * self.total_mib(gpu) - 300, st)
        await asyncio.sleep(graph_s)
        log(w0, "INFO", "gpu_model_runner.py:6517",
            f"Graph capturing finished in {max(1, round(graph_s))} secs, took {GRAPH_POOL_MIB / 1024:.2f} GiB")
        log(ec, "INFO", "core.py:413", "init engine (profile, create kv cache, warmup model) took "
            f"{compile_s + graph_s + 0.5:.2f} s")
        if self.handshake is not None:  # the API server waits for every remote engine's READY
            await self.handshake.all_ready()

    async def rendezvous(self, cfg: dict, workers: list) -> None:
        """The head's side of torch.distributed's TCPStore rendezvous (rank 0 hosts the store on
        --master-port, every other rank connects): wait for the other nodes' ranks, up to the
        process group timeout, then let everyone go on."""
        log(self.ec, "INFO", "multiproc_executor.py:167",
            f"DP group leader: node_rank={cfg['node_rank']}, node_rank_within_dp=0, "
            f"master_addr={cfg['master_addr']}, mq_connect_ip={os.environ.get('VLLM_HOST_IP') or cfg['master_addr']} "
            f"(local), world_size={cfg['world']}, local_world_size={cfg['local_world']}")
        log_world_lines(cfg, self.holders)
        self.mesh = mesh = HeadListener("0.0.0.0", cfg["master_port"], cfg["nnodes"] - 1)
        try:
            await mesh.start()
        except OSError as exc:
            self.worker_crash(self.w0, self.ec, True, _TORCH_RDZV, (
                "torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
                f"network address. port: {cfg['master_port']}, useIpv6: 0, code: -{exc.errno or 98}, "
                f"name: EADDRINUSE, message: address already in use"))
        timeout = cfg["join_timeout"]
        deadline = time.monotonic() + timeout
        while not mesh.joined.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                joined = cfg["local_world"] + mesh.clients()
                mesh.close()
                self.worker_crash(self.w0, self.ec, True, _TORCH_RDZV, (
                    f"torch.distributed.DistStoreError: Timed out after {int(timeout) + 1} seconds waiting "
                    f"for clients. {joined}/{cfg['world']} clients joined."))
            try:
                await asyncio.wait_for(mesh.joined.wait(), timeout=min(left, 10.0))
            except asyncio.TimeoutError:
                if debug_logging():
                    log(self.api, "DEBUG", "utils.py:1448",
                        "Waiting for 1 local, 0 remote core engine proc(s) to start.")
        mesh.send_all({"go": True})

    async def collective(self, cfg: dict, w0, ec, multi, peers_ready) -> None:
        """This node's ranks in an NCCL collective with the other nodes' (the profile run's first
        all-reduce) until `peers_ready`: torch's watchdog aborts it after the process group's
        timeout (--distributed-timeout-seconds, else 600 s), whatever the peers are doing (loading,
        compiling: the `slow-compile` fault)."""
        timeout = cfg["collective_timeout"]
        try:
            await asyncio.wait_for(peers_ready, timeout=timeout)
        except asyncio.TimeoutError:
            ms = int(timeout * 1000)
            self.worker_crash(w0, ec, multi, [
                ("vllm/v1/worker/gpu_worker.py", 702, "determine_available_memory", "self.model_runner.profile_run()"),
                ("torch/distributed/distributed_c10d.py", 2944, "all_reduce", "work.wait()")],
                f"torch.distributed.DistBackendError: [Rank {cfg['rank0']}] Watchdog caught collective operation "
                f"timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)={ms}) ran for "
                f"{ms + 17} milliseconds before timing out.")

    async def open_handshake(self, cfg: dict) -> None:
        """The front end's handshake socket for engines on other nodes (v1/engine/utils.py
        wait_for_engine_startup): bound on --data-parallel-address:--data-parallel-rpc-port; the
        API server waits for every remote engine's READY, with no timeout of its own."""
        self.handshake = HeadListener(cfg["dp_address"], cfg["dp_rpc_port"], cfg["dp_remote"])
        await self.handshake.start()
        if debug_logging():
            asyncio.ensure_future(self._debug_waiting(cfg))

    async def _debug_waiting(self, cfg: dict) -> None:
        hs = self.handshake
        while hs is not None and not hs.all_done.is_set():
            await asyncio.sleep(10.0)
            if not hs.joined.is_set():
                log(self.api, "DEBUG", "utils.py:1443", f"Waiting for 0 local, "
                    f"{cfg['dp_remote'] - hs.units(hs.links)} remote core engine proc(s) to connect.")
            elif not hs.all_done.is_set():
                log(self.api, "DEBUG", "utils.py:1448", f"Waiting for 0 local, "
                    f"{cfg['dp_remote'] - hs.units(hs.done)} remote core engine proc(s) to start.")

    async def compile(self, cfg: dict, w0, compile_s: float) -> float:
        """torch.compile with vLLM's cache (compilation/backends.py): a configuration compiled
        before loads from VLLM_CACHE_ROOT/torch_compile_cache/<hash>/ instead. Returns its time."""
        import hashlib
        root = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm")
        key = hashlib.sha256(json.dumps([cfg["ident"], cfg["tp"], cfg["pp"], cfg["dp"], cfg["dcp"],
                                         cfg["kv_dtype"], cfg["max_model_len"]]).encode()).hexdigest()[:10]
        cache = Path(os.path.expanduser(root)) / "torch_compile_cache" / key / "rank_0_0" / "backbone"
        log(w0, "INFO", "backends.py:1126", f"Using cache directory: {cache} for vLLM's torch.compile")
        rng = f"(1, {self.args.max_num_batched_tokens or 8192})"
        if (cache / "done").exists():
            compile_s *= 0.2
            await asyncio.sleep(compile_s)
            log(w0, "INFO", "backends.py:311", f"Directly load the compiled graph(s) for compile range {rng} "
                f"from the cache, took {compile_s:.3f} s")
            return compile_s
        await asyncio.sleep(compile_s)
        log(w0, "INFO", "backends.py:418", f"Compiling a graph for compile range {rng} takes {compile_s:.2f} s")
        try:
            cache.mkdir(parents=True, exist_ok=True)
            (cache / "done").write_text(str(time.time()))
        except OSError as exc:
            log(w0, "WARNING", "backends.py:1130", f"could not write the torch.compile cache: {exc}")
        return compile_s

    def worker_crash(self, where, ec, multi, frames, exc) -> None:
        """A root-cause exception in a worker (or engine core) plus vLLM's generic wrappers."""
        if multi:
            log(where, "ERROR", "multiproc_executor.py:853", "WorkerProc failed to start.")
            log_raw(where, traceback_text(
                [("vllm/v1/executor/multiproc_executor.py", 824, "worker_main",
                  "worker = WorkerProc(*args, **kwargs)")] + frames, exc))
            log(ec, "ERROR", "core.py:1584", "EngineCore failed to start.")
            log_raw(ec, traceback_text(
                [("vllm/v1/engine/core.py", 1556, "run_engine_core",
                  "engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)"),
                 ("vllm/v1/executor/multiproc_executor.py", 233, "_init_executor",
                  "self.workers = WorkerProc.wait_for_ready(unready_workers)")],
                "Exception: WorkerProc initialization failed due to an exception in a background "
                "process. See stack trace for root cause."))
        else:
            log(ec, "ERROR", "core.py:1584", "EngineCore failed to start.")
            log_raw(ec, traceback_text(
                [("vllm/v1/engine/core.py", 1556, "run_engine_core",
                  "engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)")]
                + frames, exc))
        self.engine_failed(ec)

    def engine_failed(self, ec) -> None:
        self.close_links()           # the failed ranks' connections to other nodes die with them
        self.stop_holders()
        log_raw(self.api, traceback_text(
            [("vllm/entrypoints/cli/serve.py", 142, "cmd", "uvloop.run(run_server(args))"),
             ("vllm/v1/engine/utils.py", 1474, "wait_for_engine_startup", "raise RuntimeError(")],
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
            "proc(s): {'EngineCore_DP0': 1}"))
        raise StartupFailed(None)

    def close_links(self) -> None:
        for listener in (self.mesh, self.handshake):
            if listener is not None:
                listener.close()

    def stop_holders(self) -> None:
        self.tearing_down = True
        procs = [h[0] for h in self.holders] + self.aux
        for p in procs:
            try:
                p.terminate()
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(timeout=5)
            except Exception:
                p.kill()
        for (p, _t, _g, _s) in self.holders:     # a holder stopped before its handler was set
            for f in (HOST_DIR / "gpu-procs").glob(f"{p.pid}-*.json"):   # leaves its entry behind
                try:
                    f.unlink()
                except OSError:
                    pass
        self.holders, self.aux = [], []
        refresh_meminfo()

    # -- serving ---------------------------------------------------------------------------------
    async def serve(self, cfg: dict) -> int:
        engine = Engine(cfg)
        server = Server(cfg, engine)
        # With several API servers (the default with DP) each one logs its own start, prefixed
        # "ApiServer_<i>" (while its process title is VLLM::APIServer_<i>), as the real server does.
        apis = ([(f"ApiServer_{i}", p.pid) for i, p in enumerate(getattr(self, "api_procs", []))]
                or [self.api])
        self.cfg, self.engine, self.server = cfg, engine, server
        addr = cfg["host"] or "0.0.0.0"
        routes = list(Server.ROUTES)
        if cfg["dev_mode"]:
            server.sleeper = Sleeper(self, cfg)
            routes += DEV_ROUTES
        for api in apis:
            if cfg["dev_mode"]:
                log(api, "WARNING", "__init__.py:44", "SECURITY WARNING: Development endpoints "
                    "are enabled! This should NOT be used in production!")
            log(api, "INFO", "entry.py:134", "Supported tasks: ['generate']")
            log(api, "INFO", *start_line(addr, cfg["port"]))
            log(api, "INFO", "launcher.py:188", "Available routes are:")
            for path, methods in routes:
                log(api, "INFO", "launcher.py:196", f"Route: {path}, Methods: {methods}")
        sock = self.sock
        assert sock is not None                     # start() bound it
        sock.listen(1024)
        sock.setblocking(False)
        srv = await asyncio.start_server(server.handle, sock=sock, limit=1 << 22)
        for _name, pid in apis:
            log_uvicorn(f"INFO:     Started server process [{pid}]")
            log_uvicorn("INFO:     Waiting for application startup.")
            log_uvicorn("INFO:     Application startup complete.")
        loop = asyncio.get_running_loop()
        self.ready = loop.create_future()
        if self.mesh is not None:        # the other nodes' ranks now idle between steps
            self.mesh.send_all({"serving": True})
        refresher = asyncio.ensure_future(self.keep_meminfo())
        if self.fault == "die-after-ready":
            loop.call_later(3.0, self.die, server)
        trigger = None
        if self.fault == "hang-after-ready" and self.fault_args.get("trigger"):
            trigger = loop.create_task(self.hang_when(Path(str(self.fault_args["trigger"]))))
        elif self.fault == "hang-after-ready":
            loop.call_later(float(self.fault_args.get("after") or 5.0), self.hang)
        if (cfg["dcp"] > 1 and cfg["kv_dtype"].startswith("fp8") and cfg["profile"].startswith("kimi")
                and version_before(VERSION, "0.25.0")):
            # MLA decode asserts before 0.25.0 (vllm issue #32010, PR #44044): the whole load went
            # fine, the first decode step kills the engine
            server.on_decode = lambda: self.die(server, DCP_FP8_DEATH)
        watcher = loop.create_task(self.watch_workers())
        peers = loop.create_task(self.watch_peers(server))
        code = await self.ready
        peers.cancel()
        watcher.cancel()
        refresher.cancel()
        if trigger is not None:
            trigger.cancel()
        srv.close()
        return code

    async def keep_meminfo(self) -> None:
        """While serving, keep the host's simulated /proc/meminfo in step with the live workers
        (a worker killed with SIGKILL cannot say it left)."""
        while True:
            await asyncio.sleep(1.0)
            refresh_meminfo()

    async def hang_when(self, trigger: Path) -> None:
        """hang-after-ready at the moment a test chooses: when the file `trigger` appears."""
        while not trigger.exists():
            await asyncio.sleep(0.1)
        self.hang()

    def hang(self) -> None:
        """The engine stops making progress and says nothing (an NCCL collective that never
        returns): /health stays 200 because the engine is not dead, requests never finish."""
        self.engine.frozen = self.engine.metrics()
        self.engine.hung = True
        fault_fired("hang-after-ready", phase="hung")

    async def watch_workers(self) -> None:
        """vLLM's MultiprocWorkerMonitor: a worker that exits while the engine runs (killed, or
        SIGTERMed straight by a stop that signals the whole cgroup) makes the engine dead."""
        while not self.tearing_down:
            for (p, title, _gpu, _st) in self.holders:
                if p.poll() is not None and not self.tearing_down:
                    ec = self.engine_logs[0] if self.engine_logs else ("EngineCore_DP0", os.getpid())
                    log(ec, "ERROR", "multiproc_executor.py:381",
                        f"Worker proc {title[len('VLLM::'):]} died unexpectedly (exit code: {p.returncode}), "
                        "shutting down executor.")
                    self.engine.dead = True
                    self.server.healthy = False
                    log(self.api, "ERROR", "async_llm.py:693", "AsyncLLM output_handler failed.")
                    log_raw(self.api, "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an "
                                      "issue. See stack trace (above) for the root cause.")
                    self.stop_holders()
                    asyncio.get_running_loop().call_later(0.5, self._finish, 1)
                    return
            await asyncio.sleep(0.2)

    async def watch_peers(self, server) -> None:
        """A node of this service that drops its connection while it serves (its rank died, or
        the node went away). TP/PP across nodes, as the real vLLM (0.32, two nodes over Gloo) did:
        nothing while the service is idle - no line, /health stays 200 - and the next engine step
        fails (lost_peer_step). DP across nodes (not seen with a real vLLM): the engine dies at once."""
        listeners = [x for x in (self.mesh, self.handshake) if x is not None]
        if not listeners:
            return
        done, _ = await asyncio.wait([x.lost for x in listeners], return_when=asyncio.FIRST_COMPLETED)
        if self.stopping:
            return
        peer = next(iter(done)).result()
        if self.handshake is not None:
            self.die(server, (GLOO_FRAMES, gloo_closed(peer)))
            return
        failing: list[asyncio.Future] = []

        async def step() -> None:
            if not failing:
                failing.append(asyncio.ensure_future(self.lost_peer_step(server, peer)))
            await asyncio.shield(failing[0])
            raise EngineDead()

        self.engine.lost_peer = step

    async def lost_peer_step(self, server, peer: tuple) -> None:
        """The first engine step after a node was lost. The head's worker that talks to the lost
        ranks logs gloo's error naming the peer's address at once. With TP across nodes that worker's
        failure is the step's: the request gets HTTP 500 and the engine dies. With PP across nodes
        the engine waits for the output of the last stage (on the lost node) until
        VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300), then dies with `RPC call to sample_tokens timed out.`"""
        cfg, exc = self.cfg, gloo_closed(peer)
        if cfg["tp"] > cfg["local_world"]:
            self.die(server, (EXECUTE_FRAMES, exc))
            self.engine.dead = True
            return
        self.worker_exception(EXECUTE_FRAMES, exc)
        await asyncio.sleep(float(os.environ.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS") or 300))
        self.engine.dead = True
        self.die(server, engine=([("vllm/v1/engine/core.py", 1571, "run_engine_core", "engine_core.run_busy_loop()"),
                                  ("vllm/v1/executor/multiproc_executor.py", 509, "get_response",
                                   'raise TimeoutError(f"RPC call to {method} timed out.") from e')],
                                 "TimeoutError: RPC call to sample_tokens timed out."))

    def worker_exception(self, frames: list, exc: str) -> None:
        """vLLM's `WorkerProc hit an exception.` and its traceback, from the first GPU worker."""
        ec = self.engine_logs[0] if self.engine_logs else ("EngineCore_DP0", os.getpid())
        worker = (self.holders[0][1][len("VLLM::"):], self.holders[0][0].pid) if self.holders else ec
        log(worker, "ERROR", "multiproc_executor.py:1189", "WorkerProc hit an exception.")
        log_raw(worker, traceback_text(frames, exc))

    def die(self, server, cause: tuple = (), engine: tuple | None = None) -> None:
        """The engine dies while serving: `cause` is (frames, exception) of the root cause logged by a
        worker, by default an illegal memory access; `engine` is (frames, exception) of the engine
        core's own fatal error, by default the RuntimeError that reports the worker's."""
        ec = self.engine_logs[0] if self.engine_logs else ("EngineCore_DP0", os.getpid())
        server.healthy = False
        error = "CUDA error: an illegal memory access was encountered"
        if cause:
            frames, exc = cause
            self.worker_exception(frames, exc)
            error = exc.split(": ", 1)[-1]
        frames, exc = engine or ([("vllm/v1/engine/core.py", 1571, "run_engine_core", "engine_core.run_busy_loop()"),
                                  ("vllm/v1/executor/multiproc_executor.py", 412, "collective_rpc",
                                   "raise RuntimeError(\"Worker failed with error\")")],
                                 f"RuntimeError: Worker failed with error '{error}', please check "
                                 "the stack trace above for the root cause")
        log(ec, "ERROR", "core.py:1590", "EngineCore encountered a fatal error.")
        log_raw(ec, traceback_text(frames, exc))
        self.stop_holders()
        log(self.api, "ERROR", "async_llm.py:693", "AsyncLLM output_handler failed.")
        log_raw(self.api, "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an "
                          "issue. See stack trace (above) for the root cause.")
        asyncio.get_running_loop().call_later(0.5, self._finish, 1)

    def _finish(self, code: int) -> None:
        if not self.ready.done():
            self.ready.set_result(code)

    def on_sigterm(self) -> None:
        """SIGTERM / SIGINT as vLLM 0.33 handles them (entrypoints/launchers/launcher.py,
        v1/engine/core.py): while loading, the process ends; once serving, the engine stops taking
        requests and drains the ones in flight for up to --shutdown-timeout (0: aborts them), then
        its workers stop and the HTTP server shuts down."""
        if self.stopping:
            return
        self.stopping = True
        if getattr(self, "ready", None) is None:
            self.stop_holders()
            os._exit(0)
        timeout = self.cfg["shutdown_timeout"]
        log(self.api, "INFO", "launcher.py:256", "[shutdown] API server: shutdown triggered")
        log(self.api, "INFO", "launcher.py:273", "[shutdown] API server: stopping engine client "
            f"mode={'drain' if timeout else 'abort'} timeout={timeout}s")
        asyncio.get_running_loop().create_task(self.shutdown(timeout))

    async def shutdown(self, timeout: int) -> None:
        ec = self.engine_logs[0] if self.engine_logs else ("EngineCore_DP0", os.getpid())
        engine, loop = self.engine, asyncio.get_running_loop()
        log(ec, "INFO", "core.py:1712", f"[shutdown] EngineCore: start mode={'drain' if timeout else 'abort'} "
            f"timeout={timeout}s")
        engine.draining = True
        count = engine.in_flight
        if timeout and count:
            log(ec, "INFO", "core.py:1731", f"[shutdown] EngineCore: draining in-flight requests count={count} "
                f"timeout={timeout}s")
            deadline = loop.time() + timeout
            while engine.in_flight and loop.time() < deadline and not engine.dead:
                await asyncio.sleep(0.05)
        if engine.in_flight:
            if not timeout:
                log(ec, "INFO", "core.py:1721", f"[shutdown] EngineCore: aborting in-flight requests "
                    f"count={engine.in_flight}")
            engine.aborting = True
            while engine.in_flight:
                await asyncio.sleep(0.02)
        log(ec, "INFO", "core.py:1745", "[shutdown] EngineCore: request processing complete; starting resource "
            "teardown")
        self.stop_holders()
        for line in ("[shutdown] API server: engine client stopped",
                     "[shutdown] API server: signalling HTTP server shutdown",
                     "[shutdown] API server: shutting down FastAPI HTTP server"):
            log(self.api, "INFO", "launcher.py:281", line)
        log_uvicorn("INFO:     Shutting down")
        log_uvicorn("INFO:     Waiting for application shutdown.")
        log_uvicorn("INFO:     Application shutdown complete.")
        self._finish(0)


# --------------------------------------------------------------------------------------------
# Multi-node: TP/PP across nodes (--nnodes/--node-rank/--master-addr/--master-port, --headless on
# ranks > 0) and data parallel across nodes (--data-parallel-size-local/-start-rank/-address/
# -rpc-port, --headless). MULTINODE_LINES is the table of what vLLM 0.33 and torch print for these
# events and where: key -> (who prints it / when, source file, pieces of the line as they stand in
# that source). vLLM paths are under the vllm package; torch's C++ messages are format strings in
# torch/lib/libtorch_cpu.so. tests/integration/vllm_contract.py checks every piece against the real
# files and that the simulator's lines carry them.
MULTINODE_LINES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "headless tp/pp start": (
        "headless TP/PP node at start, no process prefix", "vllm/entrypoints/cli/serve.py:224",
        ("Launching vLLM (v", ") headless multiproc executor, ", "with head node address ",
         " for torch.distributed process group.")),
    "headless dp start": (
        "headless DP node at start, no process prefix", "vllm/entrypoints/cli/serve.py:239",
        ("Launching ", " data parallel engine(s) in headless mode, ", "with head node address ")),
    "dp group leader": (
        "the head's engine core (TP/PP across nodes)", "vllm/v1/executor/multiproc_executor.py:167",
        ("DP group leader: node_rank=", ", node_rank_within_dp=", "master_addr=", ", mq_connect_ip=",
         " (local), ", "world_size=", ", local_world_size=")),
    "world size": (
        "every worker before its groups exist (prefix 'Worker')", "vllm/distributed/parallel_state.py:1929",
        ("world_size=", " rank=", " local_rank=", " distributed_init_method=", " backend=")),
    "rank assignment": (
        "every worker once its groups exist", "vllm/distributed/parallel_state.py:2385",
        ("rank %s in world size %s is assigned as ", "DP rank %s, PP rank %s, PCP rank %s, ",
         "TP rank %s, ETP rank %s, EP rank %s, EPLB rank %s")),
    "waiting (debug)": (
        "the head's API server while engines are missing, VLLM_LOGGING_LEVEL=DEBUG only",
        "vllm/v1/engine/utils.py:1443", ("Waiting for ", " local, ", " remote core engine proc(s) to ")),
    "connect failed": (
        "a headless rank, failed connect attempts (stderr, [W... socket.cpp:N] [c10d] prefix)",
        "torch/lib/libtorch_cpu.so", ("The client socket has failed to connect to ",)),
    "connect timeout": (
        "a headless rank that never reached the head (DistNetworkError)", "torch/lib/libtorch_cpu.so",
        ("The client socket has timed out after ", " while trying to connect to (",)),
    "join timeout": (
        "the head's rank 0 when ranks are missing (DistStoreError; elapsed = timeout + 1)",
        "torch/lib/libtorch_cpu.so", ("Timed out after ", " seconds waiting for clients. ", " clients joined.")),
    "head gone": (
        "a headless rank whose head went away while joining or loading (DistNetworkError)", "torch/lib/libtorch_cpu.so",
        ("Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?",)),
    "peer gone": (
        "the head when a rank on another node died (gloo, RuntimeError)", "torch/lib/libtorch_cpu.so",
        ("Connection closed by peer ",)),
    "worker failed to start": (
        "a worker failing before it is ready", "vllm/v1/executor/multiproc_executor.py:1057",
        ("WorkerProc failed to start.",)),
    "worker failed": (
        "a headless rank whose head went away during its start-up", "vllm/v1/executor/multiproc_executor.py:1063",
        ("WorkerProc failed.",)),
    "worker hit an exception": (
        "the head's worker whose step needed a lost node's ranks", "vllm/v1/executor/multiproc_executor.py:1189",
        ("WorkerProc hit an exception.",)),
    "rpc timeout": (
        "the head's engine core, PP across nodes, VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS after a step whose "
        "last stage was lost", "vllm/v1/executor/multiproc_executor.py:509", ("RPC call to ", " timed out.")),
    "executor init failed": (
        "the executor's process after a worker failed to start", "vllm/v1/executor/multiproc_executor.py:891",
        ("WorkerProc initialization failed due to an exception in a ", "background process. See stack trace for root cause.")),
    "worker died": (
        "a headless node's worker monitor", "vllm/v1/executor/multiproc_executor.py:380",
        ("Worker proc ", " died unexpectedly (exit code: ", "shutting down executor.")),
    "dp handshake timeout": (
        "a remote DP engine that got no answer from the head (HANDSHAKE_TIMEOUT_MINS = 5, no knob)",
        "vllm/v1/engine/core.py:1421", ("Did not receive response from front-end ", "process within ", "minutes")),
    "shutting down": ("a headless DP node at exit", "vllm/entrypoints/cli/serve.py:266", ("Shutting down.",)),
    "weights mismatch": (
        "a rank loading another revision's weights (AssertionError)",
        "vllm/model_executor/model_loader/weight_utils.py:1538", ("Attempted to load weight (", "into parameter (")),
}
# Timeouts: torch.distributed.init_process_group's timeout is ParallelConfig.distributed_timeout_seconds
# (`--distributed-timeout-seconds`, v1/worker/gpu_worker.py:1711), else torch's default for NCCL,
# 10 min; both the client's connect and the server's wait for clients use it. The simulator honours
# the flag, else VLLM_SIM_JOIN_TIMEOUT_S (a simulator knob for tests and sim hosts), else 600 s.
# VLLM_SIM_JOIN_TIMEOUT_S also shortens the DP handshake wait (vLLM's fixed 5 minutes; the line
# still says "5 minutes", as vLLM's does).
# Exit codes follow serve.py's run_headless: a start that fails raises (exit 1); once running, a
# headless node whose worker or engine died returns from its monitor and exits 0.
JOIN_TIMEOUT_ENV = "VLLM_SIM_JOIN_TIMEOUT_S"
TORCH_NCCL_TIMEOUT_S = 600.0
HANDSHAKE_TIMEOUT_MINS = 5
RECV_CLOSED = ("torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely "
               "closed. Did the remote server shutdown or crash?")
WORKER_INIT_FAILED = ("Exception: WorkerProc initialization failed due to an exception in a background "
                      "process. See stack trace for root cause.")
_TORCH_RDZV = [("vllm/v1/executor/multiproc_executor.py", 780, "__init__", "self.worker.init_device()"),
               ("vllm/v1/worker/gpu_worker.py", 504, "init_device", "init_worker_distributed_environment("),
               ("vllm/v1/worker/gpu_worker.py", 1714, "init_worker_distributed_environment",
                "init_distributed_environment("),
               ("vllm/distributed/parallel_state.py", 1976, "init_distributed_environment",
                "torch.distributed.init_process_group("),
               ("torch/distributed/distributed_c10d.py", 1892, "init_process_group",
                "store, rank, world_size = next(rendezvous_iterator)"),
               ("torch/distributed/rendezvous.py", 232, "_tcp_rendezvous_handler", "store = _create_c10d_store("),
               ("torch/distributed/rendezvous.py", 199, "_create_c10d_store", "return TCPStore(")]
GLOO_FRAMES = [("vllm/v1/worker/gpu_worker.py", 700, "determine_available_memory",
                "self.model_runner.profile_run(randomize_inputs=self.randomize_dummy_inputs)"),
               ("vllm/distributed/parallel_state.py", 1379, "barrier", "torch.distributed.barrier(group=self.cpu_group)"),
               ("torch/distributed/distributed_c10d.py", 5356, "barrier", "work.wait()")]
_BUSY_LOOP = [("vllm/v1/executor/multiproc_executor.py", 1048, "worker_main", "worker.worker_busy_loop()"),
              ("vllm/distributed/parallel_state.py", 1379, "barrier", "torch.distributed.barrier(group=self.cpu_group)"),
              ("torch/distributed/distributed_c10d.py", 5356, "barrier", "work.wait()")]
EXECUTE_FRAMES = [("vllm/v1/executor/multiproc_executor.py", 1183, "worker_busy_loop", "output = func(*args, **kwargs)"),
                  ("vllm/distributed/parallel_state.py", 1379, "barrier", "torch.distributed.barrier(group=self.cpu_group)"),
                  ("torch/distributed/distributed_c10d.py", 5356, "barrier", "work.wait()")]
_LOAD = [("vllm/v1/executor/multiproc_executor.py", 788, "__init__", "self.worker.load_model()"),
         ("vllm/v1/worker/gpu_worker.py", 601, "load_model",
          "self.model_runner.load_model(load_dummy_weights=load_dummy_weights)"),
         ("vllm/model_executor/model_loader/default_loader.py", 503, "load_weights",
          "loaded_weights = model.load_weights(self.get_all_weights(model_config, model))")]
WRONG_REVISION = (_LOAD + [("vllm/model_executor/model_loader/weight_utils.py", 1538, "default_weight_loader",
                            "assert param.size() == loaded_weight.size(), (")],
                  "AssertionError: Attempted to load weight (torch.Size([1792, 7168])) into parameter "
                  "(torch.Size([2048, 7168]))")
RANK_CRASH = (_LOAD + [("vllm/model_executor/model_loader/weight_utils.py", 1543, "default_weight_loader",
                        "param.data.copy_(loaded_weight)")],
              "torch.AcceleratorError: CUDA error: an illegal memory access was encountered")


def engine_config_line(cfg: dict) -> str:
    """The engine core's first line, `Initializing a V1 LLM engine (vX) with config: ...`."""
    return (f"Initializing a V1 LLM engine (v{VERSION}) with config: "
            f"model='{cfg['model']}', speculative_config=None, tokenizer='{cfg['model']}', "
            f"skip_tokenizer_init=False, tokenizer_mode=auto, revision=None, "
            f"trust_remote_code={cfg['trust']}, dtype=torch.bfloat16, "
            f"max_seq_len={cfg['max_model_len']}, download_dir=None, load_format=auto, "
            f"tensor_parallel_size={cfg['tp']}, pipeline_parallel_size={cfg['pp']}, "
            f"data_parallel_size={cfg['dp']}, decode_context_parallel_size={cfg['dcp']}, "
            f"enable_expert_parallel={cfg['ep']}, kv_cache_dtype={cfg['kv_dtype']}, "
            f"device_config=cuda, served_model_name={','.join(cfg['served'])}, "
            f"enable_prefix_caching=True, enable_chunked_prefill=True")


def gloo_closed(peer: tuple) -> str:
    return (f"RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
            f"peer [{peer[0]}]:{peer[1]}")


def log_bare(level: str, where: str, msg: str) -> None:
    """A line of a process vLLM does not decorate (the headless `vllm serve` itself)."""
    sys.stdout.write(f"{level} {time.strftime('%m-%d %H:%M:%S')} [{where}] {msg}\n")
    sys.stdout.flush()


def log_bare_raw(text: str) -> None:
    sys.stdout.write(text.rstrip("\n") + "\n")
    sys.stdout.flush()


def debug_logging() -> bool:
    return os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper() == "DEBUG"


def multinode_layout(a, tp: int, pp: int, dp: int) -> dict:
    """This node's share of the layout, as vLLM 0.33 derives it (engine/arg_utils.py
    create_engine_config, config/parallel.py nnodes_within_dp): its global worker ranks, its DP
    engines, and whom it waits for. The ValueErrors are vLLM's own."""
    nnodes, node_rank = int(a.nnodes or 1), int(a.node_rank or 0)
    world = tp * pp * dp
    if nnodes > 1:
        if world % nnodes:
            raise StartupFailed(
                f"ValueError: Invalid data-parallel launch options: `--nnodes {nnodes}` must evenly divide "
                f"the total world size ({world}). Adjust `--nnodes`, `--data-parallel-size`, "
                "`--pipeline-parallel-size`, `--tensor-parallel-size`, or `--prefill-context-parallel-size`.")
        if not 0 <= node_rank < nnodes:
            raise StartupFailed(
                "ValueError: Invalid data-parallel launch options: `--node-rank` must be between 0 and "
                f"{nnodes - 1}; got `--node-rank {node_rank}`. Set it to this node's zero-based index.")
    inferred = (node_rank * (world // nnodes)) // (tp * pp) if nnodes > 1 else 0
    dp_local = a.data_parallel_size_local
    dp_local = int(dp_local) if dp_local is not None else (
        max(world // nnodes // (tp * pp), 1) if nnodes > 1 else dp)
    dp_start = int(a.data_parallel_start_rank) if a.data_parallel_start_rank is not None else inferred
    nnodes_within_dp = max(1, nnodes // max(1, dp // max(dp_local, 1))) if nnodes > 1 else 1
    local_world = tp * pp // nnodes_within_dp * dp_local
    rank_within_dp = node_rank % nnodes_within_dp
    if a.headless and dp_local <= 0:
        raise StartupFailed("ValueError: data_parallel_size_local must be > 0 in headless mode")
    if os.environ.get(JOIN_TIMEOUT_ENV):
        sim_timeout = float(os.environ[JOIN_TIMEOUT_ENV])
    else:
        sim_timeout = None
    timeout = (float(a.distributed_timeout_seconds) if a.distributed_timeout_seconds is not None
               else sim_timeout or TORCH_NCCL_TIMEOUT_S)
    return {
        "nnodes": nnodes, "node_rank": node_rank, "headless": bool(a.headless),
        "master_addr": a.master_addr or "127.0.0.1", "master_port": int(a.master_port or 29501),
        "world": world, "local_world": local_world,
        "rank0": dp_start * tp * pp + rank_within_dp * (tp * pp // nnodes_within_dp),
        "engines": list(range(dp_start, dp_start + dp_local)), "engines_local": dp_local,
        "dp_start": dp_start,
        # the head's front end handshakes with every engine; remote ones come from other nodes
        "dp_remote": dp - dp_local if (dp_start == 0 and not a.headless and nnodes_within_dp == 1) else 0,
        "dp_address": a.data_parallel_address or a.master_addr or "127.0.0.1",
        "dp_rpc_port": int(a.data_parallel_rpc_port or 29550),
        "join_timeout": timeout,
        # every NCCL device group's timeout (vllm/distributed/parallel_state.py passes the same
        # --distributed-timeout-seconds, else torch's default): a rank waiting in a collective longer
        # than this is aborted by torch's watchdog
        "collective_timeout": (float(a.distributed_timeout_seconds) if a.distributed_timeout_seconds is not None
                               else TORCH_NCCL_TIMEOUT_S),
        "handshake_timeout": sim_timeout or HANDSHAKE_TIMEOUT_MINS * 60.0,
    }


def worker_titles(cfg: dict, gpus: list) -> list:
    """(process title without VLLM::, GPU) of this node's GPU workers, named by their global rank
    (setup_proc_title_and_log_prefix in v1/executor/multiproc_executor.py: Worker[_DP][_PP][_TP]
    [_DCP][_EP]); at world size 1 the engine core holds the GPU."""
    dp = cfg["dp"]
    multi = cfg["tp"] * cfg["pp"] * dp > 1
    out = []
    for rank, gpu in enumerate(gpus, start=cfg["rank0"]):     # global ranks of this node
        d, rest = divmod(rank, cfg["tp"] * cfg["pp"])
        p, t = divmod(rest, cfg["tp"])
        if multi:
            name = "Worker"
            name += f"_DP{d}" if dp > 1 else ""
            name += f"_PP{p}" if cfg["pp"] > 1 else ""
            name += f"_TP{t}" if cfg["tp"] > 1 else ""
            name += f"_DCP{t % cfg['dcp']}" if cfg["dcp"] > 1 else ""
            name += f"_EP{rank}" if cfg["ep"] else ""
        else:
            name = "EngineCore"
        out.append((name, gpu))
    return out


def log_world_lines(cfg: dict, holders: list) -> None:
    """Each worker's init_distributed_environment line, before its groups (and title) exist."""
    init = f"tcp://{cfg['master_addr']}:{cfg['master_port']}"
    for local, (p, _t, _g, _s) in enumerate(holders):
        log(("Worker", p.pid), "INFO", "parallel_state.py:1929",
            f"world_size={cfg['world']} rank={cfg['rank0'] + local} local_rank={local} "
            f"distributed_init_method={init} backend=nccl")


def log_rank_lines(cfg: dict, workers: list) -> None:
    """Each worker's groups once initialized (parallel_state.py initialize_model_parallel): ranks
    are global; expert TP is the TP group without expert parallel and a single rank with it."""
    per_dp = cfg["tp"] * cfg["pp"]
    for local, w in enumerate(workers):
        i = cfg["rank0"] + local
        tp_rank = i % cfg["tp"]
        log(w, "INFO", "parallel_state.py:2385",
            f"rank {i} in world size {cfg['world']} is assigned as DP rank {i // per_dp}, PP rank "
            f"{i % per_dp // cfg['tp']}, PCP rank 0, TP rank {tp_rank}, ETP rank "
            f"{0 if cfg['ep'] else tp_rank}, EP rank {i % (per_dp * cfg['dp']) if cfg['ep'] else 'N/A'}, "
            "EPLB rank N/A")


def c10d_warning(where: str, msg: str) -> None:
    """torch's C10D_WARNING on stderr: `[W1201 02:05:12.123456789 socket.cpp:767] [c10d] ...`."""
    t = time.time()
    lt = time.localtime(t)
    stamp = f"{lt.tm_mon}{lt.tm_mday:02d} {time.strftime('%H:%M:%S', lt)}.{int((t % 1) * 1e9):09d}"
    sys.stderr.write(f"[W{stamp} {where}] [c10d] {msg}\n")
    sys.stderr.flush()


async def connect_with_retries(addr: str, port: int, timeout: float, unreachable: bool,
                               warn: bool) -> tuple:
    """TCPStore's client connect: retry until `timeout`; TimeoutError then. `unreachable`: the
    packets go nowhere (a firewall, a wrong route): every attempt times out."""
    deadline = time.monotonic() + timeout
    next_warn, gap = time.monotonic(), 1.0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if unreachable:
            await asyncio.sleep(min(1.0, left))
            err = "(errno: 110 - Connection timed out)"
        else:
            try:
                return await asyncio.wait_for(asyncio.open_connection(addr, port), timeout=min(5.0, left))
            except (OSError, asyncio.TimeoutError) as exc:
                code = getattr(exc, "errno", None) or 110
                err = f"(errno: {code} - {os.strerror(code)})"
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        if warn and time.monotonic() >= next_warn:      # torch warns per attempt; the sim backs off
            c10d_warning("socket.cpp:767", f"The client socket has failed to connect to [{addr}]:{port} {err}.")
            next_warn, gap = time.monotonic() + gap, min(gap * 2, 30.0)


async def until_closed(reader) -> bool:
    """Read the head's messages until its connection closes; True if it had said it serves."""
    serving = False
    while True:
        try:
            line = await reader.readline()
        except (OSError, ValueError):
            line = b""
        if not line:
            return serving
        serving = serving or b'"serving"' in line


class PeerLink:
    """One other node's connection to the head: newline-delimited JSON both ways."""

    def __init__(self, reader, writer, hello: dict):
        self.reader, self.writer, self.hello = reader, writer, hello
        peer = writer.get_extra_info("peername") or ("?", 0)
        self.peer = (peer[0], peer[1])

    def send(self, msg: dict) -> None:
        try:
            self.writer.write((json.dumps(msg) + "\n").encode())
        except (OSError, RuntimeError):
            pass

    def close(self) -> None:
        """Now, not at the event loop's next turn: the caller may block next (stopping workers),
        while a dying rank's peers see its connection drop at once."""
        sock = self.writer.get_extra_info("socket")
        try:
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.writer.close()
        except (OSError, RuntimeError):
            pass


class HeadListener:
    """What the head listens with for other nodes: the TCPStore server of torch.distributed's
    rendezvous (TP/PP across nodes) or the front end's engine handshake socket (DP across nodes).
    A node joins with {"hello": its rank, "clients": its worker ranks, "engines": its DP engines}
    and says {"loaded": true, "ready": true} when it is; `expected` counts nodes (TP/PP) or remote
    engines (DP: a node brings "engines" of them). A closed connection is a dead node (`lost`
    resolves with its address)."""

    def __init__(self, host: str, port: int, expected: int):
        self.host, self.port, self.expected = host, port, expected
        self.links: dict[int, PeerLink] = {}
        self.joined = asyncio.Event()
        self.done: set = set()
        self.all_done = asyncio.Event()
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()
        self.server: asyncio.AbstractServer | None = None
        if expected <= 0:
            self.joined.set()
            self.all_done.set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self.on_conn, host=self.host, port=self.port,
                                                 reuse_address=True)

    def clients(self) -> int:
        return sum(int(link.hello.get("clients") or 1) for link in self.links.values())

    def units(self, keys) -> int:
        return sum(int(self.links[k].hello.get("engines") or 1) for k in keys if k in self.links)

    async def on_conn(self, reader, writer) -> None:
        try:
            hello = json.loads(await reader.readline() or b"null")
        except (ValueError, OSError):
            hello = None
        if not isinstance(hello, dict) or "hello" not in hello:
            writer.close()
            return
        link = PeerLink(reader, writer, hello)
        key = int(hello["hello"])
        self.links[key] = link
        if self.units(self.links) >= self.expected:
            self.joined.set()
        while True:
            try:
                line = await reader.readline()
            except (OSError, ValueError):
                line = b""
            if not line:
                break
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("loaded") or msg.get("ready"):
                self.done.add(key)
                if self.units(self.done) >= self.expected:
                    self.all_done.set()
        if not self.lost.done():
            self.lost.set_result(link.peer)

    async def all_loaded(self) -> None:
        await self.all_done.wait()

    all_ready = all_loaded

    def send_all(self, msg: dict) -> None:
        for link in self.links.values():
            link.send(msg)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for link in self.links.values():
            link.close()


LOAD_FAULTS = {"rank-crash-loading": RANK_CRASH, "wrong-revision": WRONG_REVISION}


class Headless:
    """`vllm serve ... --headless` on a node other than the head (serve.py run_headless): no API
    server. TP/PP across nodes: a multiproc executor whose workers join the head's TCPStore
    (--master-addr:--master-port) and then load their share. DP across nodes: engine cores that
    handshake with the head's front end on --data-parallel-address:--data-parallel-rpc-port.
    The connection stands for torch.distributed's: while the nodes join and load, its loss takes
    either side down; once serving (TP/PP) this node outlives its head, as the real one does."""

    def __init__(self, launch: Launch, cfg: dict):
        self.launch, self.cfg = launch, cfg
        self.dp_mode = cfg["dp"] > 1          # else TP/PP across nodes
        self.stop = asyncio.Event()
        self.running = False          # joined and loaded: the node now only watches
        self.link: PeerLink | None = None

    def spawn(self) -> list:
        launch, cfg = self.launch, self.cfg
        gpus = launch.gpus(cfg)
        if self.dp_mode:
            cores = [spawn_holder(f"VLLM::EngineCore_DP{d}", exit_with_parent=True) for d in cfg["engines"]]
            launch.engine_logs = [(f"EngineCore_DP{d}", c.pid) for d, c in zip(cfg["engines"], cores)]
            launch.aux += cores
        for name, gpu in worker_titles(cfg, gpus):
            proc = spawn_holder(f"VLLM::{name}")
            launch.holders.append((proc, f"VLLM::{name}", gpu, proc_start_time(proc.pid)))
        await_titles([(p, title) for (p, title, _g, _s) in launch.holders])
        for (p, title, gpu, st) in launch.holders:
            launch.register(p.pid, title, gpu, CUDA_CONTEXT_MIB, st)
        refresh_meminfo()
        return [(t[len("VLLM::"):], p.pid) for (p, t, _g, _s) in launch.holders]

    def start_failed(self, w0, frames: list, exc: str) -> int:
        """A worker fails before it is ready: its traceback, then the executor's, which ends
        `vllm serve` (exit 1)."""
        if self.link is not None:      # the failed ranks' connections die with them
            self.link.close()
        if self.dp_mode:
            ec = self.launch.engine_logs[0]
            log(ec, "ERROR", "core.py:1584", "EngineCore failed to start.")
            log_raw(ec, traceback_text([("vllm/v1/engine/core.py", 1556, "run_engine_core",
                                         "engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)")]
                                       + frames, exc))
            self.launch.stop_holders()
            log_bare("INFO", "serve.py:266", "Shutting down.")
            return 0
        log(w0, "ERROR", "multiproc_executor.py:1057", "WorkerProc failed to start.")
        log_raw(w0, traceback_text([("vllm/v1/executor/multiproc_executor.py", 1023, "worker_main",
                                     "worker = WorkerProc(*args, **kwargs)")] + frames, exc))
        self.launch.stop_holders()
        log_bare_raw(traceback_text(
            [("vllm/entrypoints/cli/main.py", 112, "main", "args.dispatch_function(args)"),
             ("vllm/entrypoints/cli/serve.py", 231, "run_headless",
              "executor = MultiprocExecutor(vllm_config, monitor_workers=False)"),
             ("vllm/v1/executor/multiproc_executor.py", 238, "_init_executor",
              "self.workers = WorkerProc.wait_for_ready(unready_workers)"),
             ("vllm/v1/executor/multiproc_executor.py", 913, "wait_for_ready", "raise e from None")],
            WORKER_INIT_FAILED))
        return 1

    async def run(self) -> int:
        cfg, launch = self.cfg, self.launch
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):     # run_headless catches both from the start
            loop.add_signal_handler(sig, self.on_term)
        if self.dp_mode:
            where = f"tcp://{cfg['dp_address']}:{cfg['dp_rpc_port']}"
            log_bare("INFO", "serve.py:239", f"Launching {cfg['engines_local']} data parallel engine(s) in "
                     f"headless mode, with head node address {where}.")
            addr, port, timeout = cfg["dp_address"], cfg["dp_rpc_port"], cfg["handshake_timeout"]
        else:
            log_bare("INFO", "serve.py:224", f"Launching vLLM (v{VERSION}) headless multiproc executor, "
                     f"with head node address {cfg['master_addr']}:{cfg['master_port']} for "
                     "torch.distributed process group.")
            addr, port, timeout = cfg["master_addr"], cfg["master_port"], cfg["join_timeout"]
        workers = self.spawn()
        w0 = workers[0]
        if self.dp_mode:
            self.engine_config_lines()
        else:
            log_world_lines(cfg, launch.holders)
        unreachable = launch.fault == "unreachable-head"
        try:
            reader, writer = await connect_with_retries(addr, port, timeout, unreachable,
                                                        warn=not self.dp_mode)
        except TimeoutError:
            if unreachable:
                fault_fired("unreachable-head", phase="timed out")
            if self.dp_mode:
                return self.start_failed(w0, [("vllm/v1/engine/core.py", 1421, "startup_handshake",
                                               "raise RuntimeError(")],
                                         "RuntimeError: Did not receive response from front-end process "
                                         f"within {HANDSHAKE_TIMEOUT_MINS} minutes")
            return self.start_failed(w0, _TORCH_RDZV, (
                f"torch.distributed.DistNetworkError: The client socket has timed out after "
                f"{int(timeout * 1000)}ms while trying to connect to ({addr}, {port})."))
        self.link = link = PeerLink(reader, writer, {})
        link.send({"hello": cfg["dp_start"] if self.dp_mode else cfg["node_rank"],
                   "clients": len(workers), "engines": cfg["engines_local"] if self.dp_mode else 1})
        if not self.dp_mode:
            go = await reader.readline()          # the head lets everyone go once all joined
            if not go:
                return self.start_failed(w0, _TORCH_RDZV, RECV_CLOSED)
        head_gone = asyncio.ensure_future(until_closed(reader))      # the head is gone
        log_rank_lines(cfg, workers)
        loading = asyncio.ensure_future(self.load(w0))
        done, _ = await asyncio.wait({loading, head_gone}, return_when=asyncio.FIRST_COMPLETED)
        if loading not in done:
            loading.cancel()
            return self.start_failed(w0, GLOO_FRAMES, gloo_closed(link.peer)
                                     if self.dp_mode else RECV_CLOSED)
        failure = loading.result()
        if failure:
            link.close()
            return self.start_failed(w0, *failure)
        link.send({"loaded": True, "ready": True})
        self.running = True
        stop = asyncio.ensure_future(self.stop.wait())
        dead = asyncio.ensure_future(self.watch_workers())
        done, _ = await asyncio.wait({head_gone, stop, dead}, return_when=asyncio.FIRST_COMPLETED)
        if done == {head_gone} and head_gone.result() and not self.dp_mode:
            # TP/PP across nodes, a head that goes away once it served is not noticed here, as with
            # the real vLLM (0.32, Gloo): its headless node ran on, silent, 8 minutes after its head
            # had exited (its ranks wait on the head's message queue, not on a socket). Only its own
            # worker dying, or a stop, ends it.
            done, _ = await asyncio.wait({stop, dead}, return_when=asyncio.FIRST_COMPLETED)
        for t in (stop, dead, head_gone):
            t.cancel()
        if head_gone in done and not self.stop.is_set():
            if self.dp_mode:
                ec = launch.engine_logs[0]
                log(ec, "ERROR", "core.py:1590", "EngineCore encountered a fatal error.")
                log_raw(ec, traceback_text([("vllm/v1/engine/core.py", 1571, "run_engine_core",
                                             "engine_core.run_busy_loop()")] + GLOO_FRAMES[1:],
                                           gloo_closed(link.peer)))
            else:                    # the head went away during its start-up: its collectives fail
                log(w0, "ERROR", "multiproc_executor.py:1063", "WorkerProc failed.")
                log_raw(w0, traceback_text(_BUSY_LOOP, RECV_CLOSED))
                log_bare("ERROR", "multiproc_executor.py:380", f"Worker proc {w0[0]} died unexpectedly "
                         "(exit code: 1), shutting down executor.")
        elif dead in done:
            name, code = dead.result()
            log_bare("ERROR", "multiproc_executor.py:380", f"Worker proc {name} died unexpectedly "
                     f"(exit code: {code}), shutting down executor.")
        link.close()
        launch.stop_holders()
        if self.dp_mode:
            log_bare("INFO", "serve.py:266", "Shutting down.")
        return 0

    def on_term(self) -> None:
        """SIGTERM / SIGINT: SystemExit in run_headless; the executor stops its workers (exit 0)."""
        if self.running:
            self.stop.set()
            return
        self.launch.stop_holders()
        os._exit(0)

    def engine_config_lines(self) -> None:
        cfg = self.cfg
        for ec in self.launch.engine_logs:
            log(ec, "INFO", "core.py:118", engine_config_line(cfg))

    async def load(self, w0) -> tuple | None:
        """This node's share of the weights, timed by its own page cache like the head's; a
        load fault returns (frames, exception) of the failure."""
        cfg, launch = self.cfg, self.launch
        log(w0, "INFO", "gpu_model_runner.py:4979", f"Starting to load model {cfg['model']}...")
        load = WeightLoad(cfg, w0, 1.0)
        started = load.clock = time.monotonic()
        load.start_prefetch(len(launch.holders))
        for i in range(load.count):
            await load.shard(i)
            if launch.fault in LOAD_FAULTS and i + 1 > load.count // 3:
                fault_fired(launch.fault, phase="crashed")
                return LOAD_FAULTS[launch.fault]
        n_gpu_shards = cfg["tp"] * cfg["pp"] * (cfg["dp"] if cfg["ep"] else 1)
        w_gib = cfg["size"] / n_gpu_shards / GiB
        log(w0, "INFO", "default_loader.py:507", f"Loading weights took {load.clock - started:.2f} seconds")
        log(w0, "INFO", "gpu_model_runner.py:5089",
            f"Model loading took {w_gib:.2f} GiB memory and {time.time() - launch.t0:.6f} seconds")
        if launch.fault == "slow-compile":
            extra = float(launch.fault_args.get("seconds") or 30)
            fault_fired("slow-compile", phase="compiling", seconds=extra)
            await asyncio.sleep(extra)
            log(w0, "INFO", "backends.py:418", f"Compiling a graph for compile range (1, 8192) takes {extra:.2f} s")
        for (p, title, gpu, st) in launch.holders:
            launch.register(p.pid, title, gpu, cfg["util"] * launch.total_mib(gpu) - 300, st)
        if self.dp_mode:
            for ec in launch.engine_logs:
                log(ec, "INFO", "kv_cache_utils.py:1148", "GPU KV cache size: "
                    f"{cfg['max_model_len'] * 4:,} tokens, Maximum concurrency for "
                    f"{cfg['max_model_len']:,} tokens per request: 4.00x")
        return None

    async def watch_workers(self) -> tuple:
        while True:
            for (p, title, _gpu, _st) in self.launch.holders:
                if p.poll() is not None:
                    return title[len("VLLM::"):], p.returncode
            await asyncio.sleep(0.2)


def write_run_file(cfg: dict) -> Path:
    """<hostdir>/run/vllm-<pid>.json: lets `vllm-orch sim status/down` find simulated servers."""
    run_file = HOST_DIR / "run" / f"vllm-{os.getpid()}.json"
    if run_file.parent.is_dir():
        entry = {"pid": os.getpid(), "start_time": proc_start_time(os.getpid()),
                 "process_name": "vllm serve", "model": cfg["model"], "port": cfg["port"]}
        if cfg["headless"]:
            entry.update(headless=True, node_rank=cfg["node_rank"], nnodes=cfg["nnodes"],
                         head=(f"tcp://{cfg['dp_address']}:{cfg['dp_rpc_port']}" if cfg["dp"] > 1
                               else f"{cfg['master_addr']}:{cfg['master_port']}"))
        run_file.write_text(json.dumps(entry))
    return run_file


async def run_headless(args, fault, fault_args=None) -> int:
    launch = Launch(args, fault, fault_args or {})
    run_file = None
    try:
        cfg = launch.configure()
        run_file = write_run_file(cfg)
        return await Headless(launch, cfg).run()
    except StartupFailed as exc:
        if exc.args and exc.args[0]:
            log_bare_raw(str(exc.args[0]))
        launch.stop_holders()
        return 1
    finally:
        if run_file is not None:
            run_file.unlink(missing_ok=True)


async def run_serve(args, fault, fault_args=None) -> int:
    launch = Launch(args, fault, fault_args or {})
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, launch.on_sigterm)
    run_file = None
    try:
        cfg = launch.configure()
        if cfg["api_servers"] > 1:   # the API servers are processes of their own: this is vLLM's main
            launch.api = ("MainProcess", os.getpid())
        run_file = write_run_file(cfg)
        await launch.start(cfg)
        return await launch.serve(cfg)
    except StartupFailed as exc:
        if exc.args and exc.args[0]:
            log_raw(launch.api, str(exc.args[0]))
        launch.stop_holders()
        return 1
    except OSError as exc:
        log_raw(launch.api, f"OSError: {exc}")
        launch.stop_holders()
        return 1
    finally:
        if run_file is not None:
            run_file.unlink(missing_ok=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["__sim_gpu_holder__"]:      # a holder started through the server (tests do)
        # In this process: one started as [TITLE, this file] has no usable sys.executable to exec
        # (Python looked for TITLE on PATH), so the holder program is loaded, not started.
        import importlib.util
        spec = importlib.util.spec_from_file_location("_sim_gpu_holder", HOLDER)
        assert spec is not None and spec.loader is not None, HOLDER
        holder = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(holder)
        holder.holder_main()
        return 0
    parser = build_parser()
    args = parser.parse_args(normalize_argv(argv))
    if args.subparser is None:
        parser.print_help()
        return 0
    if args.subparser != "serve":
        print(f"SIMULATED vLLM: `vllm {args.subparser}` is not simulated on this host.",
              file=sys.stderr)
        return 1
    model = args.model_tag or args.model or ""
    names = fault_names(model, list(args.served_model_name or []))
    entry = consume_fault(names) or {}
    fault = entry.get("fault")
    if fault == "crash-unrecognized-args":
        parser.error("unrecognized arguments: --enable-reasoning")
    try:
        if args.headless:
            return asyncio.run(run_headless(args, fault, entry))
        return asyncio.run(run_serve(args, fault, entry))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
