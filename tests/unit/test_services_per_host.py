"""Several services per host, without a host: GPU lists, placements from the command line over the
inventory, the planners' overlap refusal, swap --replace's choice of the old service, the
ownership rule with another service on the host, and records (legacy active.json read and upgraded
in place)."""

from __future__ import annotations

import json

import pytest

from orchestrator.config.effective import effective
from orchestrator.config.inventory import HostEntry
from orchestrator.config.placement import Origin, Placement, Recorded, Request, choose_service, parse_gpus, resolve
from orchestrator.errors import ConfigError
from orchestrator.host import state
from orchestrator.host.local import LocalHost
from orchestrator.host.ownership import LEFT, SERVICE, Proc, holders
from orchestrator.host.records import RECORDS_VERSION, HistoryEntry, ServiceRecord
from orchestrator.plan.deploy import plan_deploy
from orchestrator.plan.placements import clash_refusal, host_placements
from orchestrator.plan.service import placement_holders
from orchestrator.plan.swap import old_model_name, plan_swap
from orchestrator.render.artifacts import render
from orchestrator.render.sources import source_lines
from tests.unit.test_planners import ENTRY, MODELS, RTX, download, facts, inp, records, running

MM = "minimax-m25"              # TP4 on GPUs 0-3, port 8000


def placed_svc(name: str, gpus: list[int] | None = None, port: int | None = None, entry: HostEntry = ENTRY,
               service: str | None = None):
    """Model NAME as gather makes it for `deploy NAME [--gpus] [--port] [--name service]`."""
    from orchestrator.plan.inputs import ServiceInput

    spec = resolve(MODELS[name], [entry], Request(service, tuple(gpus) if gpus is not None else None, port))
    eff = effective(MODELS[name], entry, {i: RTX for i in range(8)}, spec=spec)
    r = render(eff.manifest, entry, {}, model=spec.model)
    return ServiceInput(manifest=eff.manifest, rendered=r, installed_files={f.path: None for f in r.files},
                        effective=eff, spec=spec)


@pytest.mark.parametrize("text, ids", [("4-7", [4, 5, 6, 7]), ("4,5,6,7", [4, 5, 6, 7]), ("0,2-3", [0, 2, 3]),
                                       (" 6 , 7 ", [6, 7]), ("3", [3])])
def test_gpu_lists_take_ranges_and_commas(text, ids):
    assert parse_gpus(text) == ids


@pytest.mark.parametrize("text, says", [("7-4", "empty range"), ("a", "not a GPU index"), ("1,1", "twice"),
                                        ("1-2,2", "twice"), ("", "not a GPU index")])
def test_bad_gpu_lists_are_one_line_errors(text, says):
    with pytest.raises(ConfigError) as err:
        parse_gpus(text)
    assert says in err.value.message and "\n" not in err.value.message and err.value.exit_code == 2


def test_the_command_line_wins_over_the_inventory_and_says_so():
    entry = HostEntry.model_validate({"name": "gpu1", "address": "gpu1.example",
                                      "overrides": {MM: {"serving": {"port": 8002, "gpu_ids": [2, 3, 4, 5]}}}})
    inv = effective(MODELS[MM], entry)
    assert inv.manifest.serving.visible_devices == [2, 3, 4, 5] and inv.manifest.serving.port == 8002
    assert "overrides" in inv.origin("serving.port")
    spec = resolve(MODELS[MM], [entry], Request(gpus=(4, 5, 6, 7), port=8001))
    assert (spec.head.gpus_from, spec.head.port_from) == (Origin.COMMAND_LINE, Origin.COMMAND_LINE)
    cli = effective(MODELS[MM], entry, spec=spec)
    assert cli.manifest.serving.visible_devices == [4, 5, 6, 7] and cli.manifest.serving.port == 8001
    assert cli.origin("serving.gpu_ids") == "command line --gpus" and cli.origin("serving.port") == "command line --port"
    lines = "\n".join(source_lines(render(cli.manifest, entry, {}), cli))
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7" in lines and "<- command line --gpus" in lines
    assert "--port 8001" in lines and "<- command line --port" in lines
    only_port = resolve(MODELS[MM], [entry], Request(port=8003))
    assert only_port.head.gpus == (2, 3, 4, 5) and only_port.head.gpus_from == Origin.INVENTORY
    only_port_m = effective(MODELS[MM], entry, spec=only_port).manifest
    assert only_port_m.serving.visible_devices == [2, 3, 4, 5]       # the inventory's GPUs stay
    assert only_port_m.serving.port == 8003


