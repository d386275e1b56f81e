"""Pure parts of status / stop / gc / history: state rules, leftover selection, gc planning,
the on-host delete guard, history lines."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from orchestrator.cli.views import gpu_lines, history_details, process_lines, unit_lines
from orchestrator.errors import RefusedError
from orchestrator.host.facts import HostFacts, ModelDir
from orchestrator.host.modeldirs import delete_script
from orchestrator.host.ownership import ABANDONED, FOREIGN, LEFT, SERVICE, Proc
from orchestrator.host.records import ServiceRecord
from orchestrator.host.services import ServiceState
from orchestrator.ops.status import bench_summary, decide_state, deploy_summary, pick_model
from orchestrator.ops.stop import deploy_started_at
from orchestrator.plan.stop import gc_choice, leftovers, model_gpus


@pytest.mark.parametrize("active,failed,health,listed,expected", [
    (False, False, None, None, "stopped"),
    (False, True, None, None, "failed"),
    (True, False, None, None, "loading"),          # bound but not listening yet
    (True, False, 503, None, "failed"),            # engine dead
    (True, False, 200, False, "loading"),          # up, served name not listed yet
    (True, False, 200, True, "ready"),
    (True, False, 500, None, "loading"),
])
def test_decide_state(active, failed, health, listed, expected):
    state, reason = decide_state(active, failed, health, listed)
    assert state == expected and reason


def test_the_unit_state_has_the_last_word_on_systemd_hosts():
    assert decide_state(True, False, 200, True, unit_ready=False)[0] == "loading"   # its probe has not passed
    assert decide_state(True, False, 200, True, unit_ready=True) == \
        ("ready", "/health 200 and the served name is listed, unit active")
    state, reason = decide_state(False, False, None, None, restarting=True)       # activating (auto-restart)
    assert state == "failed" and "restarts it after RestartSec" in reason


def test_failure_words_say_why_and_whether_the_restarts_ran_out():
    from orchestrator.ops.status import failure_words

    assert failure_words({"Result": "timeout"}).startswith("not ready within its start-up budget")
    assert failure_words({"Result": "exit-code", "NRestarts": "2"}, limit_hit=True).endswith(
        "2 starts failed in a row, then the start limit (StartLimitBurst) stopped the restarts")
    assert failure_words({"Result": "signal", "NRestarts": "1"}) == \
        "vLLM was killed by a signal; systemd restarted it 1 time"


def test_pick_model_prefers_the_running_recorded_model_then_a_loading_one():
    assert pick_model("a", ["a"]) == "a"
    assert pick_model("a", []) == "a"             # recorded, now failed/stopped
    assert pick_model("a", ["b"]) == "b"          # a swap loading b before it is recorded
    assert pick_model(None, ["b"]) == "b"                    # a first deploy still loading
    assert pick_model(None, []) is None


def test_deploy_and_bench_summaries():
    ok = deploy_summary({"operation": "deploy", "model": "m", "ok": True, "at": "x", "seconds": 3.2})
    assert ok["result"] == "ok" and ok["seconds"] == 3.2
    bad = deploy_summary({"operation": "swap", "model": "m", "ok": False, "root_cause": "RuntimeError: boom",
                          "error": "long"})
    assert bad["result"] == "failed" and bad["error"] == "RuntimeError: boom"
    refused = deploy_summary({"operation": "deploy", "ok": False, "refused": "disk"})
    assert refused["result"] == "refused"
    assert bench_summary({"operation": "bench", "model": "m", "single_stream_tok_s": 81.0}) == \
        {"model": "m", "single_stream_tok_s": 81.0}
    assert deploy_summary(None) is None and bench_summary(None) is None


def proc(pid, gpu, owner=None, left_by=None, vllm=True, name="VLLM::Worker_TP0"):
    kind = SERVICE if owner else LEFT if left_by else ABANDONED if vllm else FOREIGN
    return Proc(pid=pid, name=name, used_mib=1000, gpu_index=gpu, kind=kind, model=owner or left_by,
                start_time=pid * 100)


def test_stop_leftovers_only_on_the_models_gpus_and_never_a_running_models_or_foreign():
    procs = [proc(1, 0, owner="m"), proc(2, 1, left_by="m"), proc(3, 2),            # ours / unowned vLLM
             proc(4, 5, left_by="m"),                                               # another GPU
             proc(5, 3, owner="other"), proc(6, 3, left_by="other"),                # another model's
             proc(7, 2, vllm=False, name="python")]                                 # foreign
    held = leftovers(facts(procs=procs), "m", [0, 1, 2, 3])
    assert [p.pid for p in held.ours] == [1]
    assert [p.pid for p in held.kill] == [2, 3, 6]     # abandoned: by m, by nobody, by the dead "other"
    assert [p.pid for p in held.others] == [5] and [p.pid for p in held.foreign] == [7]


def facts(**kw) -> HostFacts:
    base = dict(hostname="h", disk_path="/", disk_total=10, disk_free=5, gpus=[], gpu_error=None,
                driver_version=None, cuda_version=None, procs=[], vllm_version=None, vllm_error=None,
                models={}, active=None, installed={}, services={}, usage={})
    base.update(kw)
    return HostFacts(**base)


def test_model_gpus_from_record_then_manifest_then_processes():
    f = facts(active=ServiceRecord(model="m", gpus=[3, 1]), procs=[proc(1, 6, left_by="m")])
    assert model_gpus(f, "m", [0]) == [1, 3]
    assert model_gpus(f, "x", [4, 5]) == [4, 5]
    assert model_gpus(facts(procs=[proc(1, 6, left_by="m")]), "m", None) == [6]


def test_plan_gc_keeps_active_and_running_and_orders_by_last_use():
    record = {"repo": "a/b", "files": {}, "complete": True}
    models = {n: ModelDir(n, b, dict(record, complete=n != "c"), t)
              for n, b, t in (("a", 10, 5.0), ("b", 20, 1.0), ("c", 30, 2.0), ("d", 40, 3.0))}
    f = facts(models=models, active=ServiceRecord(model="a"),
              services={"d": ServiceState(active=True, main_pid=9)})
    delete, keep = gc_choice(f)
    assert [c.name for c in delete] == ["b", "c"] and [c.verified for c in delete] == [True, False]
    assert sum(c.bytes for c in delete) == 50
    assert dict(keep) == {"a": "the active model", "d": "its service is running"}
    from orchestrator.config.inventory import HostEntry
    from orchestrator.plan.inputs import LockFacts
    from orchestrator.plan.stop import plan_gc

    plan = plan_gc(HostEntry(name="h", address="h"), f, LockFacts(held=False, path="/l"))
    assert [a.step for a in plan.actions] == ["lock", "keep", "delete", "delete"] and len(plan.confirmations()) == 2
    assert plan.info["bytes"] == 50 and "the active model" in plan.text()


@pytest.mark.parametrize("name", ["", "..", ".", "a/b", ".vllm-orch"])
def test_delete_script_refuses_odd_names(name):
    with pytest.raises(RefusedError):
        delete_script("/models", name)


def test_delete_script_deletes_a_child_and_refuses_symlinks_and_escapes(tmp_path: Path):
    root = tmp_path / "models"
    outside = tmp_path / "outside"
    (root / "old" / ".vllm-orch").mkdir(parents=True)
    (root / "old" / ".vllm-orch" / "verified.json").write_text('{"repo": "a/b", "files": {}}')
    (root / "old" / "w.safetensors").write_bytes(b"x")
    outside.mkdir()
    (outside / "precious").write_text("keep")
    (root / "link").symlink_to(outside)
    (root / "old" / "escape").symlink_to(outside)      # a symlink inside is removed, not followed

    def run(name):
        return subprocess.run(["sh", "-c", delete_script(str(root), name).text], capture_output=True, text=True)

    assert run("old").returncode == 0 and not (root / "old").exists()
    r = run("link")
    assert r.returncode == 3 and "symlink" in r.stderr
    assert (outside / "precious").read_text() == "keep"
    assert run("missing").returncode == 0                # already gone: nothing to do
    # The models root itself reached through a symlinked root still only deletes its children.
    alias = tmp_path / "alias"
    alias.symlink_to(root)
    (root / "n2" / ".vllm-orch").mkdir(parents=True)
    (root / "n2" / ".vllm-orch" / "verified.json").write_text('{"repo": "a/b", "files": {}}')
    assert subprocess.run(["sh", "-c", delete_script(str(alias), "n2").text]).returncode == 0
    assert not (root / "n2").exists() and root.is_dir()


def test_deploy_started_at_uses_the_last_deploy_of_that_model():
    hist = [{"operation": "deploy", "model": "m", "at": "2026-01-01T00:00:10+00:00", "seconds": 4},
            {"operation": "stop", "model": "m", "at": "2026-01-01T00:01:00+00:00"},
            {"operation": "deploy", "model": "m", "at": "2026-01-01T00:02:00+00:00", "seconds": 10},
            {"operation": "deploy", "model": "x", "at": "2026-01-01T00:03:00+00:00", "seconds": 1}]
    from datetime import datetime

    expected = datetime.fromisoformat("2026-01-01T00:02:00+00:00").timestamp() - 10 - 1
    assert deploy_started_at(hist, "m") == expected
    assert deploy_started_at(hist, "nope") is None


def test_history_details_and_views():
    assert "deleted a, b" in history_details({"operation": "gc", "deleted": [{"name": "a"}, {"name": "b"}],
                                              "freed_bytes": 2e9})
    assert "killed 2 leftovers" in history_details({"operation": "stop", "was": "failed",
                                                    "killed": [{}, {}]})
    assert history_details({"operation": "deploy", "ok": False, "failure_kind": "crash",
                            "root_cause": "ValueError: x"}) == "crash: ValueError: x"
    assert "downtime 3.5s" in history_details({"operation": "swap", "ok": True, "downtime_s": 3.5})
    assert history_details({"operation": "health-restart", "ok": True, "reason": "2 failed"}) == \
        "restarted by its health timer: 2 failed"
    assert history_details({"operation": "health-busy", "ok": True, "reason": "busy, not hung: ..."}) == \
        "not restarted by its health timer: busy, not hung: ..."
    assert history_details({"operation": "head-lost-restart", "ok": True, "reason": "the head's store closed"}) == \
        "restarted by its head watch (a headless node whose head went away): the head's store closed"
    assert history_details({"operation": "swap", "ok": False, "error": "x", "interrupted": "ready",
                            "rollback": {"ok": True}}) == "interrupted during ready; rollback done"
    assert "disabled at boot" in history_details({"operation": "stop", "was": "running", "disabled": True})
    assert gpu_lines([{"index": i, "memory_used_mib": 1024 if i < 4 else 0, "memory_total_mib": 2048}
                      for i in range(8)]) == "GPU 0-3 1/2 GiB, GPU 4-7 0/2 GiB"
    lines = process_lines([{"pid": 1, "name": "W", "gpu": 0, "used_mib": 1024, "owner": "m", "left_by": None,
                            "kind": "service"},
                           {"pid": 2, "name": "W", "gpu": 1, "used_mib": 1024, "owner": "m", "left_by": None,
                            "kind": "service"},
                           {"pid": 3, "name": "python", "gpu": 2, "used_mib": 5, "owner": None,
                            "left_by": None, "kind": "foreign"}])
    assert lines[0] == ("2 processes of m on GPUs 0,1 (2 GiB, e.g. PID 1 W)", False)
    assert lines[1] == ("GPU 2: PID 3 python 5 MiB (foreign)", True)


def test_unit_lines_show_state_boot_root_cause_and_health():
    from orchestrator.ops.status import HostStatus

    st = HostStatus(host="h", unit_state="failed (exit-code)", enabled=True, restarts=2,
                    root_cause="ValueError: No available memory for the cache blocks.",
                    health={"failures": 1, "last": {"ok": False, "at": "2026-11-30T10:00:00+00:00",
                                                    "reason": "/health answered 503"}},
                    last_health_restart={"at": "2026-11-30T09:00:00+00:00", "reason": "2 health checks failed"})
    lines = unit_lines(st)
    assert lines[0] == "unit: failed (exit-code), starts at boot; restarted 2 times by systemd"
    assert lines[1] == "root cause: ValueError: No available memory for the cache blocks."
    assert lines[2].startswith("health: 1 failed check in a row") and lines[2].endswith("/health answered 503")
    assert lines[3].startswith("health timer restarted it") and lines[3].endswith("2 health checks failed")
    assert unit_lines(HostStatus(host="p")) == []           # a process host has no unit


def test_history_and_status_never_send_a_services_control_characters_to_the_terminal():
    """A health-restart reason quotes the service's answer ("answered 500: <body>"): a body holding
    escape sequences (clear the screen, set the title, OSC 8 links) reached the terminal raw."""
    import io

    from rich.console import Console

    from orchestrator.cli.views import render_history

    body = "\x1b[2J\x1b]0;pwned\x07\x1b]8;;http://evil/\x1b\\link\x9b31m"
    out = io.StringIO()
    render_history(Console(file=out, force_terminal=True, width=300), "h", [
        {"at": "2026-01-01T00:00:00+00:00", "operation": "health-restart", "model": "m" + body, "ok": True,
         "reason": f"a one-token completion answered 500: {body}"}])
    text = out.getvalue()
    assert "\x1b[2J" not in text and "\x1b]" not in text and "\x07" not in text and "\x9b" not in text, repr(text)
    assert "answered 500: link" in text          # the sequences removed whole, the text kept


def test_a_deploy_failures_root_cause_and_log_lines_reach_the_terminal_without_escape_sequences(capsys):
    """A failed start's error quotes the service's log (the root-cause line, the last lines): logsig
    stripped only colours, and the error printer sent the rest raw (an OSC 52 clipboard write, a
    cursor move, a CR forging "ok deployed"). The signature still matches through the colours."""
    from orchestrator.cli.main import _print_error
    from orchestrator.probe import logsig
    from orchestrator.probe.readiness import NotReady

    lines = ["\x1b[1;31mERROR\x1b[0m api_server.py: error: unrecognized arguments: --x\x1b]52;c;cHduZWQ=\x07",
             "\x9b2J\x1b[3Aup\rok deployed", "\x1bP+q544e\x1b\\tail\t end\r"]
    sig, line = logsig.root_cause(lines)
    assert sig is not None and sig.key == "unrecognized-arguments"
    _print_error(NotReady("minimax-m25 did not start", kind="fatal-log", root_cause=line,
                          last_lines=[logsig.clean(x) for x in lines], gates=[]))
    err = capsys.readouterr().err
    for c in ("\x1b", "\x07", "\x9b", "\r", "\t"):
        assert c not in err, (c, err)
    assert "root cause: ERROR api_server.py: error: unrecognized arguments: --x\n" in err
    assert "upok deployed" not in err and "up\\x0dok deployed" in err
    assert "tail  end\n" in err


@pytest.mark.parametrize("raw, shown", [
    ("a\x1b]52;c;ZWNobyBo\x07b", "ab"),                  # OSC 52, BEL-terminated
    ("a\x1b]8;;http://e/\x1b\\l\x1b]8;;\x1b\\b", "alb"),    # OSC 8, ST-terminated
    ("a\x9d0;t\x9cb", "ab"),                             # 8-bit OSC and ST
    ("a\x1b[12;1H\x1b[?25lb", "ab"),                     # CSI cursor move, private mode
    ("a\x9b2Jb", "ab"),                                  # 8-bit CSI
    ("a\x1bPq#0\x1b\\b\x1bX.\x1b\\c\x1b^.\x1b\\d\x1b_.\x1b\\e", "abcde"),   # DCS SOS PM APC
    ("a\x1b]0;never ends", "a"),                          # an unterminated string: dropped
    ("a\x1b7\x1b8\x1bc\x1b(0b", "ab"),                    # two-char (and charset) ESC sequences
    ("a\rb", "a\\x0db"), ("a\x08b", "a\\x08b"), ("a\x00\x7f\x85b", "a\\x00\\x7f\\x85b"),
    ("a\nb", "a\\x0ab"), ("a\tb", "a b"), ("end\x1b", "end\\x1b"), ("caf\u00e9 \u4e2d", "caf\u00e9 \u4e2d"),
])
def test_the_one_sanitiser_removes_escape_sequences_and_shows_other_controls(raw, shown):
    from orchestrator.fmt import printable

    assert printable(raw) == shown


def test_a_plan_quoting_a_hosts_process_name_prints_no_escape_sequence():
    """A plan names the host's processes (holders of the GPUs or the port, by their title, which
    their owner sets) and refusals quoting the host: all through the one sanitiser."""
    from orchestrator.plan.model import Action, Plan

    title = "python\x1b]52;c;ZWNobyBo\x07\x1b[1A\rok deployed"
    plan = Plan("deploy", "h (local)", "m", refusal=RefusedError(f"PID 4242 {title} holds port 8000"))
    plan.add(Action("port", f"PID 4242 {title} holds port 8000", details=[f"holder: {title}"]))
    text = plan.text()
    assert not any(c in text for c in "\x1b\x07\r\x9b"), repr(text)
    assert "PID 4242 python\\x0dok deployed holds port 8000" in text


def test_a_per_service_command_picks_the_only_awake_service_and_names_sleepers_when_it_asks():
    from orchestrator.config.placement import choose_service
    from orchestrator.errors import ConfigError
    assert choose_service(["a", "b"], None, "h", "logs SERVICE --host h", asleep=["a"]) == "b"
    assert choose_service(["a"], None, "h", "logs SERVICE --host h", asleep=["a"]) == "a"
    with pytest.raises(ConfigError) as err:
        choose_service(["a", "b", "c"], None, "h", "logs SERVICE --host h", asleep=["a"])
    assert "(a (asleep), b, c)" in str(err.value) and "vllm-orch logs b --host h" in str(err.value)
    with pytest.raises(ConfigError):                      # no `asleep`: no guess (stop)
        choose_service(["a", "b"], None, "h", "stop SERVICE --host h")


def test_status_names_the_last_deploy_that_changed_the_host_and_counts_the_runs_after_it():
    # `deploy` again after a deploy made status say "last deploy: ... ok (nothing to do)"; a refused
    # deploy of another model hid the one that serves.
    from orchestrator.ops.status import last_deploy
    history = [{"operation": "deploy", "model": "a", "ok": True, "at": "t1", "seconds": 31.0},
               {"operation": "bench", "model": "a", "ok": True, "at": "t2"},
               {"operation": "deploy", "model": "a", "ok": True, "noop": True, "at": "t3", "seconds": 0.4},
               {"operation": "deploy", "model": "b", "ok": False, "refused": "placement", "at": "t4"}]
    d = last_deploy(history)
    assert (d["model"], d["result"], d["seconds"]) == ("a", "ok", 31.0)
    assert d["later"] == {"runs": 2, "operation": "deploy", "model": "b", "result": "refused", "at": "t4"}
    failed = last_deploy(history + [{"operation": "swap", "model": "b", "ok": False, "error": "boom", "at": "t5"}])
    assert failed["result"] == "failed" and "later" not in failed          # a failure changed the host
    assert last_deploy(history[2:3])["result"] == "ok (nothing to do)"     # nothing else: said as it is
    assert last_deploy([]) is None
