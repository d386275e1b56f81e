"""A manifest as it runs on one host: the manifest, then what it needs on the hardware class the
host's GPUs belong to, then the host's own settings. Pure: (manifest, host entry, GPU names) in,
the effective manifest and where each changed value came from out.

Precedence and conflicts (docs/user-guide.md, "Per-host settings"):
- `requires.hardware.CLASS` of the manifest replaces the manifest's vllm fields, env names,
  min_vllm_version and performance on that class: the model's author wrote both.
- the host's `overrides` (`*`, then the model's own entry) win over both for the few fields that
  follow a machine (port, bind address, GPU ids, memory fraction, batch limits, load format,
  start-up budgets). The result must still be a valid manifest, else the host setting is blamed.
- the service's placement (config/placement.py ServiceSpec: the command line's `--gpus 4-7 --port
  8001`, a swap's --replace, or where an earlier run placed the service) wins over the host's
  overrides; its GPU count is the manifest's. The service's name (`--name`) names its unit and
  records; the model's name stays what its weights folder and the inventory's overrides are keyed by.
- the host's `service_env` (then the override's) ADDS environment. A name the model already sets to
  another value is an error: the host would silently change the model's tuning, or the model the
  host's; one of them has to drop it. The same value twice is accepted.
- names vllm-orch writes itself (CUDA_VISIBLE_DEVICES, ...) and the manifest's secret names are
  refused in service_env.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from orchestrator.config.hardware import CLASS_KEYS, by_key, classify
from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import RENDERED_ENV, Manifest
from orchestrator.config.placement import ServiceSpec
from orchestrator.errors import ConfigError

MANIFEST = "manifest"


@dataclass(frozen=True)
class Effective:
    manifest: Manifest                      # what is rendered, probed and recorded on this host
    hardware: str | None = None             # the class of the service's GPUs (None: not known)
    hardware_problem: str | None = None     # why the host's GPUs do not fit the manifest's classes
    applied: bool = False                   # the manifest's requires.hardware entry for it was applied
    origins: dict[str, str] = field(default_factory=dict)   # field path / env.NAME -> where from

    def origin(self, path: str) -> str:
        """Where a field's value comes from: `manifest` unless a class or the host changed it."""
        return self.origins.get(path, MANIFEST)

    def hardware_note(self) -> str | None:
        """One line for plans and preflight: which class applied."""
        if self.hardware is None:
            return None
        cls = by_key(self.hardware)
        what = f"{cls.arch}, {cls.interconnect}" if cls else ""
        applied = f"requires.hardware.{self.hardware} applied" if self.applied else ""
        inner = "; ".join(t for t in (what, applied) if t)
        return f"hardware class {self.hardware}" + (f" ({inner})" if inner else "")


def _set(data: dict, path: str, value: Any) -> None:
    section, _, name = path.partition(".")
    data[section][name] = value


def _hardware(m: Manifest, gpu_ids: list[int], gpu_names: Mapping[int, str] | None,
              explicit: str | None) -> tuple[str | None, str | None]:
    cls: str | None
    problem: str | None
    if explicit is not None:
        if explicit not in CLASS_KEYS:
            raise ConfigError(f"{explicit!r} is not a hardware class", hint=f"known: {', '.join(CLASS_KEYS)}")
        cls, problem = explicit, None
    elif gpu_names is None:
        return None, None
    else:
        cls, problem = classify([gpu_names[i] for i in gpu_ids if i in gpu_names])
    classes = m.requires.hardware
    if cls is not None and classes and cls not in classes:
        problem = (f"the GPUs are of class {cls}; {m.name} states what it needs on "
                   f"{', '.join(classes)} only (add requires.hardware.{cls} to run it there)")
    elif problem and not classes:
        problem = None                  # a manifest without classes runs on any GPU
    return cls, problem


