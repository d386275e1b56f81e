"""The host inventory (hosts.yaml): how to reach each host and where things live on it.

Looked up from --inventory PATH, else ./hosts.yaml, else ~/.config/vllm-orch/hosts.yaml. Every
`*.yaml` in the extra-inventory folder (`hosts_d()`) is always added: tools that provision hosts
write one file there each (`vllm-orch sim up` writes its SIMULATED hosts there, `sim down` removes
the file), so this module knows nothing of who wrote it. A host whose address is `local` is this
machine, reached without SSH.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import posixpath
import re
import urllib.parse
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from orchestrator.config.checks import CheckName
from orchestrator.config.manifest import ENV_NAME, SLUG, Strict, _check_text, at, check_env_map, validation_error
from orchestrator.config.yamlsrc import YamlDoc, display_path, format_loc
from orchestrator.errors import ConfigError

LOCAL = "local"
DEFAULT_GATEWAY_PORT = 8090
ALL_MODELS = "*"
COMMAND_SECRET_HINT = ("the inventory's env is put on the command lines vllm-orch runs on the host (visible "
                       "in `ps`) and printed by `hosts --json`. Set HF_TOKEN in the environment of vllm-orch "
                       "(it reaches the host as a 0600 file), and service secrets with the manifest's "
                       "serving.secret_env")
SERVICE_SECRET_HINT = ("list it in the manifest's serving.secret_env and set it in the environment of "
                       "`vllm-orch deploy` instead")

# A Unix user name as useradd(8) accepts it by default (NAME_REGEX), at most 32 characters.
USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
# What systemd reads as ExecStart= prefixes (`+` full privileges, `-` ignore failure, `@` argv[0],
# `:` no variable expansion, `!` no capabilities change): never the start of our vLLM path.
EXEC_PREFIXES = "+-@:!|"
# Folders that must never be models_root (gc and disk freeing delete folders under it). The first
# ones, and everything under them; the second ones themselves only; a home folder itself too.
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run",
                "/sbin", "/sys", "/usr")
TREE_EXCEPTIONS = ("/usr/local",)                       # /usr/local/<x> is a normal place for data
SYSTEM_FOLDERS = ("/", "/home", "/root", "/opt", "/srv", "/mnt", "/media", "/tmp", "/var", "/var/lib",
                  "/var/cache", "/var/log", "/var/tmp", "/var/spool", "/var/mail", "/var/opt", "/var/local",
                  "/usr/local", "/snap")
HOME_PARENTS = ("/home",)


def system_folder(path: str) -> str | None:
    """Why PATH (absolute, normalised) cannot hold deletable model folders, or None."""
    if path in SYSTEM_FOLDERS or path in SYSTEM_TREES:
        return f"{path} is a system folder"
    for tree in SYSTEM_TREES:
        if path == tree or path.startswith(tree + "/"):
            if any(path.startswith(ok + "/") for ok in TREE_EXCEPTIONS):
                return None
            return f"{path} is inside the system folder {tree}"
    for parent in HOME_PARENTS:
        if posixpath.dirname(path) == parent:
            return f"{path} is a home folder itself (use a folder inside it)"
    return None


# A wheel_url_prefixes entry: https, a host (and port), folders, ending with `/`: a URL that starts
# with it is under that folder of that host (a prefix without the `/` would also admit
# `https://wheels.example.evil/` or `.../vllm-other/`). Printable ASCII by construction.
WHEEL_URL_PREFIX = re.compile(r"^https://[A-Za-z0-9.-]{1,253}(:[0-9]{1,5})?/([A-Za-z0-9._~%+-]{1,200}/){0,20}$")


def clean_path(v: str) -> str:
    """An absolute path without `..`, `.` or repeated slashes: what it names is what it says."""
    if not v.startswith("/"):
        raise ValueError(f"{v!r} must be an absolute path")
    parts = v.split("/")
    if ".." in parts:
        raise ValueError(f"{v!r} contains `..`: write the folder it means")
    return "/" + "/".join(p for p in parts if p not in ("", "."))


class ServingOverride(Strict):
    """`serving` fields a host may set for a model."""

    port: int | None = Field(None, ge=1, le=65535, description="HTTP port on this host (another service "
                                                                 "already uses the manifest's).")
    host: str | None = Field(None, description="Address vLLM listens on, on this host.")
    gpu_ids: list[int] | None = Field(None, description="The GPUs this model takes on this host "
                                                         "(as many as serving.gpus).")


class VllmOverride(Strict):
    """`vllm` fields a host may set for a model: the ones that follow the host's memory and packages."""

    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=0.99, description="Fraction of each GPU's memory, e.g. lower on a host whose "
                                            "GPUs also drive a display.")
    max_num_seqs: int | None = Field(None, ge=1, description="`--max-num-seqs` on this host.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="`--max-num-batched-tokens` on this host.")
    load_format: str | None = Field(None, description="`--load-format`, e.g. `fastsafetensors` where this "
                                                       "host has the package.")


class StartupOverride(Strict):
    """`startup` budgets that follow the host's disks."""

    budget_seconds: int | None = Field(None, ge=10,
                                       description="Start-up budget on this host (slow disks load slower).")
    no_progress_seconds: int | None = Field(None, ge=5, description="Silence that counts as a hang on this host.")


class HostOverride(Strict):
    """What one model (or every model, `*`) gets on this host instead of its manifest's values."""

    serving: ServingOverride = Field(default_factory=ServingOverride, description="port, host, gpu_ids.")
    vllm: VllmOverride = Field(default_factory=VllmOverride,
                               description="gpu_memory_utilization, max_num_seqs, max_num_batched_tokens, load_format.")
    startup: StartupOverride = Field(default_factory=StartupOverride,
                                     description="budget_seconds, no_progress_seconds.")
    service_env: dict[str, str] = Field(
        default_factory=dict, description="Service environment for this model on this host, added to the "
                                          "host's service_env (a name in both takes this value).")

    @field_validator("service_env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env_map(v, SERVICE_SECRET_HINT)

    def set_fields(self) -> dict[str, Any]:
        """{manifest field path: value} for every field this override sets, e.g. `serving.port`."""
        out: dict[str, Any] = {}
        for section in ("serving", "vllm", "startup"):
            for name, value in getattr(self, section).model_dump(exclude_none=True).items():
                out[f"{section}.{name}"] = value
        return out


# A network interface name as the kernel allows it (IFNAMSIZ: at most 15 characters); NCCL and Gloo
# also read it as a prefix (`eth` matches eth0, eth1).
IFNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,14}$")


def ip_literal(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


class ClusterNetwork(Strict):
    """How the other nodes of a multi-node service reach this host (manifests with `multinode:`)."""

    address: str | None = Field(
        None, description="The IP address the other nodes reach this host at: the head's is every "
                          "node's `--master-addr` / `--data-parallel-address`, and each node's own is "
                          "its VLLM_HOST_IP. Default: the host's `address` when that is an IP address; "
                          "a host reached by a DNS name or an SSH alias needs it to serve as a node. "
                          "Use the address of the fast (InfiniBand / RoCE / private) network.")
    interface: str | None = Field(
        None, description="The network interface of that address, e.g. `ens1f0` or `ib0`: written as "
                          "NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME to this node's env file, so NCCL and "
                          "Gloo do not pick a docker bridge or a management NIC (a wrong one hangs the "
                          "start). Default: unset, the libraries choose.")

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None and not ip_literal(v):
            raise ValueError(f"{v!r} is not an IP address (the nodes' runtimes connect to it as is)")
        return v

    @field_validator("interface")
    @classmethod
    def _interface(cls, v: str | None) -> str | None:
        if v is not None and not IFNAME.match(v):
            raise ValueError(f"{v!r} is not a network interface name (letters, digits, _ . : @ -; at most 15)")
        return v


class Monitoring(Strict):
    """How a Prometheus reaches this host (`vllm-orch monitor`, docs/monitoring.md)."""

    address: str | None = Field(
        None, description="The address Prometheus scrapes this host at (a DNS name or an IP). Default: the "
                          "host's `address` (127.0.0.1 for `local`). vLLM must listen where this reaches "
                          "(serving.host).")
    node_exporter_port: int | None = Field(
        None, ge=1, le=65535, description="Port of a Prometheus node exporter running on this host "
                                          "(usually 9100). Unset: none is scraped.")
    dcgm_exporter_port: int | None = Field(
        None, ge=1, le=65535, description="Port of NVIDIA's DCGM exporter running on this host (usually "
                                          "9400): GPU memory per GPU, for the sleeping-service alert. "
                                          "Unset: none is scraped.")

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.:-]{0,252}", v):
            raise ValueError(f"{v!r} is not a host name or IP address")
        return v


class WakeGroup(Strict):
    """Services of one GPU set that the gateway wakes on demand (`vllm-orch gateway waker`,
    docs/gateway.md "On-demand wake"): a request for one that sleeps waits at the gateway while the
    awake one sleeps and it wakes (a sleep swap, canary checked)."""

    services: list[str] = Field(min_length=1, description="The services (manifest names) of the group: each has a "
                                                          "`sleep` section and they share the GPUs.")
    min_awake_seconds: int = Field(
        30, ge=0, le=86400,
        description="The anti-thrash bound: a model that woke serves at least this long before another model's "
                    "requests may put it to sleep (at once when it has no request in flight).")
    ttl_seconds: int = Field(
        0, ge=0, le=604800,
        description="An awake model of the group with no request for this long is put to sleep (0: never).")

    @field_validator("services")
    @classmethod
    def _services(cls, v: list[str]) -> list[str]:
        for name in v:
            if not SLUG.fullmatch(name):
                raise ValueError(f"{name!r} is not a service name")
        if len(set(v)) != len(v):
            raise ValueError("a service is named twice")
        return v


class Gateway(Strict):
    """The host's gateway (`vllm-orch gateway up`, docs/gateway.md): one port that routes every
    OpenAI request by its `model` to the service that serves it."""

    port: int = Field(DEFAULT_GATEWAY_PORT, ge=1024, le=65535,
                      description="The port it listens on (it runs as the service user: 1024 or above).")
    metrics_port: int | None = Field(
        None, ge=1024, le=65535,
        description="A port of its own for the gateway's Prometheus metrics (HAProxy's exporter: GET /metrics, "
                    "no key, on the `listen` addresses): requests, 5xx answers, requests in flight and response "
                    "times per model; `vllm-orch monitor` scrapes it. Default: none (off).")
    listen: list[str] = Field(
        default_factory=lambda: ["127.0.0.1"], min_length=1,
        description="The addresses it listens on (IP addresses; 0.0.0.0 for every IPv4 address). Default: "
                    "127.0.0.1, this host only: name the LAN address to serve other machines.")
    keys_env: str = Field(
        "VLLM_ORCH_GATEWAY_KEYS",
        description="The environment variable of `vllm-orch gateway up` that holds the keys clients must send "
                    "(`Authorization: Bearer KEY`), separated by commas: written to the host as a 0600 file of "
                    "the service user, never in the inventory, a plan or a log.")
    hold_seconds: int = Field(
        30, ge=0, le=600,
        description="How long a request for a model that is starting (its port not open yet) or waking waits at "
                    "the gateway, then 503 with Retry-After.")
    run_dir: str = Field(
        "", description="The folder of its control sockets (HAProxy's master and admin sockets), the service "
                        "user's. Default (empty): state_dir/gateway/run. A Unix socket's path has at most 107 "
                        "bytes: name a shorter folder when state_dir is deep.")
    drain_seconds: int = Field(
        60, ge=0, le=3600,
        description="Before a service stops or sleeps, how long its requests in flight may take to finish "
                    "(new ones get 503 with Retry-After meanwhile).")
    wake_groups: list[WakeGroup] = Field(
        default_factory=list,
        description="Services the gateway wakes on demand, by group (opt-in): a request for a sleeping one waits "
                    "while `vllm-orch gateway waker` wakes it. Outside a group a sleeping model answers 503. Each: "
                    "`services` (manifest names), `min_awake_seconds` (30: the anti-thrash turn), `ttl_seconds` "
                    "(0: never sleep an idle one); docs/gateway.md \"On-demand wake\".")

    def group_of(self, service: str) -> WakeGroup | None:
        return next((g for g in self.wake_groups if service in g.services), None)

    @field_validator("wake_groups")
    @classmethod
    def _groups(cls, v: list[WakeGroup]) -> list[WakeGroup]:
        seen: set[str] = set()
        for g in v:
            if seen & set(g.services):
                raise ValueError(f"{sorted(seen & set(g.services))[0]} is in two wake groups")
            seen |= set(g.services)
        return v

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: list[str]) -> list[str]:
        for a in v:
            try:
                ipaddress.ip_address(a)
            except ValueError:
                raise ValueError(f"{a!r} is not an IP address") from None
        return v

    @field_validator("run_dir")
    @classmethod
    def _run_dir(cls, v: str) -> str:
        # it reaches the unit (ReadWritePaths=) and HAProxy's command line: a plain absolute path only
        if v and not re.fullmatch(r"/[A-Za-z0-9._/-]*", v) or "/../" in f"{v}/" or "/./" in f"{v}/":
            raise ValueError(f"{v!r} is not an absolute path of letters, digits, . _ - and / (no . or .. parts)")
        return v

    @field_validator("keys_env")
    @classmethod
    def _keys_env(cls, v: str) -> str:
        if not ENV_NAME.fullmatch(v):          # fullmatch: `$` alone lets a trailing newline through
            raise ValueError(f"{v!r} is not an environment variable name")
        return v


