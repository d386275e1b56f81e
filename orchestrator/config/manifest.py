"""Model manifests (models/NAME.yaml): the pydantic models, their cross-field checks, and loading.

Every field has a description (docs/manifest-reference.md is generated from them) and a default that
is safe for an 8-GPU host. Unknown keys are refused with a "did you mean". Errors name the file, the
line and the field path, e.g. `models/x.yaml:12: vllm.tensor_parallel_size: ...`.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from orchestrator.config import lockfile, vllmflags
from orchestrator.config.hardware import CLASS_KEYS
from orchestrator.config.yamlsrc import YamlDoc, display_path, format_loc
from orchestrator.errors import ConfigError
from orchestrator.paths import shipped_dir

SLUG = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
RESERVED_SERVICE = "orch-gateway"        # the gateway's (host/gateway.NAME): vllm-orch-gateway.service
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# Values that end up in argv, unit files or env files must be single-line printable text.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# Environment variable names that hold credentials: they belong in `secret_env`, never in a manifest.
_SECRETISH = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|_KEY$|CREDENTIAL)", re.I)
SECRET_HINT = "list it in serving.secret_env and set it in the environment of `vllm-orch deploy` instead"
# Written by the env file template itself (templates/vllm.env.j2): rendered from manifest fields.
RENDERED_ENV = {"CUDA_VISIBLE_DEVICES": "serving.gpu_ids", "VLLM_ENGINE_READY_TIMEOUT_S": "startup.budget_seconds",
                "HF_HUB_OFFLINE": "(always 1: the weights are downloaded before the start)",
                "CUDA_DEVICE_ORDER": "(always PCI_BUS_ID: the order nvidia-smi numbers GPUs in)",
                "VLLM_SERVER_DEV_MODE": "sleep (1 with sleep mode: it opens vLLM's development endpoints, "
                                        "which --api-key does not cover)"}
# Variables vllm-orch sets in the env file (GPUs, the engine's ready timeout, offline start) or relies
# on being the host's own (what runs, what is preloaded into it): a manifest cannot override them.
RESERVED_ENV = (*RENDERED_ENV, "LD_PRELOAD", "PATH")
# Variables that change what a program loads or runs rather than how vLLM behaves: the dynamic
# loader's (LD_*), the Python interpreter's (PYTHON*: PYTHONPATH plus a sitecustomize.py in the
# model repo is code run by whoever starts Python with that environment), the rest of glibc's
# "unsecure" list (sysdeps/generic/unsecvars.h: what ld.so drops for setuid programs) and the shells'
# start-up hooks. Refused in env, service_env and secret_env: none has a place in a service's
# environment, and anything that reads the env file must not be steered by it. Not TMPDIR (it is in
# glibc's list, but names where files go, not what runs). Python's harmless switches are allowed.
DENIED_ENV_PREFIXES = ("LD_", "PYTHON")
DENIED_ENV = ("GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH",
              "MALLOC_TRACE", "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR",
              "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "IFS", "CDPATH",
              "PERL5LIB", "PERL5OPT", "PERLLIB", "RUBYLIB", "RUBYOPT", "NODE_OPTIONS", "JAVA_TOOL_OPTIONS")
ALLOWED_PYTHON_ENV = ("PYTHONUNBUFFERED", "PYTHONHASHSEED", "PYTHONFAULTHANDLER", "PYTHONDONTWRITEBYTECODE",
                      "PYTHONIOENCODING")


def denied_env(name: str) -> str | None:
    """Why `name` cannot be in a service's environment (see DENIED_ENV_PREFIXES), or None."""
    if name in ALLOWED_PYTHON_ENV:
        return None
    if name in DENIED_ENV or any(name.startswith(p) for p in DENIED_ENV_PREFIXES):
        return (f"{name} changes what programs load or run (a loader, interpreter or shell variable): it has no "
                "place in a service's environment (docs/security.md, denied variables)")
    return None
# `vllm serve` flags whose value is a credential: vLLM itself masks these fields in its logs
# (vllm/entrypoints/common/startup.py, _SENSITIVE_ARG_FIELDS). In extra_args they would be in the
# unit, the records and `ps`; serving.secret_env puts them in the 0600 env file instead.
SECRET_FLAGS = {"--api-key": "VLLM_API_KEY", "--hf-token": "HF_TOKEN", "--watermark-config": None}

DEFAULT_PORT = 8000
DEFAULT_GPU_MEMORY_UTILIZATION = 0.90
DEFAULT_STARTUP_BUDGET_S = 3600          # a 547 GB Kimi load took 36 min in the field report
DEFAULT_NO_PROGRESS_S = 600              # no new log line for 10 min: an NCCL hang looks like this
DEFAULT_ALLOW = ["*.safetensors", "*.json", "*.py", "*.txt", "*.model", "*.tiktoken", "*.jinja",
                 "*.md"]
DEFAULT_SMOKE_PROMPT = "What is 2+2? Answer with one number."
DEFAULT_SHUTDOWN_TIMEOUT_S = 30          # drain window on stop (vLLM --shutdown-timeout)
SHUTDOWN_TIMEOUT_SINCE = "0.18.0"        # vllm PR #34730 added --shutdown-timeout (released in v0.18.0)
DEFAULT_DISK_MB_S = 250.0                # field report: 547 GB in 36 min (~253 MB/s, whole start-up)
DEFAULT_CACHED_MB_S = 4000.0             # safetensors' mmap path from the page cache (InstantTensor#1)
DEFAULT_WARM_MAX_MB_S = 1000.0


def at(path: str, message: str) -> ValueError:
    """A validation error for a sub-path of the field being validated (or of the whole model, for
    cross-field checks): `at("vllm.tensor_parallel_size", "...")`. _describe_errors reads it back."""
    return ValueError(f"{_MARK}{path}{_MARK} {message}")


# The marker around at()'s path: a control character, which no YAML key can hold (yamlsrc refuses
# them), so a key with spaces or `@` (`env: {"MY VAR": 1}`) is still read back as the path.
_MARK = "\x1f"
_AT = re.compile(f"^{_MARK}([^{_MARK}]+){_MARK} (.*)$", re.S)


def _split_path(path: str) -> list:
    parts: list = []
    for piece in path.split("."):
        m = re.match(r"^([^\[]*)((\[\d+\])*)$", piece)
        name, idx = (m.group(1), m.group(2)) if m else (piece, "")
        if name:
            parts.append(name)
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", idx))
    return parts


def _check_text(value: str, what: str) -> str:
    if _CONTROL.search(value):
        raise ValueError(f"{what} must be one line of printable text (no newlines or control characters)")
    return value


def check_env_map(v: dict[str, Any], secret_hint: str = SECRET_HINT,
                  reserved: tuple[str, ...] = RESERVED_ENV) -> dict[str, str]:
    """An environment mapping that ends up in an env file or a command: names are variable names,
    values one line without single quotes, nothing that looks like a credential (those have their
    own path: `secret_hint`) and none of the `reserved` names vllm-orch sets or relies on. Shared by
    the manifest's env, its hardware classes' env and the inventory's env and service_env."""
    for key, value in v.items():
        if not ENV_NAME.match(key):
            raise at(key, f"{key!r} is not an environment variable name")
        if _SECRETISH.search(key):
            raise at(key, f"{key} looks like a secret: {secret_hint}")
        if key in reserved:
            source = f"from {RENDERED_ENV[key]}" if key in RENDERED_ENV else "(or the host relies on it)"
            raise at(key, f"{key} is written by vllm-orch {source} and cannot be overridden here")
        if reserved and (why := denied_env(key)):
            raise at(key, why)
        try:
            _check_text(str(value), "the value")
        except ValueError as exc:
            raise at(key, str(exc)) from None
        if "'" in str(value):
            raise at(key, "single quotes are not allowed in values")
    return {k: str(val) for k, val in v.items()}
