"""The facts script's answer, section by section (orchestrator/host/facts.py FactsAnswer): every
section the script writes has a typed parser, each fixture of it parses (tests/fixtures/facts), and
an answer whose section is not of its shape is refused in one line naming the field."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from orchestrator.errors import RefusedError
from orchestrator.host.facts import FactsAnswer, parse, read_answer
from orchestrator.host.ownership import SERVICE
from orchestrator.paths import package_file

FIXTURES = Path(__file__).parents[1] / "fixtures" / "facts"
FULL = json.loads((FIXTURES / "process-host.json").read_text())
STATUS = json.loads((FIXTURES / "process-host-status.json").read_text())
SECTIONS = sorted(p.stem for p in (FIXTURES / "sections").glob("*.json"))


def test_every_section_the_script_writes_has_a_parser_and_a_fixture():
    script = package_file("host", "remote", "facts_script.py").read_text()
    written = set(re.findall(r'facts\["(\w+)"\]', script)) | set(re.findall(r'^\s+"(\w+)": ', script[
        script.index("facts = {"):script.index("}", script.index("facts = {"))], re.M))
    assert written <= set(FactsAnswer.model_fields), written - set(FactsAnswer.model_fields)
    scalars = {"hostname", "boot_id", "time", "python", "psutil"}
    assert set(FactsAnswer.model_fields) - scalars == set(SECTIONS)
    assert set(FULL) | set(STATUS) <= set(FactsAnswer.model_fields)


@pytest.mark.parametrize("section", SECTIONS)
def test_each_fixture_of_a_section_parses(section):
    for example in json.loads((FIXTURES / "sections" / f"{section}.json").read_text()):
        answer = {**copy.deepcopy(FULL), section: example}
        facts = parse(answer, "sim")
        assert facts.hostname == FULL["hostname"] and not facts.bad_records, facts.bad_records


def test_the_process_hosts_answer_reads_as_it_runs():
    facts = parse(FULL, "sim")
    assert sorted(facts.records) == ["minimax-m25", "mm-b"] and sorted(facts.running()) == ["minimax-m25", "mm-b"]
    assert facts.placement("mm-b", "sim").gpus == (4, 5, 6, 7) and facts.recorded_placement("mm-b").gpus_placed
    assert {p.kind for p in facts.procs} == {SERVICE} and len(facts.procs) == 8
    # a process's start time stays the integer /proc gives: the kill command re-checks it as text
    assert all(type(p.start_time) is int for p in facts.procs), [p.start_time for p in facts.procs]
    assert {p.model for p in facts.procs if p.gpu_index is not None and p.gpu_index >= 4} == {"mm-b"}
    assert facts.memory is not None and facts.memory.total > facts.memory.available > 0
    assert facts.driver_version == "580.95.05" and facts.users["root"]["uid"] == 0
    assert sorted(facts.ports) == [18000, 18001] and facts.time == FULL["time"]
    status = read_answer(STATUS, "sim").status
    assert status is not None and status.history and status.uptime is None or status.uptime >= 0


@pytest.mark.parametrize("change, field", [
    (lambda a: a.update(hostname=None), "hostname"),
    (lambda a: a["disk"].update(total="a lot"), "disk.total"),
    (lambda a: a.pop("gpus_raw"), "gpus_raw"),
    (lambda a: a["apps_raw"].update(rc="0; rm -rf /"), "apps_raw.rc"),
    (lambda a: a.update(models=[{"bytes": 1}]), "models.0.name"),
    (lambda a: a["services"]["minimax-m25"].update(MainPID=9131), "services.minimax-m25.MainPID"),
    (lambda a: a.update(ports={"8000": ["nginx"]}), "ports.8000.0"),
    (lambda a: a.update(ports={"http": [1]}), "ports.http"),
    (lambda a: a["procs"][next(iter(a["procs"]))].update(cmdline="vllm serve"), ".cmdline"),
    (lambda a: a.update(users={"vllm": {"uid": "x"}}), "users.vllm.uid"),
    (lambda a: a.update(usage={"m": "yesterday"}), "usage.m"),
    (lambda a: a.update(memory={"total": [1]}), "memory.total"),
    (lambda a: a.update(root_trust={"programs": [{"problem": None}]}), "root_trust.programs.0.path"),
])
def test_a_section_not_of_its_shape_is_refused_in_one_line(change, field):
    answer = copy.deepcopy(FULL)
    change(answer)
    with pytest.raises(RefusedError) as err:
        parse(answer, "sim")
    assert err.value.exit_code == 3 and err.value.step == "facts" and err.value.host == "sim"
    assert field in err.value.message and "\n" not in err.value.message, err.value.message


def test_status_extras_are_read_field_by_field():
    answer = {**copy.deepcopy(STATUS), "status": {"uptime": "x", "lock": [1], "health": [], "history": "no"}}
    status = read_answer(answer, "sim").status
    assert status is not None and (status.uptime, status.lock, status.health, status.history) == (None, None, {}, [])


def test_a_bad_record_is_left_out_and_named_not_refused():
    answer = copy.deepcopy(FULL)
    answer["records"]["mm-b"] = {"model": "minimax-m25", "gpus": "4-7"}
    answer["swap"] = {"to": "x"}
    facts = parse(answer, "sim")
    assert "mm-b" not in facts.records and facts.half_swap is None
    assert [b.split(":")[0] for b in facts.bad_records] == ["services/mm-b.json", "swap.json"]
    assert facts.placement("mm-b", "sim").gpus == (4, 5, 6, 7)       # its installed record still places it