DEFAULT_CPU_MEMORY_PER_GPU_GIB = 12.0


class HostEntry(Strict):
    """One machine."""

    name: str = Field("", description="Host name used with --host (the key in hosts.yaml).")
    address: str = Field(
        description="DNS name, IP address or ~/.ssh/config alias; `local` for this machine without SSH.")
    port: int | None = Field(None, ge=1, le=65535, description="SSH port. Default: ~/.ssh/config, else 22.")
    user: str | None = Field(None, description="SSH user. Default: ~/.ssh/config, else the current user.")
    identity_file: str | None = Field(None, description="SSH private key. Default: ~/.ssh/config, the agent, ~/.ssh/id_*.")
    known_hosts_file: str | None = Field(None, description="known_hosts to check host keys against. Default: ~/.ssh/known_hosts.")
    connect_timeout: float = Field(10.0, gt=0, le=300, description="Seconds to wait for the SSH connection.")
    sudo: bool = Field(False, description="Run commands with `sudo -n` (passwordless sudo for the SSH user).")
    service_manager: Literal["systemd", "process"] = Field(
        "systemd", description="`systemd`: units in units_dir, systemctl and journalctl. `process`: a start "
                               "script and a PID file, for hosts without systemd (containers).")
    models_root: str = Field("/var/lib/vllm-orch/models",
                             description="Folder holding one sub-folder per managed model. Nothing outside it is ever deleted.")
    vllm: str = Field("/opt/vllm/bin/vllm", description="The vLLM executable on the host (usually inside its venv).")
    python: str = Field(
        "", description="Python that runs host-side helper scripts (download, flag check); it needs "
                        "huggingface_hub. Default (empty): `python` beside the vllm executable (the vLLM venv).")
    nvidia_smi: str = Field("nvidia-smi", description="nvidia-smi executable.")
    engines_root: str = Field(
        "/var/lib/vllm-orch/engines",
        description="Folder of the engine venvs (manifests with `engine:`): one per distinct lock, named by its "
                    "hash, built and owned by root, read-only to the service user. gc deletes the ones no "
                    "service uses.")
    uv: str = Field("uv", description="uv on the host: it builds the engine venvs (from the registries the "
                                      "host reaches, as its `env` says, e.g. UV_INDEX_URL; or from the "
                                      "uploaded wheelhouse).")
    wheelhouse: str = Field(
        "", description="A folder on the CONTROLLER of wheels (vLLM, torch, flashinfer, ... for the host's "
                        "platform, with their dependencies): for a host without the registries, the engine step "
                        "uploads the wheels the host lacks (by name and size) to engines_root/.wheelhouse and "
                        "builds offline from them. Empty: the host's own registries.")
    wheel_url_prefixes: list[str] = Field(
        default_factory=list,
        description="The https addresses a manifest's `engine.vllm` wheel URL may start with on this host "
                    "(each ends with `/`, e.g. `https://wheels.internal/vllm/`): the service runs that "
                    "wheel's code, so a URL under none of them is refused when the plan is made. Empty: no "
                    "wheel URL (versions only).")
    fleet_copy_mbps: float = Field(
        0, ge=0, description="Download once per fleet (`deploy`/`swap` with --group): the most megabits per second "
                             "this host serves a checkpoint at to the fleet's other hosts (all of them together), "
                             "so the copies leave bandwidth for its service. 0: no limit.")
    require_hashes: bool = Field(
        False, description="Build engine venvs only from a hashed lock (the manifest's `engine.lock_file`, "
                           "installed with uv's --require-hashes): a manifest's engine without one is refused "
                           "when the plan is made (exit 2). Off: an engine without a lock installs its pins, and "
                           "their dependencies as the index resolves them, without hashes.")
    units_dir: str = Field("/etc/systemd/system", description="Where units (systemd) or start scripts (process) are installed.")
    env_dir: str = Field("", description="Where the 0600 env files go. Default (empty): /etc/vllm-orch (systemd), "
                                         "units_dir (process).")
    state_dir: str = Field("/var/lib/vllm-orch/state",
                           description="vllm-orch's records on the host: lock, active model, history.")
    log_dir: str = Field("", description="Service logs for `process` hosts. Default (empty): state_dir/../logs.")
    service_user: str = Field(
        "vllm", description="The unprivileged user the service runs as (User= of the unit; on `process` hosts the "
                            "start script drops to it). Created by deploy when missing, with its home (caches) "
                            "beside state_dir. `root` works but gives up the least-privilege protection.")
    models_disk_budget_gib: float | None = Field(
        None, gt=0, description="Most GiB that managed models may use in models_root (a disk budget); "
                                "downloads that would exceed it free or refuse like a full disk.")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment for every command vllm-orch runs on the host (e.g. HF_ENDPOINT for a "
                    "mirror, proxies). Not passed to the services: that is `service_env`. Not for secrets.")
    service_env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment for the service of every model on this host, written to its env file: "
                    "what this machine's hardware needs (NCCL_P2P_LEVEL, NCCL_GRAPH_FILE for its topology, "
                    "VLLM_TUNED_CONFIG_FOLDER for MoE kernels tuned on it). A name the model's manifest also "
                    "sets to another value is refused. Not for secrets.")
    overrides: dict[str, HostOverride] = Field(
        default_factory=dict,
        description="Per-model settings where this host differs, by model name (`\"*\"`: every model; a "
                    "model's own entry wins over `*`): serving port/host/gpu_ids, vllm "
                    "gpu_memory_utilization/max_num_seqs/max_num_batched_tokens/load_format, startup "
                    "budgets, service_env. They win over the manifest; `render MODEL --host` shows each.")
    label: str | None = Field(
        None, max_length=40,
        description="A short note shown beside the host's name in plans, `status`, `hosts` and bench "
                    "reports, e.g. `staging` (`vllm-orch sim up` writes `SIMULATED`).")
    dev_guard: bool = Field(
        True,
        description="Guard a sleep-capable service's dev-mode endpoints (/sleep, /wake_up, /collective_rpc: "
                    "outside vLLM's --api-key) with an nftables table that resets loopback connections to its "
                    "port from every uid but root's and the service user's (docs/security.md). Needs root and "
                    "`nft` on the host. `false` leaves them open to every local user of the host, and the plan "
                    "warns: only where every local user is trusted, e.g. a SIMULATED host run as a non-root "
                    "user (`vllm-orch sim up` writes it then).")
    time_scale: float = Field(
        1.0, ge=1, le=1e6,
        description="How many times faster than the field this host loads a model: the start-up and "
                    "downtime vllm-orch expects from a manifest's rates (`loading.*`) are divided by it, "
                    "and the plan says so. `vllm-orch sim up` writes its `--speed` here for a SIMULATED "
                    "host; leave it at 1 on a real host. A host's own measured starts are never scaled.")
    disk_reserve_gib: float | None = Field(
        None, ge=0, description="Free space to keep on this host's models disk, in GiB, instead of every "
                                "manifest's requires.disk_reserve_gib (e.g. a host with a small "
                                "dedicated models disk).")
    skip_checks: list[CheckName] = Field(
        default_factory=list,
        description="Preflight checks always skipped on this host (shown as skipped \"(host setting)\" in "
                    "plans), e.g. `[flags, env]` for a host whose Python cannot import vLLM.")
    meminfo: str = Field(
        "/proc/meminfo",
        description="File the host's memory is read from (MemTotal, MemAvailable, in /proc/meminfo's "
                    "format): it sizes the page-cache warm-up before a swap. A simulated host points it "
                    "to its own file.")
    cpu_memory_per_gpu_gib: float = Field(
        DEFAULT_CPU_MEMORY_PER_GPU_GIB, ge=0,
        description="CPU memory (GiB) a vLLM service takes on this host per GPU worker, for models whose "
                    "manifest does not declare loading.cpu_memory_gib. The page-cache warm-up leaves this "
                    "much free for the new service, so its start does not evict the warmed weights. "
                    "Default 12: about 11 GB per vLLM worker process (verl-project/verl#224) and ~100 GB "
                    "for a Llama-70B FP8 service whose weights sit on the GPUs (vllm-project/vllm#16947).")
    cluster: ClusterNetwork | None = Field(
        None, description="How the other nodes of a multi-node service reach this host: `address` (IP) "
                          "and `interface` (NIC for NCCL/Gloo). Only read when a manifest with "
                          "`multinode:` runs here.")
    gateway: Gateway = Field(
        default_factory=Gateway,
        description="The gateway `vllm-orch gateway up` runs here: its port, addresses, client keys, hold and drain.")
    monitoring: Monitoring = Field(
        default_factory=Monitoring,
        description="For `vllm-orch monitor`: the address Prometheus scrapes and the exporters running here.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if v and not SLUG.match(v):
            raise ValueError(f"{v!r} is not a lowercase slug")
        return v

    @field_validator("address", "user", "identity_file", "known_hosts_file", "models_root", "vllm", "python",
                     "nvidia_smi", "engines_root", "uv", "wheelhouse", "units_dir", "env_dir", "state_dir", "log_dir",
                     "service_user", "label",
                     mode="before")
    @classmethod
    def _text(cls, v):
        """Everything here reaches a command line, a unit file or the terminal: one printable line."""
        return _check_text(v, "the value") if isinstance(v, str) else v

    @field_validator("wheel_url_prefixes")
    @classmethod
    def _wheel_prefixes(cls, v: list[str]) -> list[str]:
        for i, prefix in enumerate(v):
            if not isinstance(prefix, str) or not WHEEL_URL_PREFIX.match(prefix) or \
                    any(p in (".", "..") for p in urllib.parse.unquote(prefix).split("/")[3:]):
                raise at(str(i), f"{str(prefix)[:80]!r} is not an https address ending with / (a host, then "
                            "folders; no credentials, query, fragment, `.` or `..`)")
        return v

    @field_validator("service_user")
    @classmethod
    def _user(cls, v: str) -> str:
        if not USER_NAME.match(v):
            raise ValueError(f"{v!r} is not a user name (lowercase letters, digits, _ and -, at most 32)")
        return v

    @field_validator("vllm", "python", "nvidia_smi", "uv")
    @classmethod
    def _program(cls, v: str, info) -> str:
        """Every program path may start a unit's command line (ExecStart=, ExecStartPost=, the
        health check's): `+/usr/bin/python3` would run the probe as root, `-` ignore its failure."""
        if (v or info.field_name != "python") and (not v or v[0] in EXEC_PREFIXES):
            what = {"vllm": "the vLLM path", "python": "the Python path", "nvidia_smi": "the nvidia-smi path",
                    "uv": "the uv path"}
            raise ValueError(f"{v!r}: {what[info.field_name or 'vllm']} cannot start with one of "
                             f"{' '.join(EXEC_PREFIXES)} (systemd reads them as ExecStart= prefixes)")
        return v

    @field_validator("meminfo")
    @classmethod
    def _meminfo(cls, v: str) -> str:
        _check_text(v, "the value")
        if not v.startswith("/"):
            raise ValueError(f"{v!r} must be an absolute path")
        return v

    @field_validator("skip_checks")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))

    @field_validator("models_root", "engines_root", "units_dir", "state_dir", "env_dir", "log_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v:
            return v                                   # the default (env_dir, log_dir): filled in below
        v = clean_path(v)
        if v in ("/", "/usr", "/etc", "/var", "/home", "/root", "/opt"):
            raise ValueError(f"{v!r} is too broad a folder for vllm-orch to manage")
        return v

    @field_validator("models_root", "engines_root")
    @classmethod
    def _models_root(cls, v: str, info) -> str:
        why = system_folder(v)
        if why:
            raise ValueError(f"{why}: vllm-orch deletes folders under {info.field_name}, so it must be a folder "
                             f"of its own, e.g. /var/lib/vllm-orch/{'models' if info.field_name == 'models_root' else 'engines'}")
        return v

    _doc: YamlDoc | None = PrivateAttr(None)       # the file this entry was read from (for file:line)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env_map(v, COMMAND_SECRET_HINT, reserved=())

    @field_validator("service_env")
    @classmethod
    def _service_env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env_map(v, SERVICE_SECRET_HINT)

    @field_validator("overrides")
    @classmethod
    def _override_keys(cls, v: dict[str, HostOverride]) -> dict[str, HostOverride]:
        for key in v:
            if key != ALL_MODELS and not SLUG.match(key):
                raise at(key, f"{key!r} is not a model name (or `*` for every model)")
        return v

    def where(self, *path: Any) -> str:
        """`hosts.yaml:14: hosts.gpu1.overrides.x.serving.port`: where one of this host's settings is
        written, for messages that blame it (no line for entries not read from a file)."""
        loc = ["hosts", self.name, *path]
        if self._doc is None:
            return f"host {self.name}: {format_loc(path)}"
        line = self._doc.line_of(loc)
        return f"{self._doc.display}{':' + str(line) if line else ''}: {format_loc(loc)}"

    def override_for(self, model: str) -> list[tuple[str, HostOverride]]:
        """The overrides that apply to `model`, weakest first: (`*` entry), then its own."""
        return [(k, self.overrides[k]) for k in (ALL_MODELS, model) if k in self.overrides]

    @model_validator(mode="after")
    def _defaults(self) -> HostEntry:
        if not self.python:
            self.python = str(Path(self.vllm).with_name("python")) if "/" in self.vllm else "python3"
        if not self.env_dir:
            self.env_dir = self.units_dir if self.service_manager == "process" else "/etc/vllm-orch"
        if not self.log_dir:
            self.log_dir = str(Path(self.state_dir).parent / "logs")
        return self

    @property
    def bin_dir(self) -> str:
        """Where vllm-orch installs the units' probe script: beside state_dir (its parent's bin/)."""
        return str(Path(self.state_dir).parent / "bin")

    @property
    def root_programs(self) -> list[str]:
        """What vllm-orch runs as root on this host: the Python of every helper script and of the
        units' root-run parts, nvidia-smi (the facts), vLLM itself when the service runs as root."""
        return [self.python, self.nvidia_smi, self.uv] + ([self.vllm] if self.service_user == "root" else [])

    @property
    def root_folders(self) -> list[str]:
        """The folders vllm-orch writes as root."""
        return list(dict.fromkeys([self.models_root, self.state_dir, self.env_dir, self.units_dir, self.log_dir,
                                   self.bin_dir, self.engines_root]))

    @property
    def service_home(self) -> str:
        """The home vllm-orch gives the service user it creates: vLLM's caches (torch.compile, Triton,
        FlashInfer kernels) go there, beside state_dir and logs."""
        return str(Path(self.state_dir).parent / "home")

    @property
    def cluster_address(self) -> str | None:
        """The IP the other nodes of a multi-node service reach this host at: cluster.address, else
        `address` when it is an IP address; None when neither says."""
        if self.cluster is not None and self.cluster.address:
            return self.cluster.address
        return self.address if ip_literal(self.address) else None

    def node_address(self, service: str) -> str:
        """cluster_address, or a ConfigError (exit 2, at this host's `address`) when the host is a
        node of the multi-node `service` and the other nodes have no IP to reach it at."""
        if self.cluster_address is None:
            raise ConfigError(f"{self.where('address')}: {self.address!r} is not an IP address, and the other "
                              f"nodes of {service} must reach {self.name} at one: set hosts.{self.name}.cluster.address")
        return self.cluster_address

    @property
    def cluster_interface(self) -> str | None:
        return self.cluster.interface if self.cluster is not None else None

    @property
    def is_local(self) -> bool:
        return self.address == LOCAL

    @property
    def display_name(self) -> str:
        """The name with the host's label, e.g. `sim [SIMULATED]`."""
        return f"{self.name} [{self.label}]" if self.label else self.name

    def describe(self) -> str:
        where = "this machine" if self.is_local else (
            f"{self.user + '@' if self.user else ''}{self.address}{':' + str(self.port) if self.port else ''}")
        return f"{self.name} ({where}, {self.service_manager}{', ' + self.label if self.label else ''})"


NO_INVENTORY_HINT = ("write hosts.yaml (`vllm-orch hosts --example > hosts.yaml` starts one from the "
                     "commented example) or run `vllm-orch sim up`")


class Inventory(Strict):
    hosts: dict[str, HostEntry] = Field(default_factory=dict, description="Hosts by name.")
    groups: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Named lists of hosts, e.g. `prod: [gpu1, gpu2]`, selected with `--group prod`. Each "
                    "name must be a host of the inventory (this file, another inventory file or "
                    "hosts.d); a group is never empty and never named like a host.")
    _group_doc: dict[str, YamlDoc] = PrivateAttr(default_factory=dict)   # group -> the file it is written in

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data):
        if isinstance(data, dict) and isinstance(data.get("hosts"), dict):
            hosts = {}
            for key, entry in data["hosts"].items():
                if isinstance(entry, dict):
                    entry = {**entry, "name": entry.get("name", key)}
                hosts[key] = entry
            data = {**data, "hosts": hosts}
        return data

    @model_validator(mode="after")
    def _keys(self) -> Inventory:
        for key, entry in self.hosts.items():
            if entry.name != key:
                raise ValueError(f"hosts.{key}.name is {entry.name!r}; leave it out or make it {key!r}")
        return self


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "vllm-orch"