def _bool_inside(annotation: Any, value: Any) -> str | None:
    """Where a YAML `true`/`false` sits in a value whose type wants numbers ("" for the value itself,
    "[i]" for an item), or None. pydantic's lax mode would read `port: true` as port 1."""
    if isinstance(value, bool):
        return "" if _wants_number(annotation) and not _wants(annotation, bool) else None
    if isinstance(value, list):
        for arg in (annotation, *typing.get_args(annotation)):      # list[int], list[int] | None
            if typing.get_origin(arg) is list and typing.get_args(arg):
                for i, item in enumerate(value):
                    if _bool_inside(typing.get_args(arg)[0], item) is not None:
                        return f"[{i}]"
    return None


def _wants(annotation: Any, kind: type) -> bool:
    if annotation is kind:
        return True
    return any(_wants(a, kind) for a in typing.get_args(annotation))


def _wants_number(annotation: Any) -> bool:
    return _wants(annotation, int) or _wants(annotation, float)


class Strict(BaseModel):
    # allow_inf_nan=False: `.inf` / `.nan` are YAML floats, never a size, a timeout or a fraction.
    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=False, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        where = _bool_inside(field.annotation, value) if field is not None else None
        if where == "":
            raise ValueError(f"expected a number, got {str(value).lower()}")
        if where is not None:
            raise at(where, f"expected a number, got {str(value[int(where[1:-1])]).lower()}")
        return value


class Source(Strict):
    """Where the weights come from."""

    repo: str = Field(description="Hugging Face repo id, e.g. `moonshotai/Kimi-K2.5`.")
    revision: str = Field(
        "main",
        description="Commit sha (40 hex characters) to download. Pin it: a moving branch such as "
                    "`main` can change the weights under a running deployment (a warning is shown). With a "
                    "branch, the plan shows the commit it resolves to and the apply downloads exactly that "
                    "commit, even if the branch moves in between.")
    allow_patterns: list[str] = Field(
        default_factory=lambda: list(DEFAULT_ALLOW),
        description="fnmatch patterns of repo files to download (huggingface_hub allow_patterns).")
    ignore_patterns: list[str] = Field(
        default_factory=list,
        description="fnmatch patterns of repo files to skip, applied after allow_patterns.")
    expected_shards: int | None = Field(
        None, ge=1, description="Number of weight shards, as documentation; the Hub's file list is the truth.")
    expected_bytes: int | None = Field(
        None, ge=1, description="Total download size in bytes, as documentation and for `vllm-orch models`; "
                                "the disk check uses the Hub's file metadata.")

    @field_validator("repo")
    @classmethod
    def _repo(cls, v: str) -> str:
        if not REPO_ID.match(v):
            raise ValueError(f"{v!r} is not a Hugging Face repo id (owner/name)")
        return v

    @field_validator("revision")
    @classmethod
    def _revision(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z0-9._/-]{1,100}$", v):
            raise ValueError(f"{v!r} is not a commit sha, branch or tag")
        return v

    @field_validator("allow_patterns", "ignore_patterns")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        for p in v:
            _check_text(p, "a pattern")
        return v

    @property
    def pinned(self) -> bool:
        return bool(COMMIT.match(self.revision))


class Serving(Strict):
    """How the service is reached and which GPUs it takes."""

    served_model_name: str | None = Field(
        None, description="Name clients use in API requests (`--served-model-name`). Default: the manifest name.")
    host: str = Field(
        "0.0.0.0",
        description="Address vLLM listens on (`--host`). Use 127.0.0.1 to keep it private to the host: "
                    "vllm-orch probes and benchmarks through the SSH connection.")
    port: int = Field(DEFAULT_PORT, ge=1, le=65535, description="HTTP port (`--port`).")
    gpus: int = Field(8, ge=1, le=64, description="Number of GPUs the service uses.")
    gpu_ids: list[int] | None = Field(
        None, description="Explicit GPU indices (CUDA_VISIBLE_DEVICES). Default: 0..gpus-1.")
    secret_env: list[str] = Field(
        default_factory=list,
        description="Names of environment variables (e.g. HF_TOKEN, VLLM_API_KEY) whose values are taken "
                    "from the environment of `vllm-orch deploy` and written to the 0600 env file - never "
                    "to the manifest, the unit, a plan or a log. Each must be set (deploy and swap "
                    "refuse, exit 2) unless it is in optional_secrets.")
    optional_secrets: list[str] = Field(
        default_factory=list,
        description="Names in secret_env the service may run without, e.g. HF_TOKEN for a public repo: when "
                    "one is not set in the environment of `vllm-orch deploy`, the env file says so in a "
                    "comment. Listing VLLM_API_KEY here lets vLLM serve without authentication. `regen` "
                    "keeps the installed value of a secret it is not given.")

    @field_validator("served_model_name")
    @classmethod
    def _served(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$", v):
            raise ValueError(f"{v!r}: use letters, digits and . _ : / - only")
        return v

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        if not re.match(r"^[0-9A-Za-z.:-]+$", v):
            raise ValueError(f"{v!r} is not an address")
        return v

    @field_validator("gpu_ids")
    @classmethod
    def _gpu_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            if len(set(v)) != len(v):
                raise ValueError(f"GPU ids must be unique, got {v}")
            if any(i < 0 for i in v):
                raise ValueError(f"GPU ids must be >= 0, got {v}")
        return v

    @field_validator("secret_env")
    @classmethod
    def _secret_names(cls, v: list[str]) -> list[str]:
        for i, name in enumerate(v):
            if not ENV_NAME.match(name):
                raise at(f"[{i}]", f"{name!r} is not an environment variable name")
            if name in RESERVED_ENV:
                raise at(f"[{i}]", f"{name} is written by vllm-orch (or the host relies on it) and cannot be "
                                   f"overridden")
            if why := denied_env(name):
                raise at(f"[{i}]", why)
        return v

    @model_validator(mode="after")
    def _optional_listed(self) -> Serving:
        for i, name in enumerate(self.optional_secrets):
            if name not in self.secret_env:
                raise at(f"optional_secrets[{i}]", f"{name} is not in serving.secret_env")
        return self

    @property
    def visible_devices(self) -> list[int]:
        return list(self.gpu_ids) if self.gpu_ids is not None else list(range(self.gpus))


# The layout: fields that decide how many GPUs do what. A hardware class may not change them (a
# different layout is a different deployment, with its own manifest and expected figures).
LAYOUT_FIELDS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                 "enable_expert_parallel", "decode_context_parallel_size")