def test_a_gpu_count_other_than_the_layout_is_refused_in_one_line():
    for make in (lambda: Request.parse(MODELS[MM], None, "4-6"),
                 lambda: resolve(MODELS[MM], [ENTRY], Request(gpus=(4, 5, 6)))):
        with pytest.raises(ConfigError) as err:
            make()
        assert err.value.exit_code == 2 and "3 GPUs" in err.value.message and "runs on 4" in err.value.message
        assert "\n" not in err.value.message


def test_a_placed_service_stays_where_it_was_placed_unless_told_otherwise():
    """The precedence (config/placement.resolve): command line > --replace > where a run placed it
    (the installed record) > inventory > manifest; a value the manifest chose follows the manifest."""
    m = MODELS[MM]
    placed = Recorded((4, 5, 6, 7), 8001, gpus_placed=True, port_placed=True)
    kept = resolve(m, [ENTRY], Request("mm-b"), {"gpu1": placed})
    assert (kept.name, kept.model, kept.head.gpus, kept.head.port) == ("mm-b", MM, (4, 5, 6, 7), 8001)
    assert kept.head.gpus_from == kept.head.port_from == Origin.RECORD
    moved = resolve(m, [ENTRY], Request("mm-b", port=8002), {"gpu1": placed})
    assert (moved.head.gpus, moved.head.port, moved.head.port_from) == ((4, 5, 6, 7), 8002, Origin.COMMAND_LINE)
    followed = resolve(m, [ENTRY], Request(), {"gpu1": Recorded((0, 1, 2, 3), 8000)})
    assert followed.head.gpus_from == followed.head.port_from == Origin.MANIFEST
    took = resolve(m, [ENTRY], Request("mm-c"), {"gpu1": placed},
                   replaced={"gpu1": Placement("mm-x", MM, "gpu1", (0, 1, 2, 3), 8009)})
    assert (took.head.gpus, took.head.port, took.head.gpus_from) == ((0, 1, 2, 3), 8009, Origin.REPLACED)
    assert took.replaces == "mm-x" and "--replace mm-x" in took.origin_label("gpus", Origin.REPLACED)
    narrower = resolve(m, [ENTRY], Request(), replaced={"gpu1": Placement("x", "x", "gpu1", (6,), 8009)})
    assert narrower.head.gpus == (0, 1, 2, 3) and narrower.head.port == 8009     # only as many GPUs are taken
    with pytest.raises(ConfigError) as err:             # the manifest's layout changed under a placed service
        resolve(m, [ENTRY], Request("mm-b"), {"gpu1": Recorded((4, 5), 8001, gpus_placed=True)})
    assert err.value.exit_code == 2 and "--gpus" in (err.value.hint or "")


def test_placements_clash_on_shared_gpus_or_the_same_port_only():
    a = Placement("a", "a", "gpu1", (0, 1, 2, 3), 8000)
    assert a.clash(Placement("b", "b", "gpu1", (4, 5, 6, 7), 8001)) is None
    assert a.clash(Placement("b", "b", "gpu1", (3, 4, 5, 6), 8001)) == "GPU 3"
    assert a.clash(Placement("b", "b", "gpu1", (4, 5), 8000)) == "port 8000"
    assert a.clash(Placement("a", "a", "gpu1", (0, 1), 8000)) is None             # itself
    assert a.clash(Placement("b", "b", "gpu2", (0, 1), 8000)) is None             # another host


def two_services(second_gpus=(4, 5, 6, 7), second_port=8001, second_running=True):
    """MM recorded on GPUs 0-3 (port 8000) and tiny-llama-a recorded on `second_gpus`."""
    recs = records(**{MM: {"model": MM, "gpus": [0, 1, 2, 3], "port": 8000},
                      "tiny-llama-a": {"model": "tiny-llama-a", "gpus": list(second_gpus), "port": second_port}})
    f = facts(services=running(MM, *(["tiny-llama-a"] if second_running else [])))
    f.records = recs
    return f


