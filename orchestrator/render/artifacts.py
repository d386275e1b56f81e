"""Rendering, pure: (manifest, host) -> vLLM argv, systemd unit (or start script) and env file.

No I/O besides reading templates. The argv is a list (never a string glued with spaces) and each
token remembers the manifest field it came from, so the host's vLLM parser errors can be reported
against `vllm.extra_args[2]` rather than a flag name.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import jinja2

from orchestrator import __version__
from orchestrator.config import checkpoints
from orchestrator.config.engine import vllm_path
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest
from orchestrator.config.placement import NodeRole, ray_node_ports
from orchestrator.errors import ConfigError
from orchestrator.paths import package_file, shipped_dir
from orchestrator.secret import Secret, reveal

TEARDOWN_S = 90            # after the drain: engine cores and workers exit, GPU memory is released
START_LIMIT_MARGIN_S = 60
PROBE_NAME = "vllm-orch-probe.py"   # orchestrator/host/remote/unit_probe.py, as installed on the host
# The units' probe reads the API key from this credential (LoadCredential= of the 0600 env file), never
# from its environment; it exits RESTART_EXIT when its unit's root part is to record and restart, and
# the health check BUSY_EXIT (a success: SuccessExitStatus=) when it first finds the engine busy but
# stepping, for the root part to record. unit_probe.py has the same three constants.
CREDENTIAL = "service-env"
RESTART_EXIT = 75
BUSY_EXIT = 76

# The compile and JIT caches of every unit that runs vLLM's workers (vllm.service.j2, and ray.service.j2:
# Ray's workers on the head are the raylet's children), under the unit's CacheDirectory=vllm-orch.
CACHE_ENV = ("Environment=VLLM_CACHE_ROOT=%C/vllm-orch/vllm TRITON_CACHE_DIR=%C/vllm-orch/triton "
             "TORCHINDUCTOR_CACHE_DIR=%C/vllm-orch/inductor\n"
             "Environment=FLASHINFER_WORKSPACE_BASE=%C/vllm-orch CUDA_CACHE_PATH=%C/vllm-orch/nv "
             "XDG_CACHE_HOME=%C/vllm-orch/xdg")

# What templates/vllm.env.j2 writes besides the manifest's env and secrets: never secret (the last
# three: a node of a multi-node service, from the inventory's cluster settings; node_env below).
ORCH_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "VLLM_ENGINE_READY_TIMEOUT_S", "HF_HUB_OFFLINE",
            "VLLM_SERVER_DEV_MODE", "VLLM_HOST_IP", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")

# Secrets only vLLM's HTTP server reads (vllm/entrypoints: the API key middleware): not written to
# the env file of a worker node of a multi-node service, which serves no HTTP.
HTTP_SECRETS = ("VLLM_API_KEY",)

_SYSTEMD_PLAIN = re.compile(r"^[A-Za-z0-9_@+=:,./-]+$")
_ENV_PLAIN = re.compile(r"^[A-Za-z0-9_@%+=:,./-]*$")


def systemd_quote(arg: str) -> str:
    """One ExecStart word: `%` and `$` escaped (specifiers, variable expansion), quoted if needed."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if _SYSTEMD_PLAIN.match(arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_start(argv: list[str]) -> str:
    """ExecStart value, one flag (with its values) per continuation line, for humans reading diffs."""
    lines, current = [], [systemd_quote(a) for a in argv[:3]]
    for arg in argv[3:]:
        if arg.startswith("-") and current:
            lines.append(" ".join(current))
            current = []
        current.append(systemd_quote(arg))
    lines.append(" ".join(current))
    return " \\\n    ".join(lines)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DQ_ESCAPE = re.compile(r'(["\\`$])')


def env_value(value: str) -> str:
    """A value for an EnvironmentFile that `sh` (`. file`) and systemd read the same way: plain,
    in single quotes, or (holding a single quote) in double quotes with `" \\ ` $` escaped by a
    backslash, the only escapes both know inside double quotes (POSIX sh; systemd's env-file
    parser, systemd.exec(5) EnvironmentFile=). One line: a control character is refused."""
    if _CONTROL.search(value):
        raise ValueError("environment values must be one line without control characters")
    if _ENV_PLAIN.match(value):
        return value
    if "'" not in value:
        return f"'{value}'"
    return '"' + _DQ_ESCAPE.sub(r"\\\1", value) + '"'