def state_home() -> Path:
    """vllm-orch's own files on this machine (the controller): $VLLM_ORCH_STATE_HOME, else
    $XDG_STATE_HOME/vllm-orch, else ~/.local/state/vllm-orch."""
    explicit = os.environ.get("VLLM_ORCH_STATE_HOME")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local/state")
    return Path(base) / "vllm-orch"


def hosts_d() -> Path:
    """The extra-inventory folder: every `*.yaml` in it is added to the inventory (docs/user-guide.md)."""
    return state_home() / "hosts.d"


def extra_inventory_files() -> list[Path]:
    folder = hosts_d()
    return sorted(p for p in folder.glob("*.yaml") if p.is_file()) if folder.is_dir() else []


def inventory_path(explicit: Path | None = None) -> Path | None:
    if explicit is not None:
        if not explicit.is_file():
            raise ConfigError(f"--inventory {explicit}: no such file")
        return explicit
    for candidate in (Path("hosts.yaml"), config_dir() / "hosts.yaml"):
        if candidate.is_file():
            return candidate
    return None


def load_inventory_file(path: Path) -> Inventory:
    doc = YamlDoc(path, display_path(path))
    data = doc.data if doc.data is not None else {"hosts": {}}
    if not isinstance(data, dict):
        raise ConfigError(f"{doc.display}: expected a mapping with a `hosts:` key")
    try:
        inv = Inventory.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, doc, "inventory", Inventory) from None
    for entry in inv.hosts.values():
        entry._doc = doc
    for group in inv.groups:
        if not SLUG.match(group):
            raise ConfigError(f"{_where(doc, ['groups', group])}: {group!r} is not a lowercase slug")
        inv._group_doc[group] = doc
    return inv