class VllmArgs(Strict):
    """`vllm serve` arguments. Typed fields for the common ones; `extra_args` for the rest."""

    tensor_parallel_size: int = Field(1, ge=1, le=64, description="`--tensor-parallel-size`: GPUs that split every layer.")
    pipeline_parallel_size: int = Field(1, ge=1, le=64,
                                        description="`--pipeline-parallel-size`: GPUs that split the layer stack.")
    data_parallel_size: int = Field(1, ge=1, le=64, description="`--data-parallel-size`: independent replicas (with expert "
                                                                "parallel: attention DP).")
    enable_expert_parallel: bool = Field(False, description="`--enable-expert-parallel`: shard MoE experts across TP x DP GPUs "
                                                            "(EP size = TP x DP).")
    decode_context_parallel_size: int = Field(
        1, ge=1, le=64,
        description="`--decode-context-parallel-size`: split the KV cache of long contexts across the TP "
                    "GPUs (must divide tensor_parallel_size). DCP=8 takes Kimi-K2.5 FP8 KV from ~450K to ~3.6M tokens.")
    max_model_len: int | None = Field(None, ge=128, description="`--max-model-len`: longest context in tokens. Default: the "
                                                                "model's.")
    gpu_memory_utilization: float = Field(
        DEFAULT_GPU_MEMORY_UTILIZATION, gt=0.0, le=0.99,
        description="`--gpu-memory-utilization`: fraction of each GPU's memory vLLM may take.")
    kv_cache_dtype: str | None = Field(None, description="`--kv-cache-dtype`, e.g. `fp8` (halves KV memory).")
    attention_backend: str | None = Field(None, description="`--attention-backend`, e.g. `TRITON_MLA` (SM120 MLA with FP8 KV). "
                                                            "Replaces the VLLM_ATTENTION_BACKEND env var that vLLM >= 0.26 "
                                                            "ignores.")
    moe_backend: str | None = Field(None, description="`--moe-backend`, e.g. `marlin`, `triton`, `flashinfer_cutlass`. Replaces "
                                                      "VLLM_FLASHINFER_MOE_BACKEND.")
    trust_remote_code: bool = Field(False, description="`--trust-remote-code`: run the repo's model code. Kimi-K2.5 and "
                                                       "MiniMax-M2.5 need it.")
    tool_call_parser: str | None = Field(None, description="`--tool-call-parser`, e.g. `kimi_k2`, `minimax_m2`.")
    reasoning_parser: str | None = Field(None, description="`--reasoning-parser`, e.g. `kimi_k2`, `minimax_m2`: thinking goes to "
                                                           "`reasoning_content`.")
    enable_auto_tool_choice: bool = Field(False, description="`--enable-auto-tool-choice` (needs tool_call_parser).")
    compilation_config: dict[str, Any] | None = Field(
        None, description="`--compilation-config` as a mapping, passed as JSON, e.g. `{cudagraph_mode: PIECEWISE}`.")
    max_num_seqs: int | None = Field(None, ge=1, description="`--max-num-seqs`: most sequences in one batch.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="`--max-num-batched-tokens`: token budget per scheduler "
                                                                       "step.")
    enable_prefix_caching: bool | None = Field(None, description="`--enable-prefix-caching` / `--no-enable-prefix-caching`. "
                                                                 "Default: vLLM's.")
    load_format: str | None = Field(None, description="`--load-format`, e.g. `fastsafetensors` (needs that package on the host: "
                                                      "preflight checks).")
    safetensors_load_strategy: Literal["lazy", "eager", "prefetch", "torchao"] | None = Field(
        None,
        description="`--safetensors-load-strategy` (vLLM >= 0.33). `prefetch`: vLLM reads the checkpoint "
                    "into the page cache in background threads while it loads, i.e. after the old model "
                    "stopped (it helps when the disk is faster than the loader, not when the disk is the "
                    "limit); vllm-orch's warm-up reads before the stop (docs/operations.md, Warm swaps). "
                    "Default: vLLM's (memory-mapped, prefetch only on NFS/Lustre).")
    mm_encoder_tp_mode: str | None = Field(None, description="`--mm-encoder-tp-mode`, e.g. `data` (vision encoder "
                                                             "data-parallel). Not with language_model_only.")
    language_model_only: bool = Field(False, description="`--language-model-only`: skip the vision encoder to free VRAM.")
    async_scheduling: bool | None = Field(None, description="`--async-scheduling` / `--no-async-scheduling`. Default: vLLM's.")
    shutdown_timeout: int = Field(
        DEFAULT_SHUTDOWN_TIMEOUT_S, ge=0, le=3600,
        description="`--shutdown-timeout`: on stop, vLLM stops taking requests and lets the ones in flight "
                    "finish for up to this many seconds (0: abort them). The unit's TimeoutStopSec is this "
                    "plus the teardown time. A sleep swap drains the requests in flight for as long "
                    "(`/sleep?mode=wait`, then `mode=abort`). Needs vLLM >= 0.18.0 (vllm PR #34730) unless 0.")
    extra_args: list[str] = Field(
        default_factory=list,
        description="Further `vllm serve` arguments, one token per item (`[--max-num-seqs, '256']`). Each "
                    "item is one argv entry: quoting is never needed and nothing is passed to a shell. "
                    "Options are checked as vLLM reads them (`--tensor_parallel_size` is "
                    "`--tensor-parallel-size`, `-tp` too): one a typed field or the serving section "
                    "renders, one that takes a secret, or `--config` (a file of further options), is refused, "
                    "and so is an abbreviation "
                    "(`--api-k`): write options in full.")

    @field_validator("kv_cache_dtype", "attention_backend", "moe_backend", "tool_call_parser",
                     "reasoning_parser", "load_format", "mm_encoder_tp_mode")
    @classmethod
    def _word(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^[A-Za-z0-9_.-]+$", v):
            raise ValueError(f"{v!r}: expected one word (letters, digits, _ . -)")
        return v

    @field_validator("extra_args")
    @classmethod
    def _extra(cls, v: list[str]) -> list[str]:
        for i, item in enumerate(v):
            try:
                _check_text(item, "each extra_args item")
            except ValueError as exc:
                raise at(f"[{i}]", str(exc)) from None
        return v

    @model_validator(mode="after")
    def _cross(self) -> VllmArgs:
        if self.tensor_parallel_size % self.decode_context_parallel_size:
            raise at("decode_context_parallel_size",
                f"decode_context_parallel_size ({self.decode_context_parallel_size}) must divide "
                f"tensor_parallel_size ({self.tensor_parallel_size})")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise at("enable_auto_tool_choice", "enable_auto_tool_choice needs tool_call_parser (vLLM refuses to start without "
                                                "it)")
        if self.language_model_only and self.mm_encoder_tp_mode:
            raise at("language_model_only", "language_model_only cannot be combined with mm_encoder_tp_mode "
                             "(there is no vision encoder to place)")
        # Compared as vLLM reads them (config/vllmflags.py): `--tensor_parallel_size`, `-tp` and
        # `--no-trust-remote-code` are the typed fields' options; an abbreviation is refused.
        typed = {"--" + f.replace("_", "-"): f for f in type(self).model_fields if f != "extra_args"}
        for i, item in enumerate(self.extra_args):
            option, problem = vllmflags.resolve(item)
            if problem is not None:
                raise at(f"extra_args[{i}]", problem)
            flag = option or vllmflags.normalise(item)
            spelled = item.split("=", 1)[0]
            sets = flag if spelled == flag else f"{flag} (as {spelled})"
            if flag in typed:
                raise at(f"extra_args[{i}]", f"extra_args sets {sets}; use the field vllm.{typed[flag]} instead")
            if flag in ("--served-model-name", "--port", "--host", "--model"):
                raise at(f"extra_args[{i}]", f"extra_args sets {sets}; it is rendered from the serving section")
            if flag == "--config":
                # vLLM's FlexibleArgumentParser reads the file's keys as options before anything else
                # (vllm/utils/argparse_utils.py, _pull_args_from_config): trust-remote-code, api-key,
                # served-model-name and every other option this check refuses, set past it.
                raise at(f"extra_args[{i}]", f"extra_args sets {sets}: vLLM would read further options from "
                                             "that file, past every check of the manifest; write them here")
            if flag == "--disable-log-stats" and not vllmflags.normalise(spelled).startswith("--no-"):
                # vLLM then registers no vllm:* series (vllm/v1/engine/async_llm.py: no stat loggers)
                raise at(f"extra_args[{i}]", f"extra_args sets {sets}: vLLM then exports no vllm:* series, and "
                                             "the health timer could no longer tell a long prefill from a hang "
                                             "(it would restart a busy server), nor status, bench and monitor "
                                             "read the engine; leave the stats on")
            if flag == "--enable-sleep-mode":
                raise at(f"extra_args[{i}]", f"extra_args sets {sets}; use the manifest's sleep section "
                                             "(it also guards the endpoints sleep mode needs)")
            if flag in SECRET_FLAGS:
                var = SECRET_FLAGS[flag]
                how = (f"list {var} in serving.secret_env and set it in the environment of `vllm-orch "
                       f"deploy` (it goes to the 0600 env file only)") if var else \
                    "put the file holding it on the host and pass its path"
                raise at(f"extra_args[{i}]", f"{sets} takes a secret, which would be visible in the unit, "
                                             f"the records and `ps`: {how}")
        return self

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size


class Startup(Strict):
    """How long start-up may take, and when silence means a hang."""

    budget_seconds: int = Field(
        DEFAULT_STARTUP_BUDGET_S, ge=10,
        description="Most seconds from start to ready (weights + compile + graphs). Also sets "
                    "VLLM_ENGINE_READY_TIMEOUT_S and the unit's TimeoutStartSec.")
    no_progress_seconds: int = Field(
        DEFAULT_NO_PROGRESS_S, ge=5,
        description="Fail when the service log shows no new line for this long (an NCCL hang looks like that).")
    restart_delay_seconds: int = Field(
        60, ge=1, le=3600,
        description="systemd RestartSec: wait this long before restarting a service that failed.")
    start_attempts: int = Field(
        3, ge=1, le=10,
        description="systemd StartLimitBurst: starts (the first one and the automatic restarts) before the "
                    "unit stays `failed`. The window is sized to this many full start-up budgets, so a "
                    "failure late in a long load cannot restart forever.")


class Loading(Strict):
    """How fast the weights load, and the page-cache warm-up that makes a swap's load read from RAM.

    The rates size the plan's expected downtime with and without warming. Declare what you
    measured on your host: `vllm-orch history` shows each start's downtime and what the warm-up did."""

    disk_mb_s: float = Field(
        DEFAULT_DISK_MB_S, gt=0,
        description="MB/s (10^6 bytes) at which vLLM loads these weights when they are not in the page "
                    "cache. Default 250: the field report's 547 GB Kimi-K2.5 start in 36 min, all of "
                    "it counted as reading.")
    cached_mb_s: float = Field(
        DEFAULT_CACHED_MB_S, gt=0,
        description="MB/s at which vLLM loads weights that are in the page cache. Default 4000: the "
                    "safetensors mmap path from the page cache measures about 4 GB/s (scitix/InstantTensor#1); "
                    "vLLM's multi-thread loader reached 6.2 GB/s on 2x RTX PRO 6000 "
                    "(vllm-project/vllm-omni#4896).")
    other_seconds: float = Field(
        0, ge=0,
        description="Seconds of start-up that do not depend on the page cache (torch.compile, CUDA graph "
                    "capture, KV-cache profiling, the readiness gates). Default 0: not declared, so the "
                    "expected downtimes cover the weights only.")
    cpu_memory_gib: float | None = Field(
        None, ge=0,
        description="CPU memory (GiB) the service takes once started (worker processes, pinned buffers, "
                    "CPU offload). The warm-up leaves it free so the start does not evict the warmed "
                    "pages. Default: the host's cpu_memory_per_gpu_gib (12) per GPU.")
    warm_max_mb_s: float = Field(
        DEFAULT_WARM_MAX_MB_S, gt=0,
        description="Fastest the warm-up reads (MB/s), so that its reads and the kernel's page reclaim do "
                    "not compete with the serving model.")


class Probes(Strict):
    """Readiness gates after start: health, model listed, then a real chat completion."""

    health_path: str = Field("/health", description="Path that answers 200 when the engine is alive.")
    smoke_prompt: str = Field(DEFAULT_SMOKE_PROMPT, description="User message of the smoke-test chat completion.")
    smoke_expect: str = Field(
        r"\b4\b", description="Regular expression the answer's content must match (case-insensitive).")
    smoke_max_tokens: int = Field(
        512, ge=1, le=32768,
        description="max_tokens of the smoke test. Reasoning models think first: leave room for it.")
    smoke_timeout_seconds: int = Field(120, ge=1, description="Time allowed for the smoke completion.")
    health_interval_seconds: int = Field(
        30, ge=1, le=3600,
        description="The health timer (systemd hosts) probes the running service this often: /health and a "
                    "one-token completion.")
    health_timeout_seconds: int = Field(
        30, ge=1, le=600,
        description="Time the health timer's one-token completion may take. A timeout while /metrics shows "
                    "the engine stepping (the KV cache filling during a long prefill, tokens or requests "
                    "moving) is a busy server, not a failure (a `health-busy` history record).")
    health_failures: int = Field(
        3, ge=1, le=100,
        description="Failed health checks in a row after which the service is restarted (recorded in the "
                    "history with the reason).")

    @field_validator("health_path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not re.match(r"^/[A-Za-z0-9/_.-]*$", v):
            raise ValueError(f"{v!r} must be a URL path starting with /")
        return v

    @field_validator("smoke_expect")
    @classmethod
    def _regex(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        return v


class Performance(Strict):
    """The throughput the deployment is expected to reach. After the smoke test, deploy and swap
    measure it with a short run (seconds) and warn or fail when it comes up far below."""

    single_stream_tok_s: float | None = Field(
        None, gt=0, description="Decode tokens/s of one stream (as `bench` reports tok_s_user: tokens after "
                                "the first / time from first to last token). Unset: not measured.")
    concurrency: int | None = Field(
        None, ge=2, le=256, description="A number of concurrent streams whose aggregate throughput is also "
                                        "measured (with concurrency_tok_s).")
    concurrency_tok_s: float | None = Field(
        None, gt=0, description="Aggregate output tokens/s expected at `concurrency` streams (all tokens / "
                                "time from the first request sent to the last token).")
    floor: float = Field(
        0.75, gt=0, le=1,
        description="Fraction of an expected figure below which a measurement counts as far below "
                    "(0.75: with 79 tok/s expected, under 59.25 tok/s).")
    on_below: Literal["warn", "fail"] = Field(
        "warn", description="`warn`: record it and say so; `fail`: the deploy fails (a swap rolls back).")
    max_tokens: int = Field(
        256, ge=16, le=8192, description="Tokens each measuring request generates (ignore_eos, so exactly "
                                         "this many): 256 at 80 tok/s is about 3 s.")
    timeout_seconds: int = Field(
        120, ge=5, description="Longest wait for a measuring stream to connect or send its next bytes; "
                               "a stream that stalls longer gives no figure (which counts as far below).")
    slo_ttft_p95_seconds: float | None = Field(
        None, gt=0, description="The service's time-to-first-token objective: `vllm-orch monitor` writes an "
                                "alert when the p95 TTFT (vLLM's histogram) stays above it. Unset: no such alert.")

    @model_validator(mode="after")
    def _pair(self) -> Performance:
        if (self.concurrency is None) != (self.concurrency_tok_s is None):
            raise at("concurrency", "concurrency and concurrency_tok_s go together")
        return self

    @property
    def expects(self) -> bool:
        return self.single_stream_tok_s is not None or self.concurrency is not None


class HardwareNeeds(Strict):
    """What the model needs on one hardware class (the host's GPUs pick the class)."""

    vllm: dict[str, Any] = Field(
        default_factory=dict,
        description="`vllm` fields for this class, replacing the manifest's, e.g. `{attention_backend: "
                    "TRITON_MLA}`. Any field but the layout (tensor/pipeline/data/decode-context parallel "
                    "sizes, expert parallel): a different layout is a different manifest.")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Service environment for this class, added to the manifest's env (a name set in both "
                    "takes this value). Not for secrets.")
    min_vllm_version: str | None = Field(
        None, description="Oldest vLLM that runs this manifest on this class; replaces "
                          "requires.min_vllm_version there.")
    performance: Performance | None = Field(
        None, description="Expected throughput on this class; replaces the manifest's `performance` there.")

    @field_validator("vllm")
    @classmethod
    def _vllm(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key in v:
            if key in LAYOUT_FIELDS:
                raise at(key, f"{key} is part of the layout, which a hardware class cannot change: "
                              "write a manifest for the other layout")
            if key not in VllmArgs.model_fields:
                close = difflib.get_close_matches(key, list(VllmArgs.model_fields), n=1, cutoff=0.6)
                raise at(key, "unknown field" + (f" - did you mean {close[0]!r}?" if close else ""))
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env_map(v)

    @field_validator("min_vllm_version")
    @classmethod
    def _version(cls, v: str | None) -> str | None:
        return v if v is None else _version_text(v)


def _version_text(v: str) -> str:
    if not re.match(r"^\d+(\.\d+){0,3}$", v):
        raise ValueError(f"{v!r} is not a version like 0.19.1")
    return v


class Requirements(Strict):
    """What the host must have. Checked before anything is changed on it."""

    gpu_name: str | None = Field(
        None, description="Substring the GPU name must contain, e.g. `RTX PRO 6000` (nvidia-smi's name). "
                          "Prefer `hardware`, which also says what differs per class.")
    hardware: dict[str, HardwareNeeds] = Field(
        default_factory=dict,
        description="The hardware classes this manifest runs on, each with what it needs there "
                    f"(keys: {', '.join(CLASS_KEYS)}). The GPUs the service uses pick the class; a host "
                    "of another class is refused. Empty: any GPU.")
    vram_per_gpu_gib: float = Field(0, ge=0, description="Least memory per GPU, in GiB (nvidia-smi memory.total).")
    min_vllm_version: str = Field("0.0.0", description="Oldest vLLM that runs this manifest, e.g. `0.19.1`.")
    disk_reserve_gib: float = Field(
        20, ge=0, description="Free space to keep on the models disk after the download, in GiB.")

    @field_validator("min_vllm_version")
    @classmethod
    def _version(cls, v: str) -> str:
        return _version_text(v)

    @field_validator("hardware")
    @classmethod
    def _classes(cls, v: dict[str, HardwareNeeds]) -> dict[str, HardwareNeeds]:
        for key in v:
            if key not in CLASS_KEYS:
                close = difflib.get_close_matches(key, CLASS_KEYS, n=1, cutoff=0.5)
                raise at(key, f"{key!r} is not a hardware class" +
                         (f" - did you mean {close[0]!r}?" if close else f" (known: {', '.join(CLASS_KEYS)})"))
        return v

    @model_validator(mode="after")
    def _one_way(self) -> Requirements:
        if self.gpu_name and self.hardware:
            raise at("gpu_name", "use requires.hardware or requires.gpu_name, not both (the hardware "
                                 "classes already say which GPUs)")
        return self


# Environment a multi-node service's env file gets per node (render/artifacts.py): from the
# inventory's cluster settings of that host, never from the manifest (it differs per node). The
# NCCL/Gloo interface names may be set for every node (all hosts name the NIC alike) or per host
# (hosts.NAME.cluster.interface); render refuses the two disagreeing.
NODE_ENV = ("VLLM_HOST_IP",)


# The ports the nodes of a multi-node service meet at, on the head: the one a layout uses
# (cluster_port_name) is derived from the placement when the manifest does not set it, vLLM's (Ray's)
# own default plus the head's first GPU index, so several services on disjoint GPUs of one head get
# distinct ports (a host's services never share a GPU), and never torchrun's 29500. What a run derived
# is recorded with the service and kept by later runs while its head's GPUs stay (config/placement.py).
PORT_BASES = {"master_port": 29501, "dp_rpc_port": 29550, "ray_port": 6379}
# What vllm-orch rendered before the ports were derived: a record without cluster_ports keeps these.
LEGACY_PORTS = {"master_port": 29500, "dp_rpc_port": 13345, "ray_port": 6379}


def derived_port(name: str, head_gpus: Sequence[int]) -> int:
    """The default of multinode.NAME for a service whose head runs on `head_gpus`."""
    return PORT_BASES[name] + (min(head_gpus) if head_gpus else 0)


class MultiNode(Strict):
    """One service across several hosts (docs/multi-node.md). The selected hosts are its nodes, in
    order (`deploy M --host gpu1,gpu2`: gpu1 is the head, rank 0). serving.gpus stays GPUs PER NODE,
    so tensor x pipeline x data = nodes x serving.gpus. With vllm.data_parallel_size > 1 the nodes
    split the data-parallel ranks (vLLM's `--data-parallel-size-local` ranks each); otherwise the
    tensor/pipeline group spans the nodes (`--nnodes`, `--node-rank`, `--master-addr`)."""

    nodes: int = Field(
        description="How many hosts the service spans (>= 2). A deploy must select exactly this many; "
                    "the first is the head: it runs the API server, the others run headless.")
    backend: Literal["mp", "ray"] = Field(
        "mp", description="`mp`: vLLM's own multiprocessing runtime; the nodes meet over "
                          "torch.distributed at the head's master_port (or data_parallel_size > 1: "
                          "its dp_rpc_port). `ray`: a Ray cluster (the head runs `ray start --head`, "
                          "the others `ray start --address HEAD:ray_port`, a `ray-SERVICE.service` unit "
                          "on systemd hosts) and vLLM on the head only, with "
                          "`--distributed-executor-backend ray`. Ray needs the `ray` executable beside "
                          "`vllm` in every host's venv.")
    master_port: int | None = Field(
        None, ge=1, le=65535,
        description="mp, tensor/pipeline parallel across nodes: `--master-port`, the TCP port on the "
                    "head that every node's torch.distributed rendezvous connects to (the head's rank 0 "
                    "serves torch's TCPStore there). Default: derived from the placement, 29501 (vLLM's "
                    "default; torchrun's is 29500) + the head's first GPU index, and recorded: two "
                    "services on GPUs 0-3 and 4-7 of the same head get 29501 and 29505.")
    dp_rpc_port: int | None = Field(
        None, ge=1, le=65535,
        description="Data parallel across nodes: `--data-parallel-rpc-port`, the head's port the "
                    "headless data-parallel engines hand-shake with. Default: derived from the "
                    "placement, 29550 (vLLM 0.33's default) + the head's first GPU index, and recorded.")
    ray_port: int | None = Field(
        None, ge=1, le=65535,
        description="ray: the head's Ray GCS port (`ray start --head --port`). Default: derived from the "
                    "placement, 6379 (Ray's default) + the head's first GPU index, and recorded.")
    join_timeout_seconds: int = Field(
        300, ge=10, le=86400,
        description="How long vllm-orch's readiness wait gives every node's ranks to join the head "
                    "(tensor/pipeline parallel across nodes: each node's log says its ranks joined) "
                    "before the deploy fails naming the nodes that did not (a firewall, a wrong "
                    "cluster.address, a node that crashed while starting). vllm-orch's own wait, not a "
                    "vLLM flag: vLLM's `--distributed-timeout-seconds` also times every NCCL collective "
                    "(collective_timeout_seconds).")
    collective_timeout_seconds: int | None = Field(
        None, ge=600, le=86400,
        description="Every node's `--distributed-timeout-seconds`: in vLLM 0.33 the timeout of "
                    "torch.distributed's rendezvous AND of every NCCL device group, so of every "
                    "collective (a rank waiting for a peer that still compiles is aborted after it). "
                    "Default: the larger of torch's 600 s NCCL default and loading.other_seconds (the "
                    "declared compile and graph time); never below either. Data parallel across nodes: "
                    "the engines' handshake with the head waits VLLM_ENGINE_READY_TIMEOUT_S (the env "
                    "file sets it to startup.budget_seconds), not this.")

    @model_validator(mode="after")
    def _ports(self) -> MultiNode:
        seen: dict[int, str] = {}
        for name, port in self.ports.items():
            if port in seen:
                raise at(name, f"{name} {port} is also multinode.{seen[port]}: every port needs its own number")
            seen[port] = name
        return self

    @property
    def ports(self) -> dict[str, int]:
        """The ports the manifest sets (the others are derived from the placement)."""
        ports = {"master_port": self.master_port, "dp_rpc_port": self.dp_rpc_port, "ray_port": self.ray_port}
        return {name: port for name, port in ports.items() if port is not None}

    def port(self, name: str, head_gpus: Sequence[int]) -> int:
        """The port NAME (master_port, dp_rpc_port, ray_port): the manifest's, else derived from the
        head's GPUs (derived_port)."""
        return self.ports.get(name) or derived_port(name, head_gpus)


# A version as pip writes one (PEP 440's public part, a local label allowed: 0.33.0, 2.10.0+cu130,
# 0.6.1rc1, 1.0.post2): what reaches a requirements line and a folder name, so nothing else.
PKG_VERSION = re.compile(r"^[0-9]{1,4}(\.[0-9]{1,6}){0,4}((a|b|rc)[0-9]{1,4})?(\.post[0-9]{1,4})?(\.dev[0-9]{1,8})?"
                         r"(\+[a-z0-9]{1,20}(\.[a-z0-9]{1,20}){0,3})?$")
# A distribution name (PEP 508), which pip normalizes (PEP 503: lowercase, runs of -_. as one -).
PKG_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,98}[A-Za-z0-9])?$")
# A vLLM wheel from an https address: its file name (PEP 427) says the version. No query, fragment,
# credentials or spaces: the address goes into a requirements file as `vllm @ URL`.
VLLM_WHEEL_URL = re.compile(r"^https://[A-Za-z0-9.-]{1,253}(:[0-9]{1,5})?(/[A-Za-z0-9._~%+-]{1,200}){0,20}"
                            r"/vllm-(?P<version>[0-9][A-Za-z0-9.+%]{0,60})-[A-Za-z0-9._+-]{1,200}\.whl$")
ENGINE_PYTHON = re.compile(r"^3\.(9|1[0-9])$")
# Packages with a field of their own in `engine:` (flashinfer's two halves are one field).
ENGINE_OWN = ("vllm", "torch", "flashinfer-python", "flashinfer-cubin")


pkg_key = lockfile.key      # a distribution name as pip compares them (PEP 503)


class Engine(Strict):
    """The vLLM build a service runs (docs/operations.md, "Engines"): one locked set of packages,
    installed into a venv of its own on the host (content-addressed: two services with the same
    lock share it). Absent: the service runs the inventory's `vllm`."""

    vllm: str = Field(
        description="The vLLM version (`0.33.0`), or an https address of a vLLM wheel "
                    "(`https://.../vllm-0.33.0+cu130-cp38-abi3-manylinux_2_35_x86_64.whl`) under one of the "
                    "host's `wheel_url_prefixes` (else refused).")
    torch: str | None = Field(
        None, description="torch's version, pinned (e.g. `2.10.0`). Empty: whatever the vLLM version requires, "
                          "resolved when the venv is built (the lock then names only what is pinned).")
    flashinfer: str | None = Field(
        None, description="flashinfer-python AND flashinfer-cubin at this one version: the two must match, "
                          "or start-up fails after the weights have loaded.")
    packages: dict[str, str] = Field(
        default_factory=dict,
        description="Other packages the model needs, pinned: name -> version (e.g. `transformers: 4.57.1`).")
    python: str = Field("3.12", description="The venv's Python version (3.9 - 3.19), found on the host by uv.")
    lock_file: str | None = Field(
        None, description="A hashed lock beside the manifest (a path relative to its folder, e.g. "
                          "`kimi-k25-int4.lock`): the file `uv pip compile --generate-hashes` writes, every package "
                          "of the venv (the transitive ones too) pinned with its sha256. The venv is then installed "
                          "with `--require-hashes`: a wheel whose bytes differ from the lock, or a package it does "
                          "not list, is refused. It must pin this section's versions. Hosts with "
                          "`require_hashes: true` build no engine without one (docs/operations.md, \"Engines\").")
    locked: list[str] = Field(
        default_factory=list,
        description="Filled by vllm-orch from lock_file when it reads the manifest (its requirements, one "
                    "canonical line each): not written in a manifest.")

    @field_validator("vllm")
    @classmethod
    def _vllm(cls, v: str) -> str:
        if v.startswith("https://"):
            if not VLLM_WHEEL_URL.match(v):
                raise ValueError(f"{v[:80]!r} is not an https address of a vLLM wheel "
                                 "(.../vllm-VERSION-...whl, no query, fragment or credentials)")
            version = urllib.parse.unquote(VLLM_WHEEL_URL.match(v).group("version"))  # type: ignore[union-attr]
            if not PKG_VERSION.match(version):
                raise ValueError(f"{version[:40]!r} (from the wheel's name) is not a version like 0.33.0")
            return v
        if not PKG_VERSION.match(v):
            raise ValueError(f"{v[:40]!r} is not a version like 0.33.0 nor an https address of a vLLM wheel")
        return v

    @field_validator("torch", "flashinfer")
    @classmethod
    def _pinned(cls, v: str | None) -> str | None:
        if v is not None and not PKG_VERSION.match(v):
            raise ValueError(f"{v[:40]!r} is not a version like 2.10.0")
        return v

    @field_validator("packages")
    @classmethod
    def _packages(cls, v: dict[str, str]) -> dict[str, str]:
        seen: dict[str, str] = {}
        for name, version in v.items():
            if not PKG_NAME.match(name):
                raise at(name, f"{name[:40]!r} is not a package name")
            if pkg_key(name) in ENGINE_OWN:
                raise at(name, f"{name} has its own field in engine: (vllm, torch, flashinfer)")
            if pkg_key(name) in seen:
                raise at(name, f"{name} is also listed as {seen[pkg_key(name)]}")
            seen[pkg_key(name)] = name
            if not isinstance(version, str) or not PKG_VERSION.match(version):
                raise at(name, f"{str(version)[:40]!r} is not a pinned version like 4.57.1")
        return v

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        if not ENGINE_PYTHON.match(v):
            raise ValueError(f"{v[:20]!r} is not a Python version like 3.12")
        return v

    @field_validator("lock_file")
    @classmethod
    def _lock_file(cls, v: str | None) -> str | None:
        if v is not None and (not LOCK_FILE.match(v) or ".." in v.split("/")):
            raise ValueError(f"{v[:80]!r} is not a file name beside the manifest (a relative path without `..`)")
        return v

    @model_validator(mode="after")
    def _locked_pins(self) -> Engine:
        """The lock installs the versions this section pins (a lock of other versions would build a venv
        the section does not describe)."""
        if self.lock_file and not self.locked:
            raise ValueError("engine.lock_file is read when the manifest file is loaded (load_manifest)")
        if self.locked and not self.lock_file:
            raise ValueError("engine.locked is written by vllm-orch from engine.lock_file: name the lock file")
        if not self.locked:
            return self
        have = lockfile.pins(self.locked)
        want = {"vllm": f"@ {self.vllm}" if self.vllm.startswith("https://") else self.vllm}
        if self.torch:
            want["torch"] = self.torch
        if self.flashinfer:
            want |= {"flashinfer-python": self.flashinfer, "flashinfer-cubin": self.flashinfer}
        want |= {pkg_key(n): v for n, v in self.packages.items()}
        for name, version in want.items():
            if have.get(name) != version:
                raise ValueError(f"{self.lock_file} locks {name} {have.get(name) or '(not at all)'}, this "
                                 f"section {version}: compile the lock again from these pins")
        urls = sorted(n for n, v in have.items() if v.startswith("@") and n != "vllm")
        if urls:
            raise ValueError(f"{self.lock_file} installs {urls[0]} from a URL: only engine.vllm may be one")
        return self

    @property
    def vllm_version(self) -> str:
        """The vLLM version the lock installs (a wheel's, from its file name)."""
        m = VLLM_WHEEL_URL.match(self.vllm)
        return urllib.parse.unquote(m.group("version")) if m else self.vllm


LOOPBACK = ("127.0.0.1", "::1", "localhost")
LOCK_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/-]{0,200}$")


