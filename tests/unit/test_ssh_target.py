"""resolve_target: inventory fields over ~/.ssh/config over defaults, like `ssh` itself."""

from __future__ import annotations

from orchestrator.host.ssh_connect import resolve_target

CONFIG = """
Host gpu1
    HostName 10.0.0.5
    Port 2200
    User ubuntu
    IdentityFile ~/keys/gpu
    ProxyJump admin@bastion:2022

Host bastion
    HostName bastion.example.org
    IdentityFile ~/keys/bastion

Host *
    UserKnownHostsFile ~/custom_known_hosts
"""


def test_alias_fields_come_from_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = tmp_path / "config"
    cfg.write_text(CONFIG)
    t = resolve_target("gpu-a", "gpu1", ssh_config=str(cfg))
    assert (t.hostname, t.port, t.user) == ("10.0.0.5", 2200, "ubuntu")
    assert t.identity_files == (f"{tmp_path}/keys/gpu",)
    assert t.known_hosts_file == f"{tmp_path}/custom_known_hosts"
    assert t.known_hosts_name == "[10.0.0.5]:2200"
    j = t.jump
    assert (j.hostname, j.port, j.user) == ("bastion.example.org", 2022, "admin")
    assert j.identity_files == (f"{tmp_path}/keys/bastion",)


def test_inventory_values_win_over_the_config(tmp_path):
    cfg = tmp_path / "config"
    cfg.write_text(CONFIG)
    t = resolve_target("gpu-a", "gpu1", port=22, user="root", identity_file="/k",
                       known_hosts_file="/kh", ssh_config=str(cfg))
    assert (t.port, t.user, t.identity_files, t.known_hosts_file) == (22, "root", ("/k",), "/kh")
    assert t.known_hosts_name == "10.0.0.5"


def test_without_a_config_the_address_is_used_as_is(tmp_path):
    t = resolve_target("h", "192.0.2.7", ssh_config=str(tmp_path / "missing"), user="u")
    assert (t.hostname, t.port, t.user, t.jump) == ("192.0.2.7", 22, "u", None)
    assert t.where == "u@192.0.2.7:22"