_ENV_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def read_env_values(text: str) -> dict[str, str]:
    """The assignments of an env file this module wrote (env_value's three forms), as values."""
    out = {}
    for line in text.splitlines():
        m = _ENV_LINE.match(line)
        if not m:
            continue
        raw = m.group(2)
        if len(raw) >= 2 and raw[0] == raw[-1] == "'":
            value = raw[1:-1]
        elif len(raw) >= 2 and raw[0] == raw[-1] == '"':
            value = re.sub(r'\\(["\\`$])', r"\1", raw[1:-1])
        else:
            value = raw
        out[m.group(1)] = value
    return out


def templates_dir() -> Path:
    override = os.environ.get("VLLM_ORCH_TEMPLATES")
    return Path(override) if override else shipped_dir("templates")


@lru_cache(maxsize=4)
def _environment(folder: str) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(folder), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    env.filters["shquote"] = lambda v: shlex.quote(str(v))
    # A unit value from the inventory or the manifest: `%` is a systemd specifier (%h: home...).
    env.filters["unitvalue"] = lambda v: str(v).replace("%", "%%")
    env.filters["shjoin"] = lambda argv: " ".join(shlex.quote(str(a)) for a in argv)
    return env


def _template(name: str) -> jinja2.Template:
    return _environment(str(templates_dir())).get_template(name)


@dataclass
class RenderedFile:
    """A file to install. `text` is what users see (secrets masked); `data()` is what is written."""

    path: str
    text: str
    mode: int
    _secret_text: str | None = field(default=None, repr=False)

    def data(self) -> bytes:
        return (self._secret_text if self._secret_text is not None else self.text).encode()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


@dataclass
class Rendered:
    manifest: Manifest
    host: HostEntry
    argv: list[str]
    provenance: list[tuple[str, str]]      # (argv token, manifest field path)
    model_dir: str
    unit: RenderedFile                     # systemd unit, or the start script on `process` hosts
    env_file: RenderedFile
    manifest_hash: str

    extra: list[RenderedFile] = field(default_factory=list)   # systemd: health check units, probe
    role: NodeRole | None = None           # a node of a multi-node service; None: a one-host service
    model: str = ""                        # the model served (its manifest): m.name unless --name

    @property
    def folder(self) -> str:
        """Its weights folder's name under models_root (checkpoints.folder_for: shared per checkpoint)."""
        return self.model_dir.rstrip("/").rsplit("/", 1)[-1]

    @property
    def runs_vllm(self) -> bool:
        """Whether the unit runs `vllm serve` (preflight checks its argv with the host's parser): not
        on a Ray worker node, whose unit runs `ray start --address` and vLLM reaches it through Ray."""
        return not is_ray_worker(self.manifest, self.role)

    @property
    def files(self) -> list[RenderedFile]:
        return [self.env_file, self.unit, *self.extra]

    @property
    def unit_hash(self) -> str:
        return hashlib.sha256("".join(f.text for f in [self.unit, self.env_file, *self.extra]).encode()).hexdigest()


def manifest_hash(m: Manifest) -> str:
    """sha256 of the manifest's values that differ from the defaults: a new schema field with a
    default (added by a later vllm-orch) leaves the hash, and so the installed units, unchanged."""
    return hashlib.sha256(m.model_dump_json(exclude_defaults=True).encode()).hexdigest()


def model_dir(folder: str, host: HostEntry) -> str:
    """The weights folder FOLDER under models_root (config/checkpoints.py names it)."""
    return f"{host.models_root}/{folder}"


def default_folder(m: Manifest, model: str) -> str:
    """The folder a manifest's weights go to when no host says otherwise (a bare render, a new
    host): its checkpoint's shared folder when pinned, else the model's own (checkpoints.folder_for
    with nothing on the host)."""
    return checkpoints.folder_for(m.source.repo, m.source.revision, m.source.pinned, model, None, {})


