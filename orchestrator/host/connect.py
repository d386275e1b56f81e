"""Opening a Host for an inventory entry: LocalHost for `local`, SshHost (paramiko) otherwise."""

from __future__ import annotations

from orchestrator.config.inventory import HostEntry
from orchestrator.host.base import Host


def open_host(entry: HostEntry, accept_new_host_key: bool = False) -> Host:
    if entry.is_local:
        from orchestrator.host.local import LocalHost

        return LocalHost(entry.name, sudo=entry.sudo, env=entry.env)
    from orchestrator.host.ssh import SshHost  # paramiko is imported only when a remote host is used

    return SshHost.from_inventory(entry.name, entry.model_dump(), accept_new_host_key=accept_new_host_key)
