"""Issue 26, finding 2, the root part of the health check and the head watch (unit_probe.py restart)
with a stand-in systemctl (probehelp): a deliberate restart flushes systemd's start rate counter
first (`systemctl reset-failed`), so it never uses up the crash-loop limit; the watchers' own
restarts are bounded apart, by their history records: StartLimitBurst of them within the window,
then one record that says so and what to run, and the unit is left alone. A deploy starts the count
afresh. (On a real systemd: tests/integration/test_systemd_start_limit.py.)"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from tests.integration.probehelp import root_restart, stand_in_systemctl


def history(tmp_path) -> list[dict]:
    path = tmp_path / "state" / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def systemctl_calls(tmp_path) -> list[str]:
    path = tmp_path / "systemctl.log"
    return path.read_text().splitlines() if path.exists() else []


def restart(tmp_path, operation="health-restart"):
    extra = ["--limit-burst", "3", "--limit-interval", "600"]
    if operation == "head-lost-restart":
        extra += ["--address", "10.0.0.1", "--port", "29500"]
    return root_restart(tmp_path, 75, operation, "x", *extra)


def test_a_deliberate_restart_flushes_the_start_limit_first(tmp_path):
    stand_in_systemctl(tmp_path)
    assert restart(tmp_path).returncode == 0
    assert systemctl_calls(tmp_path) == ["reset-failed vllm-x.service", "restart --no-block vllm-x.service"]


def test_the_watchers_restarts_are_bounded_apart_and_say_what_to_run(tmp_path):
    stand_in_systemctl(tmp_path)
    (tmp_path / "state").mkdir()
    old = (datetime.now(UTC) - timedelta(seconds=900)).isoformat(timespec="seconds")
    with open(tmp_path / "state" / "history.jsonl", "w") as f:          # outside the 600 s window
        f.write(json.dumps({"at": old, "operation": "health-restart", "model": "x", "ok": True}) + "\n")
    for operation in ("health-restart", "head-lost-restart", "health-restart"):
        assert restart(tmp_path, operation).returncode == 0
    assert systemctl_calls(tmp_path).count("restart --no-block vllm-x.service") == 3
    refused = restart(tmp_path)                                          # the fourth inside the window
    assert refused.returncode == 1 and "3 restarts by its watchers within 600 s" in refused.stdout
    assert systemctl_calls(tmp_path).count("restart --no-block vllm-x.service") == 3
    last = history(tmp_path)[-1]
    assert last["ok"] is False and last["limit"] is True
    assert "restarted it 3 times within 600 s" in last["refused"] and "`vllm-orch logs x`" in last["refused"]
    assert restart(tmp_path).returncode == 1 and len(history(tmp_path)) == 5      # said once
    # a deploy starts the count afresh (and gave systemd's counter its starts back)
    now = datetime.now(UTC).isoformat(timespec="seconds")
    with open(tmp_path / "state" / "history.jsonl", "a") as f:
        f.write(json.dumps({"at": now, "operation": "deploy", "model": "x", "ok": True}) + "\n")
    assert restart(tmp_path).returncode == 0
    assert systemctl_calls(tmp_path).count("restart --no-block vllm-x.service") == 4