def ray_executable(m: Manifest, host: HostEntry) -> str:
    """`ray` beside the vllm executable (the same venv: Ray's version must be the one vLLM imports)."""
    vllm = vllm_path(m, host)
    return str(Path(vllm).with_name("ray")) if "/" in vllm else "ray"


def ray_unit_name(m: Manifest) -> str:
    """The head's Ray unit of a multi-node service with backend ray."""
    return f"ray-{m.name}.service"


def is_ray_worker(m: Manifest, role: NodeRole | None) -> bool:
    return role is not None and not role.head and m.multinode is not None and m.multinode.backend == "ray"


def _check_role(m: Manifest, host: HostEntry, role: NodeRole | None) -> None:
    if role is None:
        return
    if m.multinode is None:
        raise ConfigError(f"{m.name} is not a multi-node manifest: it has no node roles")
    if len(role.nodes) != m.multinode.nodes or not 0 <= role.rank < len(role.nodes):
        raise ConfigError(f"{m.name}: node rank {role.rank} of {len(role.nodes)} nodes does not fit "
                          f"multinode.nodes {m.multinode.nodes}")


def meet_port(m: Manifest, name: str) -> int:
    """multinode.NAME (master_port, dp_rpc_port, ray_port) as rendered: the value config/effective.py
    resolved for the service (the manifest's, the recorded one, or derived from the head's GPUs);
    rendered without a service value (a bare manifest): derived from its own GPUs."""
    assert m.multinode is not None
    return m.multinode.port(name, m.serving.visible_devices)


def _ray_argv(m: Manifest, host: HostEntry, role: NodeRole) -> list[tuple[str, str]]:
    """`ray start` of a node: the head's GCS, or a worker joining it; --block keeps it in the
    foreground for systemd."""
    assert m.multinode is not None
    port = meet_port(m, "ray_port")
    out = [(ray_executable(m, host), "engine.vllm" if m.engine else "host.vllm"), ("start", "(command)")]
    if role.head:
        out += [("--head", "(node rank)"), ("--port", "multinode.ray_port"), (str(port), "multinode.ray_port")]
    else:
        out += [("--address", "(head ray address)"), (f"{role.head_address}:{port}", "(head ray address)")]
    out += [("--node-ip-address", "host.cluster.address"), (host.node_address(m.name), "host.cluster.address")]
    for name, value in ray_node_ports(m.serving.visible_devices, role.head).items():     # pinned per service
        out += [(f"--{name.replace('_', '-')}", "(this node's GPUs)"), (str(value), "(this node's GPUs)")]
    out += [("--disable-usage-stats", "(always)"), ("--block", "(always)")]
    return out


def ray_argv(m: Manifest, host: HostEntry, role: NodeRole) -> list[str]:
    return [t for t, _ in _ray_argv(m, host, role)]


def _node_flags(m: Manifest, role: NodeRole) -> list[tuple[str, str]]:
    """The flags that make one node's `vllm serve` a rank of the multi-node service."""
    mn, v = m.multinode, m.vllm
    assert mn is not None
    out: list[tuple[str, str]] = []

    def add(field_path: str, *tokens: object) -> None:
        out.extend((str(t), field_path) for t in tokens)

    if mn.backend == "ray":             # the head only (workers run `ray start`): Ray places the workers
        add("multinode.backend", "--distributed-executor-backend", "ray")
    elif v.data_parallel_size > 1:      # data parallel across nodes: each node runs its share of DP ranks
        local = v.data_parallel_size // mn.nodes
        add("multinode.nodes", "--data-parallel-size-local", local)
        add("(head cluster address)", "--data-parallel-address", role.head_address)
        add("multinode.dp_rpc_port", "--data-parallel-rpc-port", meet_port(m, "dp_rpc_port"))
        if not role.head:
            add("(node rank)", "--data-parallel-start-rank", role.rank * local)
            add("(node rank)", "--headless")
        add("multinode.collective_timeout_seconds", "--distributed-timeout-seconds", collective_timeout(m))
    else:                               # tensor/pipeline parallel across nodes: one torch.distributed group
        add("multinode.nodes", "--nnodes", mn.nodes)
        add("(node rank)", "--node-rank", role.rank)
        add("(head cluster address)", "--master-addr", role.head_address)
        add("multinode.master_port", "--master-port", meet_port(m, "master_port"))
        if not role.head:
            add("(node rank)", "--headless")
        # vLLM's ParallelConfig.distributed_timeout_seconds: init_process_group's timeout (the store's wait
        # for the ranks) AND every NCCL device group's (vllm/distributed/parallel_state.py,
        # get_distributed_timeout_or_none): never the join wait, which is vllm-orch's own
        add("multinode.collective_timeout_seconds", "--distributed-timeout-seconds", collective_timeout(m))
    return out