class Sleep(Strict):
    """vLLM's sleep mode: the service can be put to sleep (its GPUs freed) and woken in seconds."""

    level: Literal[1, 2] = Field(
        description="1: a sleep copies the weights to host RAM (a wake copies them back: seconds; "
                    "needs their size in free RAM); 2: a sleep drops them (a wake reads them again "
                    "from the page cache or the disk). Renders --enable-sleep-mode and "
                    "VLLM_SERVER_DEV_MODE=1, which opens vLLM's development endpoints (/sleep, "
                    "/wake_up, /collective_rpc, /update_weights, ...) that --api-key does not cover: "
                    "so serving.host must be a loopback address (docs/security.md).")


class Manifest(Strict):
    """A deployable model: what to download, how to run vLLM, how to know it works."""

    name: str = Field(description="Model name: a lowercase slug equal to the file name without .yaml.")
    description: str = Field("", description="One line shown by `vllm-orch models`.")
    source: Source = Field(description="Hugging Face repo, revision and which files to download.")
    serving: Serving = Field(default_factory=Serving, description="Port, served name and GPUs.")
    vllm: VllmArgs = Field(default_factory=VllmArgs, description="`vllm serve` arguments.")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables for the service (NCCL_*, VLLM_*...). Not for secrets: "
                    "see serving.secret_env. Not loader, interpreter or shell variables (LD_*, PYTHONPATH "
                    "and the other PYTHON* but a few harmless switches, GCONV_PATH, BASH_ENV, ...: "
                    "docs/security.md).")
    startup: Startup = Field(default_factory=Startup, description="Start-up budget and hang detection.")
    loading: Loading = Field(default_factory=Loading,
                             description="Load rates (expected downtime) and the page-cache warm-up.")
    probes: Probes = Field(default_factory=Probes, description="Readiness gates and smoke test.")
    requires: Requirements = Field(default_factory=Requirements, description="Host requirements.")
    performance: Performance = Field(
        default_factory=Performance,
        description="Expected throughput, measured after the smoke test (a floor: warn or fail when far below).")
    engine: Engine | None = Field(
        None, description="The vLLM build this service runs, in a venv of its own on the host (vLLM version "
                          "or wheel, the pinned torch, flashinfer and other packages, the Python). Absent: "
                          "the host's `vllm` (inventory).")
    multinode: MultiNode | None = Field(
        None, description="One service across several hosts: how many, vLLM's runtime (mp or ray) and "
                          "the ports the nodes meet at. Absent: the service runs on one host.")
    sleep: Sleep | None = Field(
        None, description="vLLM's sleep mode (`swap --sleep-old` puts the service to sleep instead of "
                          "stopping it, and a swap back wakes it). Absent: the service is stopped.")

    @property
    def cluster_port_name(self) -> str | None:
        """The multinode port this layout's nodes meet at on the head (None: one host): Ray's GCS
        (backend ray), the data-parallel handshake (data parallel across nodes), else the
        torch.distributed rendezvous (tensor/pipeline parallel across nodes)."""
        mn = self.multinode
        if mn is None:
            return None
        if mn.backend == "ray":
            return "ray_port"
        return "dp_rpc_port" if self.vllm.data_parallel_size > 1 else "master_port"

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not SLUG.match(v):
            raise ValueError(f"{v!r} is not a lowercase slug (a-z, 0-9, -; starts with a letter or digit)")
        if v == RESERVED_SERVICE:
            raise ValueError(f"{v!r} is the gateway's service name (unit vllm-{v}.service): pick another")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env_map(v)

    @model_validator(mode="after")
    def _cross(self) -> Manifest:
        s, v = self.serving, self.vllm
        if s.gpu_ids is not None and len(s.gpu_ids) != s.gpus:
            raise at("serving.gpu_ids", f"serving.gpu_ids lists {len(s.gpu_ids)} GPUs but serving.gpus is {s.gpus}")
        if self.sleep is not None:
            if self.multinode is not None:
                raise at("sleep", "sleep mode is for a service on one host: a multi-node service is "
                                  "stopped and started")
            if s.host not in LOOPBACK:
                raise at("sleep", f"sleep mode needs serving.host 127.0.0.1 (it is {s.host}): "
                                  "VLLM_SERVER_DEV_MODE=1 opens /sleep, /wake_up, /collective_rpc and "
                                  "/update_weights to every client that reaches the port, outside "
                                  "--api-key (its guarded prefixes are /v1, /v2, /inference, /cohere); "
                                  "reach the service through a proxy or an SSH tunnel "
                                  "(docs/security.md)")
        if self.multinode is not None:
            self._check_multinode()
        elif v.world_size != s.gpus:
            raise at("vllm.tensor_parallel_size",
                f"parallel sizes use {v.world_size} GPUs (tensor {v.tensor_parallel_size} x pipeline "
                f"{v.pipeline_parallel_size} x data {v.data_parallel_size}) but serving.gpus is {s.gpus}")
        if re.search(r"minimax-m2", self.source.repo, re.I) and v.tensor_parallel_size == 8 \
                and not v.enable_expert_parallel:
            raise at("vllm.tensor_parallel_size",
                "MiniMax-M2.5 does not support pure TP8: intermediate_size / 8 = 192 is not divisible by "
                "the FP8 block size 128 (vllm recipes). Use tensor_parallel_size 4, or 8 with "
                "enable_expert_parallel, or data_parallel_size 8 with enable_expert_parallel")
        envs = [("env", self.env)] + [(f"requires.hardware.{k}.env", h.env)
                                      for k, h in self.requires.hardware.items()]
        for where, env in envs:
            for name in ("VLLM_ATTENTION_BACKEND", "VLLM_FLASHINFER_MOE_BACKEND"):
                if name in env:
                    repl = "vllm.attention_backend" if "ATTENTION" in name else "vllm.moe_backend"
                    raise at(f"{where}.{name}", f"{name} is ignored or removed in current vLLM; use {repl}")
            for name in self.serving.secret_env:
                if name in env:
                    raise at(f"{where}.{name}", f"{name} is in both {where} and serving.secret_env")
            for name, source in RENDERED_ENV.items():
                if name in env:
                    raise at(f"{where}.{name}", f"{name} is written by vllm-orch from {source}")
        for key, needs in self.requires.hardware.items():
            if needs.vllm:
                try:
                    VllmArgs.model_validate({**self.vllm.model_dump(), **needs.vllm})
                except ValidationError as exc:
                    err = exc.errors()[0]
                    msg = err["msg"].removeprefix("Value error, ")
                    marked = _AT.match(msg)
                    sub = ".".join(str(p) for p in err["loc"]) or (marked.group(1) if marked else "")
                    text = marked.group(2) if marked else msg
                    raise at(f"requires.hardware.{key}.vllm" + (f".{sub}" if sub else ""),
                             f"on {key}: {text}") from None
        floor = _version_tuple(self.requires.min_vllm_version)     # 0.0.0: not declared (preflight asks the host)
        if v.shutdown_timeout and any(floor) and floor < _version_tuple(SHUTDOWN_TIMEOUT_SINCE):
            raise at("vllm.shutdown_timeout",
                     f"--shutdown-timeout needs vLLM >= {SHUTDOWN_TIMEOUT_SINCE} (vllm PR #34730) but "
                     f"requires.min_vllm_version is {self.requires.min_vllm_version}: raise it, or set 0")
        if self.engine is not None and any(floor):
            have = re.match(r"^[0-9.]*[0-9]", self.engine.vllm_version)
            if have and _version_tuple(have.group(0)) < floor:
                raise at("engine.vllm", f"vLLM {self.engine.vllm_version} is older than requires.min_vllm_version "
                                        f"{self.requires.min_vllm_version}")
        return self

    def _check_multinode(self) -> None:
        mn, s, v = self.multinode, self.serving, self.vllm
        assert mn is not None
        if mn.nodes < 2:
            raise at("multinode.nodes", f"nodes is {mn.nodes}: a multi-node service spans at least 2 hosts "
                                        "(remove the multinode section for one host)")
        if v.world_size != mn.nodes * s.gpus:
            raise at("multinode.nodes",
                     f"parallel sizes use {v.world_size} GPUs (tensor {v.tensor_parallel_size} x pipeline "
                     f"{v.pipeline_parallel_size} x data {v.data_parallel_size}) but nodes x serving.gpus "
                     f"(GPUs per node) is {mn.nodes} x {s.gpus} = {mn.nodes * s.gpus}")
        if v.data_parallel_size > 1 and v.data_parallel_size % mn.nodes:
            raise at("multinode.nodes",
                     f"data_parallel_size {v.data_parallel_size} does not split evenly over {mn.nodes} nodes: "
                     "each node runs data_parallel_size / nodes data-parallel ranks")
        if v.data_parallel_size > 1 and mn.backend == "ray":
            raise at("multinode.backend", "data parallel across nodes runs on vLLM's own runtime: use "
                                          "backend mp (the ray backend spans tensor/pipeline parallel only)")
        if mn.collective_timeout_seconds is not None and mn.collective_timeout_seconds < self.loading.other_seconds:
            raise at("multinode.collective_timeout_seconds",
                     f"collective_timeout_seconds {mn.collective_timeout_seconds} is below loading.other_seconds "
                     f"{self.loading.other_seconds:g}: a rank waiting in a collective while a peer compiles "
                     "would be aborted")
        if mn.join_timeout_seconds >= self.startup.budget_seconds:
            raise at("multinode.join_timeout_seconds",
                     f"join_timeout_seconds {mn.join_timeout_seconds} must be shorter than startup.budget_seconds "
                     f"{self.startup.budget_seconds}: the nodes join during the start-up, and the load comes after")
        for name, port in mn.ports.items():
            if port == s.port:
                raise at(f"multinode.{name}", f"{name} {port} is also serving.port, the head's HTTP port")
        envs = [("env", self.env)] + [(f"requires.hardware.{k}.env", h.env) for k, h in self.requires.hardware.items()]
        for (where, env), name in ((e, n) for e in envs for n in NODE_ENV):
            if name in env:
                raise at(f"{where}.{name}", f"{name} differs per node: it is written from the inventory "
                                            "(hosts.NAME.cluster.address) into each node's env file")

    @property
    def served_name(self) -> str:
        return self.serving.served_model_name or self.name

    @property
    def unit_name(self) -> str:
        return f"vllm-{self.name}.service"


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


