"""The host inventory (hosts.yaml): how to reach each host and where things live on it.

Looked up from --inventory PATH, else ./hosts.yaml, else ~/.config/vllm-orch/hosts.yaml. Every
`*.yaml` in the extra-inventory folder (`hosts_d()`) is always added: tools that provision hosts
write one file there each (`vllm-orch sim up` writes its SIMULATED hosts there, `sim down` removes
the file), so this module knows nothing of who wrote it. A host whose address is `local` is this
machine, reached without SSH.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from orchestrator.config.checks import CheckName
from orchestrator.config.manifest import ENV_NAME, SLUG, Strict, _check_text, validation_error
from orchestrator.config.yamlsrc import YamlDoc, display_path
from orchestrator.errors import ConfigError

LOCAL = "local"


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
    units_dir: str = Field("/etc/systemd/system", description="Where units (systemd) or start scripts (process) are installed.")
    env_dir: str = Field("", description="Where the 0600 env files go. Default (empty): /etc/vllm-orch (systemd), "
                                         "units_dir (process).")
    state_dir: str = Field("/var/lib/vllm-orch/state", description="vllm-orch's records on the host: lock, active model, history.")
    log_dir: str = Field("", description="Service logs for `process` hosts. Default (empty): state_dir/../logs.")
    service_user: str = Field("root", description="User= of the rendered units.")
    models_disk_budget_gib: float | None = Field(
        None, gt=0, description="Most GiB that managed models may use in models_root (a disk budget); "
                                "downloads that would exceed it free or refuse like a full disk.")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment for every command vllm-orch runs on the host (e.g. HF_ENDPOINT for a "
                    "mirror, proxies). Not passed to the service: use the manifest's env for that.")
    label: str | None = Field(
        None, max_length=40,
        description="A short note shown beside the host's name in plans, `status`, `hosts` and bench "
                    "reports, e.g. `staging` (`vllm-orch sim up` writes `SIMULATED`).")
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

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if v and not SLUG.match(v):
            raise ValueError(f"{v!r} is not a lowercase slug")
        return v

    @field_validator("address", "models_root", "vllm", "nvidia_smi", "units_dir", "state_dir", "label")
    @classmethod
    def _text(cls, v: str | None) -> str | None:
        return v if v is None else _check_text(v, "the value")

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

    @field_validator("models_root", "units_dir", "state_dir", "env_dir", "log_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v:
            return v                                   # the default (env_dir, log_dir): filled in below
        if not v.startswith("/"):
            raise ValueError(f"{v!r} must be an absolute path")
        if v.rstrip("/") in ("", "/usr", "/etc", "/var", "/home", "/root", "/opt"):
            raise ValueError(f"{v!r} is too broad a folder for vllm-orch to manage")
        return v.rstrip("/")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not an environment variable name")
            _check_text(str(value), f"env.{key}")
        return {k: str(val) for k, val in v.items()}

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


class Inventory(Strict):
    hosts: dict[str, HostEntry] = Field(default_factory=dict, description="Hosts by name.")

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
        return Inventory.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, doc, "inventory", Inventory) from None


def load_inventory(explicit: Path | None = None) -> Inventory:
    """The user's inventory (if any) plus every extra inventory file of hosts_d(); a host name
    defined twice is refused, naming both files."""
    hosts: dict[str, HostEntry] = {}
    origin: dict[str, Path] = {}
    path = inventory_path(explicit)
    for source in extra_inventory_files() + ([path] if path is not None else []):
        for name, entry in load_inventory_file(source).hosts.items():
            if name in hosts:
                raise ConfigError(f"{display_path(source)}: host {name!r} is also defined in "
                                  f"{display_path(origin[name])}",
                                  hint=f"rename one of them; files in {hosts_d()} are written by tools "
                                       "(`vllm-orch sim down` removes the simulator's)")
            hosts[name] = entry
            origin[name] = source
    return Inventory(hosts=hosts)


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
        hint = "no inventory found: write hosts.yaml (see hosts.example.yaml) or run `vllm-orch sim up`"
    raise ConfigError(f"no host named {name!r} in the inventory", hint=hint)


def inventory_schema() -> dict:
    schema = Inventory.model_json_schema()
    schema["title"] = "vllm-orch host inventory"
    return schema