TORCH_NCCL_TIMEOUT_S = 600      # torch.distributed's default timeout of an NCCL process group


def collective_timeout(m: Manifest) -> int:
    """Every node's --distributed-timeout-seconds: the manifest's collective_timeout_seconds, else
    the larger of torch's NCCL default and the declared compile time (loading.other_seconds); never
    below either (a rank waiting in a collective for a peer that still compiles must not abort)."""
    assert m.multinode is not None
    declared = m.multinode.collective_timeout_seconds or 0
    return max(TORCH_NCCL_TIMEOUT_S, math.ceil(m.loading.other_seconds), declared)


def build_argv(m: Manifest, host: HostEntry, role: NodeRole | None = None,
               model: str | None = None, folder: str | None = None) -> tuple[list[str], list[tuple[str, str]]]:
    """The argv the service's unit runs and, for each token, the manifest field that produced it:
    `vllm serve ...`; for a node of a multi-node service (role) with its rank's flags; on a Ray worker
    node, `ray start --address HEAD:PORT` (vLLM runs on the head only). `model`: the model whose
    weights folder it serves, when the service has another name (--name; default m.name); `folder`:
    that folder under models_root (default_folder when None)."""
    _check_role(m, host, role)
    if role is not None and is_ray_worker(m, role):
        ray = _ray_argv(m, host, role)
        return [t for t, _ in ray], ray
    out: list[tuple[str, str]] = []

    def add(field_path: str, *tokens: object) -> None:
        out.extend((str(t), field_path) for t in tokens)

    v, s = m.vllm, m.serving
    add("engine.vllm" if m.engine else "host.vllm", vllm_path(m, host))
    add("(command)", "serve")
    add("name", model_dir(folder or default_folder(m, model or m.name), host))
    add("serving.served_model_name", "--served-model-name", m.served_name)
    add("serving.host", "--host", s.host)
    add("serving.port", "--port", s.port)
    add("vllm.tensor_parallel_size", "--tensor-parallel-size", v.tensor_parallel_size)
    if v.pipeline_parallel_size != 1:
        add("vllm.pipeline_parallel_size", "--pipeline-parallel-size", v.pipeline_parallel_size)
    if v.data_parallel_size != 1:
        add("vllm.data_parallel_size", "--data-parallel-size", v.data_parallel_size)
    if v.enable_expert_parallel:
        add("vllm.enable_expert_parallel", "--enable-expert-parallel")
    if v.decode_context_parallel_size != 1:
        add("vllm.decode_context_parallel_size", "--decode-context-parallel-size", v.decode_context_parallel_size)
    if role is not None:
        out.extend(_node_flags(m, role))
    if v.max_model_len is not None:
        add("vllm.max_model_len", "--max-model-len", v.max_model_len)
    add("vllm.gpu_memory_utilization", "--gpu-memory-utilization", f"{v.gpu_memory_utilization:g}")
    for name in ("kv_cache_dtype", "attention_backend", "moe_backend", "load_format",
                 "safetensors_load_strategy", "mm_encoder_tp_mode"):
        value = getattr(v, name)
        if value is not None:
            add(f"vllm.{name}", "--" + name.replace("_", "-"), value)
    if v.language_model_only:
        add("vllm.language_model_only", "--language-model-only")
    if v.trust_remote_code:
        add("vllm.trust_remote_code", "--trust-remote-code")
    if v.tool_call_parser:
        add("vllm.tool_call_parser", "--tool-call-parser", v.tool_call_parser)
    if v.enable_auto_tool_choice:
        add("vllm.enable_auto_tool_choice", "--enable-auto-tool-choice")
    if v.reasoning_parser:
        add("vllm.reasoning_parser", "--reasoning-parser", v.reasoning_parser)
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        value = getattr(v, name)
        if value is not None:
            add(f"vllm.{name}", "--" + name.replace("_", "-"), value)
    for name in ("enable_prefix_caching", "async_scheduling"):
        value = getattr(v, name)
        if value is not None:
            flag = name.replace("_", "-")
            add(f"vllm.{name}", f"--{flag}" if value else f"--no-{flag}")
    if v.shutdown_timeout:
        add("vllm.shutdown_timeout", "--shutdown-timeout", v.shutdown_timeout)
    if m.sleep is not None:
        add("sleep.level", "--enable-sleep-mode")
    if v.compilation_config is not None:
        add("vllm.compilation_config", "--compilation-config",
            json.dumps(v.compilation_config, separators=(",", ":"), sort_keys=True))
    for i, item in enumerate(v.extra_args):
        add(f"vllm.extra_args[{i}]", item)
    return [t for t, _ in out], out


