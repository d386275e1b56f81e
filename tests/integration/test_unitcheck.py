"""verify_unit: the real `systemd-analyze verify` on a unit whose ExecStart binary is absent."""

from __future__ import annotations

import pytest

from orchestrator.sim import unitcheck

pytestmark = pytest.mark.skipif(bool(unitcheck.available()), reason=str(unitcheck.available()))

UNIT = """[Unit]
Description=vLLM kimi
After=network-online.target
Wants=network-online.target

[Service]
Type=exec
EnvironmentFile=/etc/vllm-orch/kimi.env
ExecStart=/opt/vllm/bin/vllm serve /models/kimi --port 8000
Restart=on-failure

[Install]
WantedBy=multi-user.target
"""


def test_a_good_unit_passes_without_the_binary_installed():
    ok, err = unitcheck.verify_unit(UNIT, ["/opt/vllm/bin/vllm"], unit_name="vllm-kimi.service")
    assert ok, err
    assert err == ""


def test_an_unknown_key_fails_although_systemd_only_warns():
    ok, err = unitcheck.verify_unit(UNIT.replace("Restart=", "Bogus=1\nRestart="),
                                    ["/opt/vllm/bin/vllm"])
    assert not ok
    assert "Unknown key 'Bogus'" in err and "vllm-orch-unitcheck" not in err


def test_a_bad_value_fails():
    ok, err = unitcheck.verify_unit(UNIT.replace("Restart=on-failure", "TimeoutStopSec=soon"),
                                    ["/opt/vllm/bin/vllm"])
    assert not ok and "Failed to parse" in err


def test_an_exec_path_not_declared_fails():
    ok, err = unitcheck.verify_unit(UNIT, [])
    assert not ok and "is not executable" in err