def _where(doc: YamlDoc | None, loc: list[Any]) -> str:
    """`hosts.yaml:14: groups.prod[1]` (no line for a group not read from a file)."""
    if doc is None:
        return format_loc(loc)
    line = doc.line_of(loc)
    return f"{doc.display}{':' + str(line) if line else ''}: {format_loc(loc)}"


def check_groups(inv: Inventory) -> None:
    """Every group names known hosts, at least one, and no group is named like a host: checked once
    the inventory files are merged (a group may list hosts.d's hosts)."""
    for group, members in inv.groups.items():
        doc = inv._group_doc.get(group)
        if group in inv.hosts:
            raise ConfigError(f"{_where(doc, ['groups', group])}: {group!r} is also a host's name",
                              hint="give the group another name: `--group` and `--host` must not be ambiguous")
        if not members:
            raise ConfigError(f"{_where(doc, ['groups', group])}: the group is empty",
                              hint="list at least one host, or remove the group")
        for i, name in enumerate(members):
            if name not in inv.hosts:
                close = difflib.get_close_matches(name, sorted(inv.hosts), n=1, cutoff=0.5)
                raise ConfigError(f"{_where(doc, ['groups', group, i])}: no host named {name!r} in the inventory",
                                  hint=f"did you mean {close[0]!r}?" if close else
                                  f"known hosts: {', '.join(sorted(inv.hosts)) or 'none'}")