def env_path(m: Manifest, host: HostEntry) -> str:
    if host.service_manager == "systemd":
        return f"{host.env_dir}/{m.name}.env"
    return f"{host.env_dir}/vllm-{m.name}.env"


def unit_path(m: Manifest, host: HostEntry) -> str:
    if host.service_manager == "systemd":
        return f"{host.units_dir}/{m.unit_name}"
    return f"{host.units_dir}/vllm-{m.name}.sh"


def probe_path(host: HostEntry) -> str:
    """Where the units' probe script is installed: beside vllm-orch's state folder (bin/)."""
    return f"{host.bin_dir}/{PROBE_NAME}"


def health_unit_names(m: Manifest) -> tuple[str, str]:
    """(health check service, its timer) of a model's unit."""
    return f"vllm-{m.name}-health.service", f"vllm-{m.name}-health.timer"


def headwatch_unit_name(m: Manifest) -> str:
    """The head watch of a headless node (watches_head)."""
    return f"vllm-{m.name}-headwatch.service"


def watches_head(m: Manifest, role: NodeRole | None) -> bool:
    """Whether this node gets a head watch: a headless node of a TP/PP-across-nodes service, whose
    ranks join the head's rendezvous store (--master-port). Not with data parallel across nodes
    (its engines meet the head's front end over ZMQ) nor Ray (the Ray cluster places the workers)."""
    return (role is not None and not role.head and m.multinode is not None and m.multinode.backend == "mp"
            and m.vllm.data_parallel_size <= 1)


def stop_timeout(m: Manifest) -> int:
    """TimeoutStopSec: vLLM's drain window, then its own teardown."""
    return m.vllm.shutdown_timeout + TEARDOWN_S


def start_limit_interval(m: Manifest) -> int:
    """StartLimitIntervalSec that holds `start_attempts` complete attempts: each attempt may take the
    whole start-up budget (TimeoutStartSec), its stop and RestartSec before the next start, so the
    attempt after the last allowed one always falls inside the window and is refused."""
    s = m.startup
    return s.start_attempts * (s.budget_seconds + stop_timeout(m) + s.restart_delay_seconds) + START_LIMIT_MARGIN_S


def _probe(host: HostEntry, *words: str, root: bool = False) -> str:
    """A command line of the units' probe: the host's Python, isolated (-I: no PYTHON* variable,
    no user site, not the script's folder on sys.path); the root-run part without site-packages
    too (-S: it needs the standard library only)."""
    isolated = ["-I", "-S"] if root else ["-I"]
    return " ".join(systemd_quote(w) for w in [host.python or "python3", *isolated, probe_path(host), *words])


