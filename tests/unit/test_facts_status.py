"""`status` asks the host-side facts script for its own subset in one round trip
(facts.gather_for_status): the facts it shows plus the records around them (uptime, the deploy
lock's holder, the health checks, the history tail). The script's answer is parsed here the way
status parses it, from a real run of the script on a state folder made for the test."""

from __future__ import annotations

import fcntl
import json
import os
import sys

import pytest

from orchestrator.config.inventory import HostEntry
from orchestrator.host.facts import StatusExtras, gather, gather_for_status
from orchestrator.host.local import LocalHost
from orchestrator.ops.status import read_extras
from orchestrator.paths import package_file

SCRIPT = package_file("host", "remote", "facts_script.py").read_text()


@pytest.fixture
def host_dirs(tmp_path):
    """A process host whose state folder has an active record (its model installed nowhere), 600
    history lines with a torn one among them, two health checks (one unreadable) and a fake vLLM
    distribution on the host Python's path."""
    state, models = tmp_path / "state", tmp_path / "models"
    (state / "health").mkdir(parents=True)
    models.mkdir()
    (state / "active.json").write_text(json.dumps({"model": "mm-a", "port": 8001}))
    lines = [json.dumps({"operation": "bench" if i % 2 else "deploy", "n": i}) for i in range(600)]
    lines[550] = '{"operation": "deploy", "n": '            # torn by a crash mid-write
    (state / "history.jsonl").write_text("\n".join(lines) + "\n")
    (state / "health" / "mm-a.json").write_text(json.dumps({"ok": True, "at": 1.0}))
    (state / "health" / "broken.json").write_text("{not json")
    # health/ is the service user's: a link it planted to a file only root may read is not followed
    (tmp_path / "root-only.json").write_text(json.dumps({"ok": False, "reason": "root's secret"}))
    (state / "health" / "linked.json").symlink_to(tmp_path / "root-only.json")
    dist = tmp_path / "site" / "vllm-9.8.7.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 9.8.7\n\nVersion: no\n")
    return tmp_path


def entry_for(root, **extra) -> HostEntry:
    return HostEntry.model_validate({
        "name": "h", "address": "local", "service_manager": "process", "service_user": "root",
        "models_root": str(root / "models"), "state_dir": str(root / "state"), "python": sys.executable,
        "vllm": "/nonexistent/vllm", "nvidia_smi": "nvidia-smi-absent",
        "env": {"PYTHONPATH": str(root / "site")}, **extra})


def test_status_subset_in_one_round_trip(host_dirs):
    entry = entry_for(host_dirs)
    host = LocalHost("h", env=entry.env)
    facts, extras = gather_for_status(host, entry, history_tail=500)
    assert host.stats.round_trips == 1
    history, uptime, lock, checks = read_extras(extras)
    # the last 500 lines, oldest first, the torn one left out
    assert [rec["n"] for rec in history] == [n for n in range(100, 600) if n != 550]
    assert uptime is not None and uptime > 0
    assert lock is None                                        # no lock file: nobody holds it
    assert checks == {"mm-a": {"ok": True, "at": 1.0}}          # the unreadable check and the link are left out
    # the active record's model gets its service state although nothing is installed
    assert facts.active is not None and facts.active.shown() == {"model": "mm-a", "port": 8001, "gpus": [],
                                                                 "argv": [], "enabled": False}
    assert facts.services["mm-a"].active is False and facts.running() == []
    # vLLM's version from its dist-info (the first Version: header), without importlib.metadata
    assert facts.vllm_version == "9.8.7"
    # what status does not show is not asked for: nvidia-smi's banner, the service user, port holders
    assert facts.driver_version is None and facts.users == {} and facts.service_reach is None
    assert facts.ports == {}
    assert facts.gpu_error and "not found" in facts.gpu_error
    # an idle host needs no process facts, so psutil was never imported
    assert facts.raw["psutil"] is None


