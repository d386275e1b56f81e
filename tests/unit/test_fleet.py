"""Fleets without hosts: inventory groups and their validation, host selection (--host a,b, --group,
--all) on the commands, the fleet runner's scheduling (bound, order, stop after a failure, a crash
is a row), the worst exit code, the summary / --json, and the fleet dry run's plan grouping."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from orchestrator.cli.main import cli, main
from orchestrator.config.inventory import HostEntry, load_inventory, select_hosts
from orchestrator.errors import ConfigError, ConnectError, RefusedError
from orchestrator.ops.fleet import (
    Board,
    HostOutcome,
    group_plans,
    normalised_plan,
    root_cause,
    run_fleet,
    worst_exit,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def inv(tmp_path, monkeypatch):
    """Write hosts.yaml (and optionally a hosts.d file) and load the merged inventory."""
    monkeypatch.setenv("VLLM_ORCH_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)

    def write(hosts: dict, groups: dict | None = None, extra: dict | None = None, text: str | None = None):
        path = tmp_path / "hosts.yaml"
        path.write_text(text if text is not None else yaml.safe_dump(
            {"hosts": hosts, **({"groups": groups} if groups is not None else {})}, sort_keys=False))
        if extra is not None:
            d = tmp_path / "state" / "hosts.d"
            d.mkdir(parents=True, exist_ok=True)
            (d / "sim.yaml").write_text(yaml.safe_dump({"hosts": extra}))
        return path

    return write


HOSTS = {"gpu1": {"address": "a"}, "gpu2": {"address": "b"}, "gpu3": {"address": "c"}}


# -- groups ----------------------------------------------------------------------------------------

def test_groups_select_their_hosts_in_order(inv):
    inv(HOSTS, {"prod": ["gpu3", "gpu1"], "lab": ["sim"]}, extra={"sim": {"address": "local"}})
    i = load_inventory()
    assert i.groups == {"prod": ["gpu3", "gpu1"], "lab": ["sim"]}      # a group may list hosts.d's hosts
    names = lambda es: [e.name for e in es]                                # noqa: E731
    assert names(select_hosts(i, groups=["prod"])) == ["gpu3", "gpu1"]
    # --host first, then each group; every host once
    assert names(select_hosts(i, ["gpu1", "gpu2"], ["prod"])) == ["gpu1", "gpu2", "gpu3"]
    assert names(select_hosts(i, every=True)) == ["sim", "gpu1", "gpu2", "gpu3"]   # the inventory's order
    with pytest.raises(ConfigError, match="no group named 'prd'") as e:
        select_hosts(i, groups=["prd"])
    assert "did you mean 'prod'" in e.value.hint
    with pytest.raises(ConfigError, match="no host named 'gpu9'"):
        select_hosts(i, ["gpu9"])


@pytest.mark.parametrize("groups,expect", [
    ({"prod": ["gpu1", "gpu7"]}, "hosts.yaml:11: groups.prod[1]: no host named 'gpu7' in the inventory"),
    ({"prod": []}, "hosts.yaml:9: groups.prod: the group is empty"),
    ({"gpu2": ["gpu1"]}, "hosts.yaml:9: groups.gpu2: 'gpu2' is also a host's name"),
    ({"Prod": ["gpu1"]}, "hosts.yaml:9: groups.Prod: 'Prod' is not a lowercase slug"),
])
def test_bad_groups_are_bad_input_with_file_and_line(inv, groups, expect):
    inv(HOSTS, groups)
    with pytest.raises(ConfigError) as e:
        load_inventory()
    assert str(e.value) == expect and e.value.exit_code == 2


def test_a_group_must_be_a_list_of_names(inv):
    inv({}, text="hosts:\n  gpu1: {address: a}\ngroups:\n  prod: gpu1\n")
    with pytest.raises(ConfigError, match="groups.prod"):
        load_inventory()


def test_validate_checks_groups_against_hosts_d(inv, tmp_path):
    inv(HOSTS, {"lab": ["sim"], "bad": ["nope"]}, extra={"sim": {"address": "local"}})
    r = CliRunner().invoke(cli, ["validate", str(tmp_path / "hosts.yaml")])
    assert r.exit_code == 2 and "groups.bad[0]: no host named 'nope'" in r.output, r.output


def test_validate_reads_a_file_of_groups_alone_as_an_inventory(inv, tmp_path):
    # A file with only `groups:` (its hosts in hosts.d) was read as a manifest: "name: field required".
    inv(HOSTS, extra={"sim": {"address": "local"}})
    groups = tmp_path / "groups.yaml"
    groups.write_text("groups:\n  lab: [sim]\n")
    r = CliRunner().invoke(cli, ["validate", str(groups)])
    assert r.exit_code == 0 and "(inventory)" in r.output, r.output
    groups.write_text("groups:\n  lab: [nope]\n")
    r = CliRunner().invoke(cli, ["validate", str(groups)])
    assert r.exit_code == 2 and "(manifest)" not in r.output and "name" not in r.output.split("groups")[0], r.output


# -- selection on the commands ---------------------------------------------------------------------

@pytest.fixture
def places(inv, tmp_path, monkeypatch):
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(REPO / "models" / "kimi-k25-int4.yaml", models / "kimi-k25-int4.yaml")
    monkeypatch.delenv("VLLM_ORCH_MODELS", raising=False)
    # unreachable on purpose: port 1 of loopback refuses at once
    dead = {f"gpu{i}": {"address": "127.0.0.1", "port": 1, "connect_timeout": 2} for i in (1, 2, 3)}
    inv(dead, {"prod": ["gpu1", "gpu2"]})
    return models


class Ran:
    def __init__(self, exit_code: int, output: str):
        self.exit_code, self.output = exit_code, output


@pytest.fixture
def run(capsys):
    """`vllm-orch --models M ARGS` through main() (the error boundary): exit code, stdout + stderr."""

    def invoke(models, *args) -> Ran:
        with pytest.raises(SystemExit) as e:
            main(["--models", str(models), *args])
            raise SystemExit(0)
        out = capsys.readouterr()
        return Ran(e.value.code or 0, out.out + out.err)

    return invoke


@pytest.mark.parametrize("args", [["history"], ["gc", "--dry-run"], ["logs", "kimi-k25-int4"]])
def test_one_host_commands_refuse_several(places, run, args):
    for sel in (["--host", "gpu1,gpu2"], ["--host", "gpu1", "--host", "gpu2"], ["--group", "prod"], ["--all"]):
        r = run(places, *args, *sel)
        assert r.exit_code == 2, (sel, r.output)
        assert f"`{args[0]}` works on one host; " in r.output and "are selected (gpu1, gpu2" in r.output
        assert len([ln for ln in r.output.splitlines() if ln.startswith("error:")]) == 1


def test_no_selection_is_bad_input_except_for_status(places, run):
    r = run(places, "deploy", "kimi-k25-int4")
    assert r.exit_code == 2 and "no host selected" in r.output
    r = run(places, "status", "--json")              # status: every host by default
    assert r.exit_code == 1 and [h["host"] for h in json.loads(r.output)] == ["gpu1", "gpu2", "gpu3"]


def test_unknown_group_or_host_is_bad_input(places, run):
    assert run(places, "deploy", "kimi-k25-int4", "--group", "prd").exit_code == 2
    assert run(places, "stop", "kimi-k25-int4", "--host", "gpu1,nope").exit_code == 2


def test_fleet_check_with_every_host_unreachable_is_one_failed_row_each(places, run):
    r = run(places, "check", "kimi-k25-int4", "--group", "prod", "--host", "gpu3", "--json")
    rows = json.loads(r.output)
    assert r.exit_code == 1, r.output
    assert [(x["host"], x["result"], x["exit_code"]) for x in rows] == \
        [("gpu3", "failed", 1), ("gpu1", "failed", 1), ("gpu2", "failed", 1)]
    assert all("cannot connect" in x["cause"] for x in rows)


def test_fleet_summary_table_without_a_terminal(places, run):
    r = run(places, "deploy", "kimi-k25-int4", "--group", "prod", "--parallel", "1")
    assert r.exit_code == 1
    lines = r.output.splitlines()
    assert lines[0] == "deploy kimi-k25-int4: gpu1, gpu2"          # the plain progress: one line per change
    assert "gpu1: connecting" in lines and "gpu2: failed" in lines
    assert "deploy kimi-k25-int4: 2 failed" in r.output
    table = r.output[r.output.index("host "):]
    assert "root cause" in table.splitlines()[0] and table.count("cannot connect") == 2


def test_complete_hosts_after_a_comma(places):
    import click

    from orchestrator.cli.options import complete_groups, complete_hosts
    ctx = click.Context(cli)
    assert [c.value for c in complete_hosts(ctx, None, "gpu1,g")] == ["gpu1,gpu2", "gpu1,gpu3"]
    assert [c.value for c in complete_groups(ctx, None, "p")] == ["prod"]


# -- the runner ------------------------------------------------------------------------------------

def entries(n: int) -> list[HostEntry]:
    return [HostEntry(name=f"h{i}", address=f"h{i}.example") for i in range(1, n + 1)]


def test_runner_bounds_the_hosts_in_flight_and_keeps_the_order():
    in_flight, peak, lock = [0], [0], threading.Lock()

    def one(entry, reporter):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        time.sleep(0.05)
        with lock:
            in_flight[0] -= 1
        return HostOutcome(0, note=entry.name.upper())

    rows = run_fleet(entries(7), one, parallel=3)
    assert peak[0] <= 3 and [r.host for r in rows] == [f"h{i}" for i in range(1, 8)]
    assert all(r.result == "ok" and r.note == r.host.upper() for r in rows)


def test_runner_default_runs_every_host_at_once():
    started = threading.Barrier(5, timeout=20)       # five hosts must all be in flight together

    def one(entry, reporter):
        started.wait()
        return HostOutcome(0)

    assert [r.result for r in run_fleet(entries(5), one)] == ["ok"] * 5


def test_a_raising_host_is_a_row_not_the_end_of_the_run():
    def one(entry, reporter):
        if entry.name == "h2":
            raise ConnectError("cannot connect to h2.example: connection refused", host="h2")
        if entry.name == "h3":
            raise KeyError("bug")
        return HostOutcome(0)

    rows = run_fleet(entries(4), one, parallel=2)
    assert [(r.host, r.result, r.code) for r in rows] == [("h1", "ok", 0), ("h2", "failed", 1),
                                                           ("h3", "failed", 1), ("h4", "ok", 0)]
    assert rows[1].cause == "cannot connect to h2.example: connection refused"
    assert rows[2].cause == "KeyError: 'bug'"


def test_stop_on_failure_starts_no_more_hosts():
    ran = []

    def one(entry, reporter):
        ran.append(entry.name)
        return HostOutcome(1 if entry.name == "h2" else 0, "ready: crashed" if entry.name == "h2" else None)

    rows = run_fleet(entries(4), one, parallel=1, stop_on_failure=True)
    assert ran == ["h1", "h2"]
    assert [r.result for r in rows] == ["ok", "failed", "not run", "not run"]
    ran.clear()
    rows = run_fleet(entries(4), one, parallel=1, stop_on_failure=False)     # --continue-on-failure
    assert ran == ["h1", "h2", "h3", "h4"] and [r.result for r in rows] == ["ok", "failed", "ok", "ok"]


def test_the_board_follows_each_host():
    seen = []
    board = Board(["h1", "h2"], on_change=lambda h, p: seen.append((h, p)))

    def one(entry, reporter):
        from orchestrator.plan.model import Action

        reporter.step_start(3, 9, Action("download", "get the weights"))
        reporter.event("phase", "loading weights")
        return HostOutcome(0)

    rows = run_fleet(entries(1), one, board=board)          # h2 is on the board but not selected
    assert [r.host for r in rows] == ["h1"]
    board.set("h2", "not run")
    assert seen == [("h1", "connecting"), ("h1", "[3/9] download"), ("h1", "ready: loading weights"), ("h1", "ok"),
                    ("h2", "not run")]
    snap = dict((h, (p, s)) for h, p, s in board.snapshot())
    assert snap["h1"][0] == "ok" and snap["h1"][1] is not None and snap["h2"] == ("not run", None)


def test_worst_exit_code():
    assert worst_exit([]) == 0 and worst_exit([0, 0]) == 0
    assert worst_exit([0, 2]) == 2 and worst_exit([2, 3]) == 3 and worst_exit([3, 1, 2]) == 1
    assert worst_exit([1, 130]) == 130 and worst_exit([0, 7]) == 7


def test_root_cause_is_one_line_without_the_host():
    err = RefusedError("disk full:\n  need 3 GB", host="gpu1", step="disk")
    assert root_cause(err) == "disk: disk full: need 3 GB"


# -- the fleet dry run -----------------------------------------------------------------------------

def test_equal_plans_are_grouped_and_differences_kept():
    a = HostEntry(name="sim", address="local", state_dir="/x/sim/hosts/sim/state", units_dir="/x/sim/hosts/sim/units")
    b = HostEntry(name="sim-2", address="local", state_dir="/x/sim/hosts/sim-2/state",
                  units_dir="/x/sim/hosts/sim-2/units")
    c = HostEntry(name="sim-3", address="local", state_dir="/x/sim/hosts/sim-3/state",
                  units_dir="/x/sim/hosts/sim-3/units")

    def plan(e: HostEntry, port: int) -> str:
        return (f"Plan: deploy m on {e.describe()}\n  1. lock * {e.state_dir}/deploy.lock\n"
                f"  2. preflight - ok gpus (0.12s)\n  3. start - {e.name} runs PID {port * 7} on port {port}")

    texts = [(e.name, normalised_plan(plan(e, p), e)) for e, p in ((a, 8000), (b, 8001), (c, 8000))]
    assert texts[0][1] == texts[2][1] and "(0.12s)" not in texts[0][1] and "<state_dir>/deploy.lock" in texts[0][1]
    assert "/x/<host>" not in texts[0][1]          # the name inside a path is the path's, not replaced alone
    groups = group_plans(texts)
    assert [g[0] for g in groups] == [["sim", "sim-3"], ["sim-2"]]
    assert "port 8001" in groups[1][1] and "<host> runs PID <pid>" in groups[1][1]


def test_an_interrupt_reaches_every_host_in_flight_and_starts_no_more():
    """Ctrl-C reaches only the main thread: the runner cancels the fleet's token, which each host's
    run checks in its waits (host/cancel.py), so each host's own interrupt handling (a swap's
    rollback) runs, and the hosts not started stay untouched."""
    import _thread

    from orchestrator.host import cancel

    recovered = []
    running = threading.Semaphore(0)

    def one(entry, reporter):
        running.release()
        try:
            while True:                           # a long step, waiting as the real ones do
                cancel.sleep(0.01)
        except KeyboardInterrupt:                 # what run_plan does: recovery, then an Interrupted error
            recovered.append(entry.name)
            return HostOutcome(130, "ready: interrupted during ready")

    def ctrl_c():                                 # once both hosts in flight are in their long step
        running.acquire()
        running.acquire()
        time.sleep(0.1)
        _thread.interrupt_main()

    # Ctrl-C's own meaning in the main thread for this test: a test before it in the same worker may
    # have left another SIGINT handler (a run of the CLI's main installs its own), and one that does
    # not reach the fleet's token loses the interrupt (a --quick run hung here until its 300 s guard).
    import signal
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=ctrl_c, daemon=True).start()
        rows = run_fleet(entries(4), one, parallel=2)
    finally:
        signal.signal(signal.SIGINT, before)
    assert sorted(recovered) == ["h1", "h2"]
    assert [(r.result, r.code) for r in rows] == [("interrupted", 130)] * 2 + [("not run", 0)] * 2
    assert rows[2].cause == "not started: interrupted" and worst_exit([r.code for r in rows]) == 130