def probe_command(m: Manifest, host: HostEntry, mode: str) -> str:
    """The ExecStartPost= (ready) or health-check (check) command line of the units' probe."""
    words = [mode, "--unit", m.unit_name, "--port", str(m.serving.port),
             "--served-name", m.served_name, "--health-path", m.probes.health_path]
    if mode == "check":
        words += ["--model", m.name, "--timeout", str(m.probes.health_timeout_seconds),
                  "--failures", str(m.probes.health_failures), "--state-dir", host.state_dir]
    return _probe(host, *words)


def restart_command(m: Manifest, host: HostEntry, operation: str, by: str, *extra: str) -> str:
    """The root part (ExecStopPost=+) of the health check and the head watch: it acts only when the
    probe exited RESTART_EXIT, records `operation` in history.jsonl and restarts the service (after
    `systemctl reset-failed`: a deliberate restart must not use up the crash-loop limit), at most
    startup.start_attempts times within the unit's StartLimitIntervalSec, counted from its records."""
    return _probe(host, "restart", "--unit", m.unit_name, "--model", m.name, "--state-dir", host.state_dir,
                  "--operation", operation, "--by", by, "--limit-burst", str(m.startup.start_attempts),
                  "--limit-interval", str(start_limit_interval(m)), *extra, root=True)


def head_watch_command(m: Manifest, host: HostEntry, role: NodeRole) -> str:
    """The head watch's ExecStart=: the units' probe in watch-head mode."""
    assert m.multinode is not None
    return _probe(host, "watch-head", "--unit", m.unit_name, "--model", m.name, "--address", role.head_address,
                  "--port", str(meet_port(m, "master_port")), "--state-dir", host.state_dir)


def dev_guard_table(service: str) -> str:
    """The nftables table (family inet) of a sleep-capable service's dev-mode guard: named after the
    service (a slug: `-` becomes `_`, so two services never share one), created and deleted by it alone."""
    return "vllm_orch_" + service.replace("-", "_")


def dev_guard_rules(m: Manifest, user: str) -> str:
    """nft commands (one transaction) that make the dev-mode endpoints of a sleep-capable service
    (VLLM_SERVER_DEV_MODE=1: /sleep, /wake_up, /collective_rpc, ... which vLLM 0.33's --api-key does
    not guard) reachable only by root and the service's user: a loopback TCP connection to its port
    from a socket of any other uid is reset. `user`: a uid, a shell expansion giving one, or a quoted
    user name (nft resolves it when it loads). Adding then deleting the table first makes a restart
    replace it; no other table is touched."""
    t = f"inet {dev_guard_table(m.name)}"
    return (f"add table {t} ; delete table {t} ; add table {t} ; "
            f"add chain {t} out {{ type filter hook output priority 0 ; policy accept ; }} ; "
            f"add rule {t} out oif lo tcp dport {m.serving.port} meta skuid != {{ 0, {user} }} "
            f"reject with tcp reset")


def dev_guard_remove(m: Manifest) -> str:
    """nft command deleting the guard's table (only ours, by its name)."""
    return f"delete table inet {dev_guard_table(m.name)}"


HOME_TREES = ("/home", "/root", "/run/user")


def protect_home(host: HostEntry, m: Manifest | None = None) -> str:
    """ProtectHome= for the unit: `yes` (hidden) unless the models, vLLM or its Python live in a home
    folder; then `read-only`, which still keeps the service from writing there."""
    paths = (host.models_root, vllm_path(m, host) if m is not None else host.vllm, host.python)
    inside = any(p == t or p.startswith(t + "/") for p in paths for t in HOME_TREES)
    return "read-only" if inside else "yes"