# -- loading ------------------------------------------------------------------------------------

def models_dir(explicit: Path | None = None) -> Path:
    """--models DIR, else $VLLM_ORCH_MODELS, else ./models, else the shipped models."""
    if explicit is not None:
        if not explicit.is_dir():
            raise ConfigError(f"--models {explicit}: no such folder")
        return explicit
    env = os.environ.get("VLLM_ORCH_MODELS")
    if env:
        if not Path(env).is_dir():
            raise ConfigError(f"VLLM_ORCH_MODELS={env}: no such folder")
        return Path(env)
    local = Path("models")
    if local.is_dir() and any(local.glob("*.yaml")):
        return local
    return shipped_dir("models")


def _describe_errors(exc: ValidationError, doc: YamlDoc, root: type[BaseModel]) -> list[str]:
    lines = []
    # Misspelt keys first: a typo usually explains the "missing" error reported next to it.
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    for err in errors:
        loc = [p for p in err["loc"]]
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        marked = _AT.match(msg)
        if marked:
            loc += _split_path(marked.group(1))
            msg = marked.group(2)
        where = doc.line_of(loc)
        prefix = f"{doc.display}:{where}" if where else doc.display
        if err["type"] == "extra_forbidden":
            msg = "unknown field" + _did_you_mean(root, loc)
        elif err["type"] == "missing":
            msg = "required field is missing"
        path = format_loc(loc)
        lines.append(f"{prefix}: {path}: {msg}" if path else f"{prefix}: {msg}")
    return lines