def load_inventory(explicit: Path | None = None) -> Inventory:
    """The user's inventory (if any) plus every extra inventory file of hosts_d(); a host name
    defined twice is refused, naming both files."""
    hosts: dict[str, HostEntry] = {}
    origin: dict[str, Path] = {}
    groups: dict[str, list[str]] = {}
    group_doc: dict[str, YamlDoc] = {}
    path = inventory_path(explicit)
    for source in extra_inventory_files() + ([path] if path is not None else []):
        one = load_inventory_file(source)
        for group, members in one.groups.items():
            if group in groups:
                raise ConfigError(f"{_where(one._group_doc[group], ['groups', group])}: group {group!r} is also "
                                  f"defined in {group_doc[group].display}", hint="define each group once")
            groups[group], group_doc[group] = members, one._group_doc[group]
        for name, entry in one.hosts.items():
            if name in hosts:
                raise ConfigError(f"{display_path(source)}: host {name!r} is also defined in "
                                  f"{display_path(origin[name])}",
                                  hint=f"rename one of them; files in {hosts_d()} are written by tools "
                                       "(`vllm-orch sim down` removes the simulator's)")
            hosts[name] = entry
            origin[name] = source
    inv = Inventory(hosts=hosts, groups=groups)
    inv._group_doc = group_doc
    check_groups(inv)
    return inv