def test_deploy_refuses_a_placement_that_takes_another_services_gpus_before_anything():
    f = two_services(second_gpus=(4,), second_port=8101)
    f.records.pop("tiny-llama-a")
    t = placed_svc("tiny-llama-a", gpus=[2])
    plan = plan_deploy(inp(t, f, download(1)))
    assert plan.refusal is not None and plan.refusal.exit_code == 3 and plan.refusal.step == "placement"
    assert f"{MM} already takes GPU 2 on gpu1" in plan.refusal.message
    assert [a.step for a in plan.actions] == ["lock", "placement"]
    ok = plan_deploy(inp(placed_svc("tiny-llama-a", gpus=[4]), f, download(1)))
    assert ok.refusal is None and "start" in [a.step for a in ok.actions]
    install = next(a for a in ok.actions if a.step == "install")
    assert install.details[0] == "placement: GPUs 4 <- command line --gpus"


def test_deploy_refuses_another_services_port_and_names_it():
    f = two_services(second_gpus=(4,))
    plan = plan_deploy(inp(placed_svc("tiny-llama-b", gpus=[6], port=8001), f, download(1)))
    assert plan.refusal is not None
    assert plan.refusal.message == "tiny-llama-a already takes port 8001 on gpu1: tiny-llama-b needs GPU 6 and port 8001"
    assert "--replace tiny-llama-a" in plan.refusal.hint


def test_a_running_service_without_a_record_still_takes_its_placement():
    f = facts(services=running("tiny-llama-a"), installed={"tiny-llama-a": {"gpus": [5], "port": 8101}})
    assert [p.name for p in host_placements(f, "gpu1")] == ["tiny-llama-a"]
    assert clash_refusal(f, placed_svc("tiny-llama-b", gpus=[5], port=8102), "gpu1") is not None
    stopped = facts(installed={"tiny-llama-a": {"gpus": [5], "port": 8101}})     # stopped: takes nothing
    assert clash_refusal(stopped, placed_svc("tiny-llama-b", gpus=[5]), "gpu1") is None


def test_swap_on_a_host_with_several_services_asks_for_replace():
    f = two_services()
    with pytest.raises(ConfigError) as err:
        old_model_name(f, "kimi-k25-int4", "gpu1")
    assert err.value.exit_code == 2 and f"({MM}, tiny-llama-a)" in err.value.message and "--replace" in err.value.message
    assert old_model_name(f, "tiny-llama-b", "gpu1", replace="tiny-llama-a") == "tiny-llama-a"
    with pytest.raises(ConfigError, match="runs no such service"):
        old_model_name(f, "tiny-llama-b", "gpu1", replace="nope")
    one = facts(services=running(MM), active={"model": MM, "gpus": [0, 1, 2, 3], "port": 8000})
    assert old_model_name(one, "kimi-k25-int4", "gpu1") == MM                     # one service: as today


def test_swap_with_replace_refuses_to_take_a_third_services_place_and_removes_the_old_record():
    f = two_services()
    new = placed_svc("tiny-llama-b", gpus=[4], port=8001)       # the old one's GPU and port
    old = placed_svc("tiny-llama-a", gpus=[4], port=8001)
    plan = plan_swap(inp(new, f, download(1), old=old))
    assert plan.refusal is None, plan.refusal
    assert "tiny-llama-a's record goes" in plan.actions[-1].summary
    clash = plan_swap(inp(placed_svc("tiny-llama-b", gpus=[0], port=8001), f, download(1), old=old))
    assert clash.refusal is not None and clash.refusal.step == "placement" and MM in clash.refusal.message


def test_another_services_processes_are_never_ours_to_kill():
    procs = [Proc(pid=10, name="VLLM::Worker_TP0", used_mib=9000, gpu_index=0, kind=SERVICE, model=MM, start_time=1000),
             Proc(pid=11, name="VLLM::Worker_TP1", used_mib=9000, gpu_index=1, kind=LEFT, model=MM, start_time=1100),
             Proc(pid=12, name="VLLM::Worker_TP0", used_mib=9000, gpu_index=4, kind=LEFT, model="gone", start_time=1200)]
    h = holders(procs, [], "tiny-llama-a", [0, 1, 4], protected={MM})
    assert {p.pid for p in h.others} == {10, 11} and [p.pid for p in h.kill] == [12] and not h.ours
    # Without protection a stopped-but-recorded service's leftovers would be killed: the rule protects them.
    assert [p.pid for p in holders(procs, [], "tiny-llama-a", [0, 1, 4], protected=()).kill] == [11, 12]
    # The service a swap stops is its own, protected or not.
    assert {p.pid for p in holders(procs, [], "x", [0, 1], stopping={MM}, protected={MM}).ours} == {10}
    f = two_services()
    f.procs = procs
    held = placement_holders(f, placed_svc("tiny-llama-b", gpus=[1]).manifest)
    assert [p.pid for p in held.others] == [11] and not held.kill


