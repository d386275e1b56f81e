"""The inventory: the generic host settings (label, disk_reserve_gib, skip_checks) and the
extra-inventory folder (hosts.d) that tools such as `vllm-orch sim up` write into."""

from __future__ import annotations

import pytest
import yaml

from orchestrator.config.checks import CHECK_NAMES
from orchestrator.config.inventory import HostEntry, hosts_d, load_inventory
from orchestrator.errors import ConfigError


def test_no_simulator_field_in_the_host_schema():
    fields = set(HostEntry.model_fields)
    assert not {f for f in fields if "sim" in f}
    with pytest.raises(ValueError):
        HostEntry(name="gpu1", address="gpu1", simulated=True)


def test_check_names_are_the_preflight_checks():
    from orchestrator.plan.preflight import CHECK_NAMES as PREFLIGHT

    assert set(CHECK_NAMES) == set(PREFLIGHT)


def test_label_is_shown_beside_the_name():
    e = HostEntry(name="gpu1", address="gpu1.example", user="ops", label="staging")
    assert e.describe() == "gpu1 (ops@gpu1.example, systemd, staging)"
    assert e.display_name == "gpu1 [staging]"
    plain = HostEntry(name="gpu2", address="local")
    assert plain.describe() == "gpu2 (this machine, systemd)" and plain.display_name == "gpu2"
    with pytest.raises(ValueError):
        HostEntry(name="gpu1", address="x", label="two\nlines")


def test_skip_checks_are_known_names_without_repeats():
    e = HostEntry(name="gpu1", address="x", skip_checks=["flags", "env", "flags"])
    assert e.skip_checks == ["flags", "env"]
    with pytest.raises(ValueError):
        HostEntry(name="gpu1", address="x", skip_checks=["flag"])


def _write(path, hosts: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"hosts": hosts}))


def test_extra_inventory_files_are_added(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    assert hosts_d() == tmp_path / "state" / "hosts.d"
    assert load_inventory().hosts == {}                      # no folder yet: nothing, no error
    _write(hosts_d() / "lab.yaml", {"lab1": {"address": "lab1.example", "label": "lab"}})
    _write(hosts_d() / "notes.txt", {"ignored": {"address": "x"}})
    _write(tmp_path / "hosts.yaml", {"gpu1": {"address": "gpu1.example"}})
    inv = load_inventory()
    assert sorted(inv.hosts) == ["gpu1", "lab1"] and inv.hosts["lab1"].label == "lab"


def test_a_host_defined_twice_names_both_files(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    _write(hosts_d() / "sim.yaml", {"sim": {"address": "local"}})
    _write(tmp_path / "hosts.yaml", {"sim": {"address": "gpu1.example"}})
    with pytest.raises(ConfigError) as info:
        load_inventory()
    assert "hosts.yaml: host 'sim' is also defined in" in str(info.value)
    assert "sim.yaml" in str(info.value) and info.value.exit_code == 2


def test_state_home_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ORCH_STATE_HOME", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert hosts_d() == tmp_path / "vllm-orch" / "hosts.d"
