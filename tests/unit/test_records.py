"""The records on a host as versioned models (orchestrator/host/records.py): what an earlier
vllm-orch wrote (version 0, tests/fixtures/records) is read, what is written is the current version
and reads back the same, fields a newer version added are kept, a file that is no record reads as
absent and is named, and `vllm-orch schema --records` prints every schema."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import LEGACY_PORTS
from orchestrator.config.placement import NodeRole, Origin, Recorded
from orchestrator.host import state
from orchestrator.host.facts import parse
from orchestrator.host.local import LocalHost
from orchestrator.host.records import (
    RECORDS,
    RECORDS_VERSION,
    HistoryEntry,
    InstalledRecord,
    ServiceRecord,
    SwapMarker,
    record_schemas,
)
from orchestrator.paths import package_file

FIXTURES = Path(__file__).parents[1] / "fixtures" / "records"


def fixture(name: str):
    return json.loads((FIXTURES / name).read_text())


def test_version_0_records_are_read_as_they_were_written():
    svc = ServiceRecord.read(fixture("service-v0.json"))
    assert svc is not None and svc.version == 0
    assert (svc.model, svc.service, svc.port, svc.gpus, svc.enabled) == ("minimax-m25", "mm-b", 8001, [4, 5, 6, 7], True)
    assert svc.perf == {"ok": True, "single_stream_tok_s": 80.1, "seconds": 4.2}
    placed = InstalledRecord.read(fixture("installed-v0.json"))
    assert placed is not None and (placed.gpus_from, placed.port_from) == (Origin.COMMAND_LINE, Origin.COMMAND_LINE)
    assert placed.placement() == Recorded((4, 5, 6, 7), 8001, gpus_placed=True, port_placed=True)
    node = InstalledRecord.read(fixture("installed-node-v0.json"))
    assert node is not None and node.role() == NodeRole(1, ("gpu1", "gpu2"), "10.0.0.1") and node.multinode
    # followed its manifest; its ports are what vllm-orch rendered before they were recorded
    assert node.placement() == Recorded((0, 1, 2, 3, 4, 5, 6, 7), 8000, cluster_ports=LEGACY_PORTS)
    swap = SwapMarker.read(fixture("swap-v0.json"))
    assert swap is not None and (swap.from_, swap.to, swap.from_enabled) == ("kimi-k25-int4", "kimi-k25-nvfp4", True)
    lines = state.parse_history((FIXTURES / "history-v0.jsonl").read_text().splitlines())
    assert [h.operation for h in lines] == ["deploy", "swap", "health-restart", "stop", "gc", "bench"]
    assert lines[1].from_ == "kimi-k25-int4" and lines[1].downtime_s == 530.2 and lines[1].about("kimi-k25-int4")
    assert lines[1].extra("warm") == {"warmed_bytes": 1, "reason": "complete"}
    assert lines[2].subject == "kimi-k25-nvfp4"               # the unit probe names the model, not the service
    assert lines[0].shown()["gates"] == {"health": 40.1, "models": 0.1, "smoke": 2.3}     # as written


@pytest.mark.parametrize("cls, name", [(ServiceRecord, "service-v0.json"), (InstalledRecord, "installed-v0.json"),
                                       (InstalledRecord, "installed-node-v0.json"), (SwapMarker, "swap-v0.json"),
                                       (ServiceRecord, "active-legacy.json")])
def test_read_old_write_new_and_read_back_the_same(cls, name):
    old = cls.read({**fixture(name), "from_a_later_version": {"x": 1}})
    assert old is not None
    written = old.dump()
    assert written["version"] == RECORDS_VERSION and written["from_a_later_version"] == {"x": 1}   # nothing lost
    assert "placed" not in written                           # installed: the origins instead
    again = cls.read(json.loads(json.dumps(written)))
    assert again is not None and again.dump() == written
    assert again.model_dump(exclude={"version"}) == old.model_dump(exclude={"version"})


@pytest.mark.parametrize("cls, value, says", [
    (ServiceRecord, [1, 2], "not a JSON object"),
    (ServiceRecord, {"port": 8000}, "model"),
    (ServiceRecord, {"model": "m", "gpus": "0-3"}, "gpus"),
    (InstalledRecord, {"gpus_from": "a guess"}, "gpus_from"),
    (SwapMarker, {"to": "b"}, "from"),
    (HistoryEntry, {"ok": True}, "operation"),
])
def test_a_file_that_is_no_record_reads_as_absent_and_says_why(cls, value, says):
    rec, why = cls.parse(value)
    assert rec is None and why is not None and says in why and "\n" not in why
    assert cls.read(value) is None


def test_facts_type_the_records_and_name_the_bad_ones():
    raw = json.loads((Path(__file__).parents[1] / "fixtures" / "facts" / "process-host.json").read_text())
    raw["records"]["broken"] = {"model": 7, "gpus": "all"}
    raw["installed"]["mm-b"] = fixture("installed-v0.json")
    raw["swap"] = fixture("swap-v0.json")
    facts = parse(raw)
    assert "broken" not in facts.records and any(b.startswith("services/broken.json: ") for b in facts.bad_records)
    assert facts.recorded_placement("mm-b") == Recorded((4, 5, 6, 7), 8001, gpus_placed=True, port_placed=True)
    assert facts.half_swap is not None and facts.half_swap.to == "kimi-k25-nvfp4"
    assert facts.placement("mm-b", "h") is not None and facts.placement("mm-b", "h").gpus == (4, 5, 6, 7)


def test_every_writer_writes_the_current_version(tmp_path):
    entry = HostEntry(name="local", address="localhost", state_dir=str(tmp_path / "state"))
    host = LocalHost("local")
    state.write_record(host, entry, "a", ServiceRecord(model="a", port=8000))
    state.write_installed(host, entry, "a", InstalledRecord(model="a", gpus=[0], port=8000,
                                                            gpus_from=Origin.COMMAND_LINE))
    state.write_swap(host, entry, "a", "b", True)
    state.append_history(host, entry, HistoryEntry(operation="deploy", model="a", ok=True, steps={"ready": 1.0}))
    root = tmp_path / "state"
    for path in (root / "services" / "a.json", root / "installed" / "a.json", root / "swap.json"):
        assert json.loads(path.read_text())["version"] == RECORDS_VERSION, path
    line = json.loads((root / "history.jsonl").read_text())
    assert line["version"] == RECORDS_VERSION and line["service"] == "a" and line["at"] and line["steps"] == {"ready": 1.0}
    assert state.read_installed(host, entry, "a").placement() == Recorded((0,), 8000, gpus_placed=True)


def test_the_unit_probe_writes_history_lines_of_the_current_version():
    """The host-side unit probe (stdlib only, no import of records.py) stamps its lines itself."""
    text = package_file("host", "remote", "unit_probe.py").read_text()
    assert re.search(r'"version": (\d+)', text).group(1) == str(RECORDS_VERSION)


def test_schema_records_prints_every_record_schema():
    from orchestrator.cli.main import cli

    r = CliRunner().invoke(cli, ["schema", "--records"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out == json.loads(json.dumps(record_schemas()))
    assert out["version"] == RECORDS_VERSION and sorted(out["records"]) == sorted(c.FILE for c in RECORDS)
    assert "gpus_from" in out["records"]["installed/NAME.json"]["properties"]
    assert "from" in out["records"]["swap.json"]["properties"]
    both = CliRunner().invoke(cli, ["schema", "--records", "--hosts"])
    assert getattr(both.exception, "exit_code", None) == 2       # bad input (cli.main maps it to exit 2)