def validate_inventory_file(path: Path) -> Inventory:
    """One inventory file as `vllm-orch validate` checks it: its own fields, then its groups against
    its hosts plus those of the extra-inventory folder (where a group may find its members)."""
    inv = load_inventory_file(path)
    if inv.groups:
        hosts = dict(inv.hosts)
        for other in extra_inventory_files():
            if other.resolve() != path.resolve():
                try:
                    hosts.update({k: v for k, v in load_inventory_file(other).hosts.items() if k not in hosts})
                except ConfigError:
                    pass                         # that file's own errors are reported on its own line
        merged = Inventory(hosts=hosts, groups=inv.groups)
        merged._group_doc = inv._group_doc
        check_groups(merged)
    return inv


def get_host(inventory: Inventory, name: str) -> HostEntry:
    if name in inventory.hosts:
        return inventory.hosts[name]
    if name == LOCAL:
        return HostEntry(name=LOCAL, address=LOCAL)
    names = sorted(inventory.hosts)
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    if close:
        hint = f"did you mean {close[0]!r}?"
    elif names:
        hint = f"known hosts: {', '.join(names)}"
    else:
        hint = f"no inventory found: {NO_INVENTORY_HINT}"
    raise ConfigError(f"no host named {name!r} in the inventory", hint=hint)