def _did_you_mean(root: type[BaseModel], loc: list[Any]) -> str:
    """Suggest the closest valid field name for an unknown key at loc (walking nested models and
    dict[str, Model] mappings such as the inventory's hosts)."""
    model: type[BaseModel] = root
    parts = list(loc[:-1])
    i = 0
    while i < len(parts):
        field = model.model_fields.get(str(parts[i])) if isinstance(parts[i], str) else None
        ann = getattr(field, "annotation", None) if field else None
        optional = [a for a in typing.get_args(ann) if a is not type(None)] if ann is not None else []
        if len(optional) == 1 and isinstance(optional[0], type) and issubclass(optional[0], BaseModel):
            ann = optional[0]                   # `MultiNode | None`: the section's own fields
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model, i = ann, i + 1
            continue
        args = typing.get_args(ann) if ann is not None else ()
        if typing.get_origin(ann) is dict and args and isinstance(args[-1], type) \
                and issubclass(args[-1], BaseModel):
            model, i = args[-1], i + 2          # skip the mapping's key (e.g. the host name)
            continue
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
    if close:
        return f" - did you mean {close[0]!r}?"
    return f" (valid: {', '.join(model.model_fields)})"


def validation_error(exc: ValidationError, doc: YamlDoc, what: str,
                     root: type[BaseModel] | None = None) -> ConfigError:
    lines = _describe_errors(exc, doc, root or Manifest)
    extra = f" (and {len(lines) - 1} more problems)" if len(lines) > 1 else ""
    return ConfigError(lines[0] + extra, details=lines[1:],
                       hint=f"`vllm-orch schema{'' if what == 'manifest' else ' --hosts'}` lists every field; "
                            f"see docs/manifest-reference.md")