def test_a_legacy_active_record_reads_as_its_models_record():
    f = facts(services=running(MM), active={"model": MM, "gpus": [0, 1, 2, 3], "port": 8000})
    assert f.record(MM).port == 8000 and list(f.records) == [MM]


def test_records_are_upgraded_in_place_and_read_back(tmp_path):
    entry = HostEntry(name="local", address="localhost", state_dir=str(tmp_path / "state"))
    host = LocalHost("local")
    (tmp_path / "state").mkdir()
    legacy = {"model": MM, "gpus": [0, 1, 2, 3], "port": 8000, "enabled": True, "a_later_field": 1}
    (tmp_path / "state" / "active.json").write_text(json.dumps(legacy))
    read = state.read_records(host, entry)
    assert list(read) == [MM] and (read[MM].port, read[MM].gpus, read[MM].enabled, read[MM].version) == (
        8000, [0, 1, 2, 3], True, 0)
    assert state.read_active(host, entry) == read[MM]
    assert state.upgrade_records(host, entry) == f"moved {entry.state_dir}/active.json to services/{MM}.json"
    assert not (tmp_path / "state" / "active.json").exists()
    moved = json.loads((tmp_path / "state" / "services" / f"{MM}.json").read_text())
    assert moved == {**legacy, "version": RECORDS_VERSION, "argv": []}          # written new, nothing lost
    assert state.upgrade_records(host, entry) is None                        # once
    state.write_record(host, entry, "tiny-llama-a", ServiceRecord(model="tiny-llama-a", port=8101, deployed_at="z"))
    assert sorted(state.read_records(host, entry)) == [MM, "tiny-llama-a"]
    assert state.update_record(host, entry, MM, unit_hash="u1") and state.read_records(host, entry)[MM].unit_hash == "u1"
    assert not state.update_record(host, entry, "nope", unit_hash="u1")
    state.write_record(host, entry, MM, None)
    assert list(state.read_records(host, entry)) == ["tiny-llama-a"]
    # a stale legacy file beside a newer record: the record wins, the legacy file goes
    (tmp_path / "state" / "active.json").write_text(json.dumps({**legacy, "model": "tiny-llama-a"}))
    assert state.read_records(host, entry)["tiny-llama-a"].port == 8101
    assert "stale" in (state.upgrade_records(host, entry) or "")


def test_per_service_commands_name_the_service_only_when_a_host_has_several():
    assert choose_service([MM], None, "gpu1", "stop SERVICE --host gpu1") == MM
    assert choose_service([], None, "gpu1", "stop SERVICE --host gpu1") is None
    assert choose_service([MM, "b"], "b", "gpu1", "stop SERVICE --host gpu1") == "b"
    with pytest.raises(ConfigError) as err:
        choose_service([MM, "b"], None, "gpu1", "stop SERVICE --host gpu1")
    assert err.value.exit_code == 2 and "(b, minimax-m25)" in err.value.message
    assert "`vllm-orch stop b --host gpu1`" in err.value.message


def test_history_records_carry_the_service(tmp_path):
    entry = HostEntry(name="local", address="localhost", state_dir=str(tmp_path / "state"))
    host = LocalHost("local")
    state.append_history(host, entry, HistoryEntry(operation="deploy", model=MM))
    assert state.read_history(host, entry)[-1].service == MM



def test_a_service_under_another_name_keeps_its_models_weights_served_name_and_inventory_settings():
    entry = HostEntry.model_validate({"name": "gpu1", "address": "gpu1.example",
                                      "overrides": {MM: {"vllm": {"max_num_seqs": 7}}}})
    spec = resolve(MODELS[MM], [entry], Request("mm-b", (4, 5, 6, 7), 8001))
    eff = effective(MODELS[MM], entry, spec=spec)
    b = eff.manifest
    assert (b.name, spec.model, b.served_name, b.unit_name) == ("mm-b", MM, MODELS[MM].served_name,
                                                                 "vllm-mm-b.service")
    assert b.vllm.max_num_seqs == 7                                                    # the model's override
    assert b.serving.visible_devices == [4, 5, 6, 7]                                   # the service's placement
    r = render(b, entry, {}, model=spec.model)
    assert f"{entry.models_root}/{MM}" in r.argv and r.unit.path.endswith("vllm-mm-b.service") and r.model == MM
    assert effective(MODELS[MM], entry).manifest.serving.visible_devices == [0, 1, 2, 3]   # not the model's