def effective(m: Manifest, entry: HostEntry, gpu_names: Mapping[int, str] | None = None,
              hardware: str | None = None, spec: ServiceSpec | None = None) -> Effective:
    """The manifest M (a model's, as loaded) as it runs on this host. `gpu_names`: nvidia-smi's
    names by index (None: not read, e.g. `render` offline); `hardware`: a class chosen explicitly
    (`render --hardware`); `spec`: the service it runs as (config/placement.resolve: its name, and
    this node's GPUs and port); None: the model's own service where its manifest and the inventory
    place it."""
    overrides = entry.override_for(m.name)        # the inventory names models, not services
    node = spec.node(entry.name) if spec is not None else None
    gpu_ids = list(node.gpus) if node is not None else list(m.serving.visible_devices)
    if node is None:
        for _, ov in overrides:
            if ov.serving.gpu_ids is not None:
                gpu_ids = list(ov.serving.gpu_ids)
    cls, problem = _hardware(m, gpu_ids, gpu_names, hardware)
    data = m.model_dump()
    origins: dict[str, str] = {}
    if spec is not None and spec.name != m.name:   # the model as another service (--name): the same served name
        data["name"] = spec.name
        data["serving"]["served_model_name"] = m.served_name
    needs = m.requires.hardware.get(cls) if cls else None
    if needs is not None:
        where = f"requires.hardware.{cls}"
        for name, value in needs.vllm.items():
            data["vllm"][name] = value
            origins[f"vllm.{name}"] = where
        for name, value in needs.env.items():
            data["env"][name] = value
            origins[f"env.{name}"] = where
        if needs.min_vllm_version is not None:
            data["requires"]["min_vllm_version"] = needs.min_vllm_version
            origins["requires.min_vllm_version"] = where
        if needs.performance is not None:
            data["performance"] = needs.performance.model_dump()
            origins["performance"] = where
    host_env = [(entry.where("service_env", n), n, v) for n, v in entry.service_env.items()]
    for key, ov in overrides:
        host_env += [(entry.where("overrides", key, "service_env", n), n, v) for n, v in ov.service_env.items()]
    model_env = dict(data["env"])
    for where, name, value in host_env:
        if name in RENDERED_ENV:
            raise ConfigError(f"{where}: {name} is written by vllm-orch from {RENDERED_ENV[name]}")
        if name in m.serving.secret_env:
            raise ConfigError(f"{where}: {name} is a secret of {m.name} (serving.secret_env): it comes from "
                              "the environment of `vllm-orch deploy`, not from the inventory")
        if name in model_env and model_env[name] != value:
            by = origins.get(f"env.{name}", "env")
            raise ConfigError(
                f"{where}: {m.name} sets {name}={model_env[name]} ({by}); a host adds service "
                f"environment, it does not change a model's",
                hint=f"keep {name} in one place: the host's service_env when it depends on the machine, "
                     "the manifest when the model needs it everywhere")
        if name not in model_env:
            data["env"][name] = value
            origins[f"env.{name}"] = where
    for key, ov in overrides:
        for path, value in ov.set_fields().items():
            _set(data, path, value)
            origins[path] = entry.where("overrides", key, *path.split("."))
    if node is not None and spec is not None:      # placed by a run: wins over the host's overrides
        for what, path, value, origin in (("gpus", "serving.gpu_ids", list(node.gpus), node.gpus_from),
                                          ("port", "serving.port", node.port, node.port_from)):
            if origin.placed:
                _set(data, path, value)
                origins[path] = spec.origin_label(what, origin)
    if spec is not None and spec.cluster_port is not None and data.get("multinode") is not None:
        cp = spec.cluster_port                      # the port the nodes meet at, as resolved
        data["multinode"][cp.name] = cp.port
        origins[f"multinode.{cp.name}"] = spec.origin_label(cp.name, cp.origin)
    try:
        result = Manifest.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        blamed = next((o for p, o in origins.items() if p.startswith(("serving.", "vllm.", "startup."))
                       and not o.startswith("requires.")), None)
        raise ConfigError(f"{blamed or entry.where('overrides')}: with this host's settings "
                          f"{m.name} is not valid: {msg.split('@ ', 1)[-1]}") from None
    return Effective(result, cls, problem, needs is not None, origins)