def secrets_from_environ(m: Manifest, environ: Mapping[str, str] | None = None, *, required: bool = True,
                         installed: Mapping[str, str] | None = None) -> dict[str, Secret]:
    """The manifest's secret_env values from vllm-orch's environment. A name it is not given: the
    value `installed` on the host (regen keeps it), else left out when the manifest lists it in
    optional_secrets or `required` is off (render's preview, status); otherwise a ConfigError
    (exit 2): a VLLM_API_KEY left out would have vLLM serve without authentication. A value an env
    file cannot hold (a newline, a control character) is a ConfigError too."""
    environ = os.environ if environ is None else environ
    out: dict[str, Secret] = {}
    for name in m.serving.secret_env:
        value = environ.get(name) or (installed or {}).get(name)
        if not value:
            if required and name not in m.serving.optional_secrets:
                raise ConfigError(
                    f"{name} is not set in the environment of vllm-orch, and {m.name} needs it "
                    f"(serving.secret_env)" + (": vLLM would serve without an API key" if name == "VLLM_API_KEY"
                                               else ""),
                    hint=f"export {name}, or list it in serving.optional_secrets if {m.name} may run without it")
            continue
        try:
            env_value(value)
        except ValueError as exc:
            raise ConfigError(f"{name} (from the environment of vllm-orch): {exc}",
                              hint="an env file holds one line per variable") from None
        out[name] = Secret(value)
    return out


def node_env(m: Manifest, host: HostEntry, role: NodeRole | None) -> list[tuple[str, str]]:
    """What a node's env file adds for a multi-node service: VLLM_HOST_IP (the address the other
    nodes reach it at) and, when the inventory names the interface, NCCL_SOCKET_IFNAME and
    GLOO_SOCKET_IFNAME."""
    if role is None:
        return []
    out = [("VLLM_HOST_IP", host.node_address(m.name))]
    if host.cluster_interface:
        out += [("NCCL_SOCKET_IFNAME", host.cluster_interface), ("GLOO_SOCKET_IFNAME", host.cluster_interface)]
    elif m.multinode is not None and m.multinode.backend == "ray":
        # vLLM's Ray executor (0.33: vllm/v1/executor/ray_executor_v2.py, get_driver_env_vars) gives every
        # worker the head's environment where the worker's own lacks a name: the head's interface would
        # reach this node's NCCL and Gloo. Set but empty, they choose the interface themselves (NCCL
        # socket.cc and torch's ProcessGroupGloo read a name only when longer than one character).
        out += [(k, "") for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if k not in m.env]
    for key, value in out[1:]:
        if value and key in m.env and m.env[key] != value:
            raise ConfigError(f"{host.where('cluster', 'interface')}: {host.name}'s interface is {value} but the "
                              f"service environment (the manifest's env or the host's service_env) sets "
                              f"{key}={m.env[key]}: keep one of them")
    return [(k, env_value(v)) for k, v in out if m.env.get(k) != v]