def load_manifest(path: Path) -> Manifest:
    doc = YamlDoc(path, display_path(path))
    data = doc.data
    if data is None:
        raise ConfigError(f"{doc.display}: the file is empty")
    if not isinstance(data, dict):
        raise ConfigError(f"{doc.display}: expected a mapping of fields, got {type(data).__name__}")
    stem = path.stem
    if "name" not in data:
        data = {"name": stem, **data}
    elif data["name"] != stem:
        line = doc.line_of(["name"])
        raise ConfigError(f"{doc.display}:{line}: name: {data['name']!r} must equal the file name {stem!r}",
                          hint=f"rename the file to {data['name']}.yaml or the name to {stem}")
    engine = data.get("engine")
    if isinstance(engine, dict) and ("lock_file" in engine or "locked" in engine):
        data = {**data, "engine": read_lock(engine, path, doc)}
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, doc, "manifest") from None


def read_lock(engine: dict, path: Path, doc: YamlDoc) -> dict:
    """The `engine:` mapping with `locked` read from its lock_file (beside the manifest; validated by
    the Engine model: a relative name without `..`)."""
    if "locked" in engine:
        raise ConfigError(f"{doc.display}:{doc.line_of(['engine', 'locked'])}: engine.locked is written by "
                          "vllm-orch from engine.lock_file", hint="name the lock file in engine.lock_file")
    name = engine["lock_file"]
    if not isinstance(name, str) or not LOCK_FILE.match(name) or ".." in name.split("/"):
        return engine                   # the model's validator says what is wrong, at its line
    file = path.parent / name
    where = f"{doc.display}:{doc.line_of(['engine', 'lock_file'])}: engine.lock_file"
    try:
        if not file.is_file():
            raise ConfigError(f"{where}: {display_path(file)} is not a file",
                              hint="write it with `uv pip compile --generate-hashes` (docs/operations.md, "
                                   "\"Engines\")")
        text = file.read_bytes()[:lockfile.MAX_BYTES + 1].decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: {display_path(file)} cannot be read: {exc}") from None
    return {**engine, "locked": lockfile.parse(text, display_path(file))}


def manifest_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.yaml") if not p.name.startswith("."))


def load_all(folder: Path) -> tuple[dict[str, Manifest], list[ConfigError]]:
    """Every manifest of a folder; bad ones are returned as errors, not raised."""
    good, bad = {}, []
    for path in manifest_files(folder):
        try:
            m = load_manifest(path)
            good[m.name] = m
        except ConfigError as err:
            bad.append(err)
    return good, bad


def get_manifest(name: str, folder: Path) -> tuple[Manifest, Path]:
    path = folder / f"{name}.yaml"
    if not path.is_file():
        names = [p.stem for p in manifest_files(folder)]
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}?" if close else f"known models: {', '.join(names) or '(none)'}"
        raise ConfigError(f"no model named {name!r} in {display_path(folder)}", hint=hint)
    return load_manifest(path), path


def manifest_schema() -> dict:
    schema = Manifest.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "vllm-orch model manifest"
    return schema