def test_gather_finds_a_renamed_services_manifest_by_its_record():
    from orchestrator.ops.gather import recorded_spec, service_manifest

    f = facts(installed={"mm-b": {"model": MM, "gpus": [4, 5, 6, 7], "port": 8001,
                                  "placed": {"gpu_ids": [4, 5, 6, 7], "port": 8001}}})
    m = service_manifest("mm-b", f, MODELS)
    assert m is not None and m.name == MM
    spec = recorded_spec(m, ENTRY, "mm-b", f)
    assert (spec.name, spec.model, spec.head.gpus, spec.head.port) == ("mm-b", MM, (4, 5, 6, 7), 8001)
    assert service_manifest(MM, f, MODELS).name == MM
    assert service_manifest("nothing", f, MODELS) is None


@pytest.mark.parametrize("args, says", [
    (["render", MM, "--gpus", "4-6"], "3 GPUs, but minimax-m25 runs on 4"),
    (["render", MM, "--gpus", "4-x"], "'4-x' is not a GPU index"),
    (["render", MM, "--name", "Bad_Name"], "not a service name"),
])
def test_placement_options_fail_in_one_line_with_exit_2(args, says):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and says in r.stderr, r.stdout + r.stderr
    assert len([line for line in r.stderr.splitlines() if line.strip()]) <= 2, r.stderr    # error (+ hint)


def test_render_shows_the_command_lines_placement():
    from click.testing import CliRunner

    from orchestrator.cli.main import cli

    r = CliRunner().invoke(cli, ["render", MM, "--gpus", "4,5,6,7", "--port", "8001", "--name", "mm-b"])
    assert r.exit_code == 0, r.output
    assert "vllm-mm-b.service" in r.output and "CUDA_VISIBLE_DEVICES=4,5,6,7" in r.output
    assert "<- command line --gpus" in r.output and "<- command line --port" in r.output


def test_freeing_disk_never_deletes_a_model_another_service_uses():
    from orchestrator.host.facts import ModelDir
    from orchestrator.plan import prepare

    verified = {"repo": "r", "files": {}, "complete": True}
    models = {MM: ModelDir(MM, 300 * 10 ** 9, verified, 1.0),                 # the oldest: first to go...
              "old-x": ModelDir("old-x", 300 * 10 ** 9, verified, 2.0)}
    f = facts(models=models, disk_free=400 * 1024 ** 3)
    f.records = records(**{"mm-b": {"model": MM, "gpus": [4, 5, 6, 7], "port": 8001}})  # ...but mm-b (stopped) runs it
    action, refusal = prepare.disk_action(inp(placed_svc("kimi-k25-int4"), f, download(547 * 10 ** 9)), keep=set())
    assert refusal is None and action.confirm == "delete 1 model folder on gpu1 (old-x 300.0 GB)", action
    f.records = {}
    action, _ = prepare.disk_action(inp(placed_svc("kimi-k25-int4"), f, download(547 * 10 ** 9)), keep=set())
    assert f"{MM} 300.0 GB" in (action.confirm or "")              # with no service using it, it may go


def test_stop_and_logs_without_a_name_take_the_hosts_only_service_else_exit_2(tmp_path):
    from orchestrator.cli.ops import the_only_service

    entry = HostEntry(name="local", address="localhost", state_dir=str(tmp_path / "state"))
    host = LocalHost("local")
    (tmp_path / "state").mkdir()
    with pytest.raises(ConfigError) as err:
        the_only_service(host, entry, "stop")
    assert err.value.exit_code == 2 and "runs no recorded service" in err.value.message
    assert "`vllm-orch stop SERVICE --host local`" in err.value.message
    state.write_record(host, entry, MM, ServiceRecord(model=MM, port=8000))
    assert the_only_service(host, entry, "logs") == MM
    state.write_record(host, entry, "mm-b", ServiceRecord(model=MM, port=8001))
    with pytest.raises(ConfigError) as err:
        the_only_service(host, entry, "logs")
    assert err.value.exit_code == 2 and "(minimax-m25, mm-b)" in err.value.message