def render(m: Manifest, host: HostEntry, secrets: Mapping[str, Secret] | None = None,
           role: NodeRole | None = None, model: str | None = None, folder: str | None = None) -> Rendered:
    """The files of the service m.name on `host`; for a node of a multi-node service (`role`), that
    node's: its rank's argv, its own address and interfaces in the env file, and on a worker node
    (rank > 0) a unit without the readiness probe and the health timer (it serves no HTTP).
    `model`: the model it serves, when the service has another name (ServiceSpec.model); `folder`:
    its weights folder under models_root (ServiceSpec.folder; default_folder when None)."""
    secrets = dict(secrets or {})
    model = model or m.name
    folder = folder or default_folder(m, model)
    argv, provenance = build_argv(m, host, role, model, folder)
    mdir = model_dir(folder, host)
    mhash = manifest_hash(m)
    epath = env_path(m, host)
    common = dict(version=__version__, m=m, model=model, host=host, model_dir=mdir, env_path=epath,
                  manifest_hash=mhash, protect_home=protect_home(host, m), credential=CREDENTIAL,
                  restart_exit=RESTART_EXIT, busy_exit=BUSY_EXIT, cache_env=CACHE_ENV)
    ray = role is not None and m.multinode is not None and m.multinode.backend == "ray"
    if ray and host.service_manager != "systemd":
        raise ConfigError(f"{host.where('service_manager')}: {m.name} runs on Ray (multinode.backend ray), whose "
                          f"nodes are systemd units; {host.name} is a `{host.service_manager}` host: use backend mp")

    env_pairs = [(k, env_value(v)) for k, v in m.env.items()]
    worker = role is not None and not role.head
    if worker:                  # no HTTP server on this node: its env file gets no API key
        secrets = {k: v for k, v in secrets.items() if k not in HTTP_SECRETS}
    missing = [k for k in m.serving.secret_env if k not in secrets and not (worker and k in HTTP_SECRETS)]
    env_tpl = _template("vllm.env.j2")
    env_args = dict(common, env=env_pairs, missing_secrets=missing, role=role, node_env=node_env(m, host, role),
                    cuda_visible_devices=",".join(str(i) for i in m.serving.visible_devices))
    masked = env_tpl.render(**env_args, secrets=[(k, "***") for k in secrets])
    revealed = env_tpl.render(**env_args, secrets=[(k, env_value(reveal(v))) for k, v in secrets.items()])
    env_file = RenderedFile(epath, masked, 0o600, revealed if secrets else None)

    extra: list[RenderedFile] = []
    watch = watches_head(m, role)
    guarded = m.sleep is not None and host.dev_guard      # sleep mode's dev endpoints: root and the service user
    if host.service_manager == "systemd":
        health_service, health_timer = health_unit_names(m)
        companion = headwatch_unit_name(m) if watch else "" if worker else health_timer
        units = dict(common, health_timer=companion, role=role,
                     ray_worker=is_ray_worker(m, role), ray_unit=ray_unit_name(m) if ray and not worker else "",
                     ray_address=f"{role.head_address}:{meet_port(m, 'ray_port')}" if ray and role and m.multinode else "",
                     master_port=meet_port(m, "master_port") if m.multinode else "")
        guard = guarded and not worker
        text = _template("vllm.service.j2").render(
            **units, exec_start=exec_start(argv),
            dev_guard=systemd_quote(dev_guard_rules(m, '"' + host.service_user + '"')) if guard else "",
            dev_unguard=systemd_quote(dev_guard_remove(m)) if guard else "",
            ready_probe="" if worker else probe_command(m, host, "ready"),
            start_limit_interval=start_limit_interval(m), stop_timeout=stop_timeout(m))
        unit = RenderedFile(unit_path(m, host), text, 0o644)
        if not worker:
            check_timeout = m.probes.health_timeout_seconds * 2 + 30    # /metrics twice, /health, the completion
            extra = [
                RenderedFile(f"{host.units_dir}/{health_service}", _template("vllm-health.service.j2").render(
                    **units, health_check=probe_command(m, host, "check"), health_check_timeout=check_timeout,
                    health_restart=restart_command(m, host, "health-restart", health_timer),
                    health_dir=f"{host.state_dir}/health"), 0o644),
                RenderedFile(f"{host.units_dir}/{health_timer}", _template("vllm-health.timer.j2").render(**units),
                             0o644),
                RenderedFile(probe_path(host), package_file("host", "remote", "unit_probe.py").read_text(), 0o755)]
        elif watch and role is not None:
            assert m.multinode is not None
            extra = [
                RenderedFile(f"{host.units_dir}/{headwatch_unit_name(m)}", _template("vllm-headwatch.service.j2").render(
                    **units, head_watch=head_watch_command(m, host, role), head_restart=restart_command(
                        m, host, "head-lost-restart", headwatch_unit_name(m), "--address", role.head_address,
                        "--port", str(meet_port(m, "master_port")))), 0o644),
                RenderedFile(probe_path(host), package_file("host", "remote", "unit_probe.py").read_text(), 0o755)]
        if ray and role is not None and role.head:
            extra.append(RenderedFile(f"{host.units_dir}/{ray_unit_name(m)}", _template("ray.service.j2").render(
                **common, role=role, exec_start=exec_start(ray_argv(m, host, role))), 0o644))
    else:
        text = _template("vllm-process.sh.j2").render(
            **common, argv=argv, dev_guard=dev_guard_rules(m, "\0").split("\0") if guarded else "")
        unit = RenderedFile(unit_path(m, host), text, 0o755)
    return Rendered(m, host, argv, provenance, mdir, unit, env_file, mhash, extra, role, model)
