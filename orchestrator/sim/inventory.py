"""What `vllm-orch sim up` knows about a SIMULATED host, and the ordinary inventory entry it becomes.

The product has no simulator field in its host schema: a simulated host reaches it as a plain
HostEntry (orchestrator.config.inventory) written into the extra-inventory folder, described with the
generic host settings any real host may use:

- `label: SIMULATED`                 shown beside the name in plans, status, hosts and bench reports;
- `disk_reserve_gib: 20 / scale`     the hub mirror serves files 1/scale of the real size, so the
                                     free space to keep shrinks the same way;
- `meminfo: <hostdir>/meminfo`       the host's RAM and available memory (default 1.5 TiB / 1.4 TiB),
                                     scaled the same way, in /proc/meminfo's format (kept by the
                                     simulated nvidia-smi's registry of live workers);
- `cpu_memory_per_gpu_gib: 12/scale` what each simulated GPU worker takes on the CPU side, scaled;
- `time_scale: speed`                the simulated vLLM loads `speed` times faster than the field
                                     (not with `--real-vllm`): expected times are divided by it;
- `skip_checks: [flags, env]`        only when the host's Python has no real vLLM to parse the flags
                                     (`vllm-orch sim up --vllm-python PATH` gives it one);
- `skip_checks: [torch-cuda]`        on a host whose vLLM is vLLM's CPU build (`sim up --real-vllm`):
                                     its torch is a CPU build, which that check rightly refuses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from orchestrator.config.inventory import DEFAULT_CPU_MEMORY_PER_GPU_GIB, HostEntry
from orchestrator.config.manifest import Requirements

LABEL = "SIMULATED"
# The manifests' default free-space reserve (requires.disk_reserve_gib), in real GiB.
REAL_DISK_RESERVE_GIB = float(Requirements.model_fields["disk_reserve_gib"].default)
# The inventory's default CPU memory per GPU worker (real GiB), which the simulated vLLM uses too.
REAL_CPU_MEMORY_PER_GPU_GIB = DEFAULT_CPU_MEMORY_PER_GPU_GIB
# Preflight checks a host's Python cannot make without a real vLLM installed (it parses the flags).
PARSER_CHECKS = ["flags", "env"]
# ...and the one vLLM's CPU build fails by design (its torch is not a CUDA build).
CPU_BUILD_CHECKS = ["torch-cuda"]


def _me() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


@dataclass
class SimHost:
    """One simulated host as the simulator sees it."""

    name: str
    dir: Path                                   # <sim home>/hosts/<name>
    flavour: Literal["process", "systemd"]
    speed: float                                # weight loading, times the field's 253 MB/s
    scale: int                                  # the mirror's files are 1/scale of the real ones
    python: str                                 # the Python recorded for host-side scripts
    real_vllm: bool = False                     # `python` imports a real vLLM (--vllm-python)
    hub_port: int | None = None
    # vLLM's CPU build ({"venv", "vllm", "python", "version"}) when the host's vLLM is the real one
    cpu_vllm: dict | None = None
    # systemd flavour: how to reach the container (address, port, user, identity_file, paths...)
    container: dict = field(default_factory=dict)
    # process flavour: the port every model serves on (an inventory `*` override). Process hosts share
    # this machine's network, and vLLM binds with SO_REUSEPORT: two hosts' services on one port would
    # both bind, and the kernel would spread each host's requests over all of them (separate machines,
    # or the systemd flavour's network namespaces, never share a port). None: the manifests' own.
    serving_port: int | None = None

    def host_entry(self) -> dict:
        """The inventory entry (a dict as in hosts.yaml), validated against the product's schema."""
        if self.container:
            entry = {k: v for k, v in self.container.items() if not k.startswith("_")}
        else:
            hdir = self.dir
            env = {"PYTHONPATH": str(hdir / "site-packages"), "HF_HUB_DISABLE_TELEMETRY": "1"}
            if self.hub_port:
                env["HF_ENDPOINT"] = f"http://127.0.0.1:{self.hub_port}"
            # A process host on this machine runs its services as whoever runs the simulator (a
            # process host can switch users only as root, and must not create one here).
            # Process hosts share this machine's network: the nodes of a multi-node service meet at
            # 127.0.0.1 (cluster.address; a name like "local" is no address a rank can connect to).
            entry = {"address": "local", "service_manager": "process", "service_user": _me(),
                     "cluster": {"address": "127.0.0.1"},
                     "models_root": str(hdir / "models"), "vllm": str(hdir / "bin" / "vllm"),
                     "python": self.python, "nvidia_smi": str(hdir / "bin" / "nvidia-smi"),
                     "units_dir": str(hdir / "units"), "state_dir": str(hdir / "state"), "env": env,
                     # a manifest's engine: is built in the host's folder, never in this machine's
                     # /var/lib/vllm-orch/engines (root runs the simulator in CI)
                     "engines_root": str(hdir / "engines")}
        entry["label"] = LABEL
        if self.serving_port and not self.container:
            entry["overrides"] = {"*": {"serving": {"port": self.serving_port}}}
        entry["disk_reserve_gib"] = REAL_DISK_RESERVE_GIB / self.scale
        if self.container:           # the host folder is bind-mounted into the container
            from orchestrator.sim.nspawn_tree import SIM_MOUNT
            entry["meminfo"] = f"{SIM_MOUNT}/meminfo"
        else:
            entry["meminfo"] = f"{self.dir}/meminfo"
        entry["cpu_memory_per_gpu_gib"] = REAL_CPU_MEMORY_PER_GPU_GIB / self.scale
        if not self.container and os.geteuid() != 0:
            # nft needs root: a simulated process host of a non-root user (its own machine) cannot
            # guard sleep mode's dev endpoints; said in the plan of every sleep-capable service
            entry["dev_guard"] = False
        if not self.cpu_vllm and self.speed > 1:      # vLLM's CPU build loads at its own pace
            entry["time_scale"] = self.speed
        if self.cpu_vllm:      # its venv's vllm and python, no faked packages, a CPU torch
            entry["vllm"], entry["python"] = self.cpu_vllm["vllm"], self.cpu_vllm["python"]
            entry["env"] = {k: v for k, v in entry["env"].items() if k != "PYTHONPATH"}
            entry["skip_checks"] = list(CPU_BUILD_CHECKS)
            if self.container:
                # The venv is bound at its own path on this machine, under /root (0700), which the
                # default unprivileged service user cannot enter: the service runs as root here.
                entry["service_user"] = "root"
        elif not self.real_vllm:
            entry["skip_checks"] = list(PARSER_CHECKS)
        HostEntry(name=self.name, **entry)      # the product must accept what we write
        return entry