def test_full_facts_keep_what_status_leaves_out(host_dirs):
    entry = entry_for(host_dirs)
    facts = gather(LocalHost("h", env=entry.env), entry, ["mm-a"], ports=[1])
    assert "status" not in facts.raw and "banner_raw" in facts.raw
    assert facts.users and "root" in facts.users and facts.service_reach is not None
    assert facts.ports == {1: [], 8001: []}      # the asked port and the recorded service's
    assert facts.vllm_version == "9.8.7"
    assert facts.raw["psutil"]            # the full facts say which psutil the host has


def test_the_lock_holder_is_read_only_while_the_lock_is_held(host_dirs):
    """flock semantics: a holder file left by a finished run is not reported; a held lock whose
    holder file is missing is reported as held by someone unknown."""
    entry = entry_for(host_dirs)
    lock = host_dirs / "state" / "lock" / "deploy.lock"
    lock.parent.mkdir()
    lock.write_text("")
    (host_dirs / "state" / "deploy.lock.json").write_text(json.dumps({"operation": "deploy", "pid": 1}))

    def holder():
        return read_extras(gather_for_status(LocalHost("h", env=entry.env), entry, 10)[1])[2]

    assert holder() is None                                     # a stale holder file
    fd = os.open(lock, os.O_RDONLY)          # held as the deploy's `flock` holds it (another process
    fcntl.flock(fd, fcntl.LOCK_EX)           # than the script's, another open file)
    try:
        assert holder() == {"operation": "deploy", "pid": 1}
        (host_dirs / "state" / "deploy.lock.json").unlink()
        assert holder() == {"holder": "unknown"}
    finally:
        os.close(fd)
    assert holder() is None


@pytest.mark.parametrize("extras", [
    {}, {"uptime": "x", "lock": [1], "health": [], "history": "not a list"},
    {"uptime": None, "lock": "held", "health": {"a": 1, "b": {"ok": False}},
     "history": [1, None, "[1]", "{}", '{"operation": 3}', '{"operation": "deploy"}']},
])
def test_read_extras_takes_only_what_has_the_expected_shape(extras):
    history, uptime, lock, checks = read_extras(StatusExtras.model_validate(extras))
    assert uptime is None and lock is None
    assert all(isinstance(rec, dict) for rec in history)
    assert checks == ({"b": {"ok": False}} if extras.get("health") else {})
    assert history == ([{"operation": "deploy"}] if isinstance(extras.get("history"), list) else [])


def test_nvidia_smi_queries_run_side_by_side(tmp_path):
    """sh_all starts every command before it waits for any: each command marks that it started, then
    waits (up to 60 s) for the others' marks, and answers only if it saw them all (run one after
    another, the first would wait in vain); a missing one is 127, each answer in order. (It asserted a
    wall time, under 2.5 s for three 1 s commands, and a busy machine broke it.)"""
    ns: dict = {}
    exec(compile(SCRIPT.replace("\nmain()\n", "\n"), "facts_script.py", "exec"), ns)

    def cmd(me: str, say: str) -> list[str]:
        marks = " ".join(str(tmp_path / m) for m in ("a", "b", "c"))
        return ["sh", "-c", f"touch {tmp_path / me}; for i in $(seq 600); do ok=1; for m in {marks}; do "
                            f"[ -e $m ] || ok=0; done; [ $ok = 1 ] && break; sleep 0.1; done; [ $ok = 1 ] && {say}"]

    out = ns["sh_all"]([cmd("a", "echo a"), cmd("b", "echo b >&2; exit 3"), ["no-such-command-here"],
                        cmd("c", "echo c")], timeout=90)
    assert [o["rc"] for o in out] == [0, 3, 127, 0], out
    assert out[0]["out"] == "a\n" and out[1]["err"] == "b\n" and out[3]["out"] == "c\n"
    assert "not found" in out[2]["err"]
    slow = ns["sh_all"]([["sleep", "5"]], timeout=0.3)
    assert slow[0]["rc"] == 124