def select_hosts(inventory: Inventory, names: list[str] = (), groups: list[str] = (),   # type: ignore[assignment]
                 every: bool = False) -> list[HostEntry]:
    """The hosts a command's selection names, in the order given (`--host a,b`, then each `--group`'s
    members in the group's order; `--all`: the inventory's order), each once. An unknown host or group
    is a ConfigError (exit 2) with a suggestion."""
    picked: dict[str, HostEntry] = {}
    if every:
        picked.update(inventory.hosts)
    for name in names:
        if name not in picked:
            picked[name] = get_host(inventory, name)
    for group in groups:
        if group not in inventory.groups:
            known = sorted(inventory.groups)
            close = difflib.get_close_matches(group, known, n=1, cutoff=0.5)
            raise ConfigError(f"no group named {group!r} in the inventory",
                              hint=f"did you mean {close[0]!r}?" if close else
                              (f"known groups: {', '.join(known)}" if known else
                               "define groups in hosts.yaml: `groups: {prod: [gpu1, gpu2]}`"))
        for name in inventory.groups[group]:
            picked.setdefault(name, inventory.hosts[name])
    return list(picked.values())


def inventory_schema() -> dict:
    schema = Inventory.model_json_schema()
    schema["title"] = "vllm-orch host inventory"
    return schema
