"""The facts-in -> plan-out case matrix, as data files (in the manner of pyinfra's operation tests:
one file per case, its inputs and the expected result side by side): tests/cases/*.yaml.

Each case names an operation (deploy, swap, regen), its command line (model, --name/--gpus/--port,
options), the hosts (one, or the nodes of a multi-node service) and each host's facts in the facts
script's own terms (services and their state, records, installed records, model folders, disk,
a half-done swap). The runner turns the facts into the script's answer and parses it with the
product's typed parser (host/facts.parse), then goes through the product's own pure gathering
(ops/gather: the service value from command line + inventory + manifest + installed record, the
service a swap replaces, regen's services) and planners, with the host's file contents and live
probes answered from the case: the files installed are what the service's installed record says
it was installed with, rendered from the shipped manifests; a running service answers /health.

The expected plan text (or the refusal and its exit code) is in the case file under `expect`;
UPDATE_GOLDEN=1 writes it from what the planners return (review the diff).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.config.inventory import HostEntry
from orchestrator.config.manifest import Manifest, load_all
from orchestrator.config.placement import Request
from orchestrator.host.facts import HostFacts, parse
from orchestrator.ops import gather
from orchestrator.paths import shipped_dir
from orchestrator.plan.deploy import plan_deploy
from orchestrator.plan.inputs import DownloadPlan, LockFacts, PlanInput, RegenInput
from orchestrator.plan.model import Plan
from orchestrator.plan.preflight import OK, Check
from orchestrator.plan.regen import plan_regen
from orchestrator.plan.run import Options
from orchestrator.plan.swap import plan_swap
from orchestrator.secret import Secret

CASES = Path(__file__).parents[1] / "cases"
SHIPPED, _ = load_all(shipped_dir("models"))
GIB = 1024 ** 3
RTX = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
CHECKS = [Check("flags", OK, "vLLM 0.33.0 parser accepts the command line"),
          Check("gpus", OK, f"8x {RTX}, 97887 MiB each")]
LOCK = LockFacts(held=False, path="/var/lib/vllm-orch/state/lock/deploy.lock")


def gpu_lines() -> str:
    return "".join(f"{i}, {RTX}, 97887, 0, 0, GPU-{i}, 580.95.05, 0\n" for i in range(8))


UNIT_STATES = {
    "running": {"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "Result": "success",
                "UnitFileState": "disabled"},
    "enabled": {"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "Result": "success",
                "UnitFileState": "enabled"},
    "loading": {"LoadState": "loaded", "ActiveState": "activating", "SubState": "start-post", "Result": "success",
                "UnitFileState": "disabled"},
    "stopped": {"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead", "Result": "success",
                "UnitFileState": "disabled", "MainPID": "0"},
    "failed": {"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "Result": "exit-code",
               "UnitFileState": "disabled", "MainPID": "0"},
}


def answer(host: str, f: dict) -> dict:
    """The facts script's answer of an idle 8-GPU systemd host, with the case's facts on it."""
    services = {}
    for i, (name, state) in enumerate(sorted((f.get("services") or {}).items())):
        props = {"MainPID": str(1000 + i), "NRestarts": "0", "ExecMainStartTimestampMonotonic": "1",
                 "ControlGroup": f"/system.slice/vllm-{name}.service", **UNIT_STATES[state]}
        services[name] = props
    models = [{"name": n, "bytes": int(d.get("gib", 1) * GIB), "mtime": 1.0,
               "verified": {"repo": d.get("repo", "x/y"), "files": {}, "complete": True, "revision": "r"}
               if d.get("ours", True) else None}
              for n, d in sorted((f.get("models") or {}).items())]
    return {"hostname": host, "time": 1.0, "boot_id": "b",
            "disk": {"path": "/var/lib/vllm-orch/models", "total": 4000 * GIB,
                     "free": int(f.get("disk_free_gib", 2000) * GIB)},
            "gpus_raw": {"rc": 0, "out": gpu_lines(), "err": ""}, "apps_raw": {"rc": 0, "out": "", "err": ""},
            "banner_raw": {"rc": 0, "out": "Driver Version: 580.95.05      CUDA Version: 13.0", "err": ""},
            "vllm": {"version": "0.33.0"}, "models": models,
            "users": {"vllm": {"uid": 998, "gid": 998, "home": "/var/lib/vllm-orch/home"}},
            "services": services, "usage": {}, "ports": {}, "procs": {},
            "memory": {"total": 1536 * GIB, "available": 1100 * 10 ** 9, "path": "/proc/meminfo"},
            "records": f.get("records") or {}, "installed": f.get("installed") or {},
            "active": f.get("active"), "swap": f.get("swap")}


@dataclass
class CaseReads:
    """The host's file contents and live probes, as the case says (gather.Reads)."""

    files: dict[str, bytes]
    serving_ports: set[int]

    def get(self, path: str) -> bytes | None:
        return self.files.get(path)

    def serving(self, m: Manifest, api_key: Secret | None) -> bool:
        return m.serving.port in self.serving_ports


class Case:
    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, Any] = yaml.safe_load(path.read_text())

    def models(self, changed: bool) -> dict[str, Manifest]:
        out = dict(SHIPPED)
        for name, sections in (self.data.get("manifest_changes") or {}).items() if changed else ():
            data = out[name].model_dump()
            for section, values in sections.items():
                data[section].update(values)
            out[name] = Manifest.model_validate(data)
        return out

    def entries(self) -> list[HostEntry]:
        hosts = self.data.get("hosts") or ["gpu1"]
        inventory = self.data.get("inventory") or {}
        return [HostEntry.model_validate({"name": h, "address": f"{h}.example", "sudo": True,
                                          "cluster": {"address": f"10.0.0.{i + 1}"}, **inventory.get(h, {})})
                for i, h in enumerate(hosts)]

    def facts(self, entry: HostEntry) -> HostFacts:
        return parse(answer(entry.name, (self.data.get("facts") or {}).get(entry.name) or {}), entry.name)

    def reads(self, entry: HostEntry, facts: HostFacts) -> CaseReads:
        """What is installed on the host: each installed service's files as rendered from the shipped
        manifest where its installed record says it was installed; a running service answers. A
        record whose unit_hash is `rendered` gets the hash of those files (recorded as installed)."""
        files: dict[str, bytes] = {}
        ports = set()
        for name, rec in facts.installed.items():
            m = SHIPPED.get(rec.model or name)
            if m is None:
                continue
            spec = gather.recorded_spec(m, entry, name, facts)
            svc = gather.service_input(CaseReads({}, set()), entry, m, facts, spec)
            files.update({f.path: f.data() for f in svc.rendered.files})
            st = facts.services.get(name)
            if st is not None and st.active:
                ports.add(svc.manifest.serving.port)
            record = facts.records.get(name)
            if record is not None and record.unit_hash == "rendered":
                facts.records[name] = record.model_copy(update={"unit_hash": svc.rendered.unit_hash})
        return CaseReads(files, ports)

    def options(self) -> Options:
        return Options(**(self.data.get("options") or {}))

    def request(self) -> Request:
        r = self.data.get("request") or {}
        m = SHIPPED[self.data["model"]]
        return Request.parse(m, r.get("name"), r.get("gpus"), r.get("port"))

    def download(self) -> DownloadPlan:
        d = self.data.get("download") or {}
        total = int(d.get("total_gib", 100) * GIB)
        fetch = int(d.get("to_fetch_gib", 0) * GIB)
        return DownloadPlan(total_bytes=total, have_bytes=total - fetch, to_fetch_bytes=fetch, files=10,
                            to_fetch=tuple(f"model-{i}.safetensors" for i in range(10 if fetch else 0)),
                            commit="c" * 40)

    def plan(self) -> Plan:
        op = self.data["operation"]
        entries = self.entries()
        facts = {e.name: self.facts(e) for e in entries}
        reads = {e.name: self.reads(e, facts[e.name]) for e in entries}
        models = self.models(changed=True)
        opts = self.options()
        if op == "regen":
            e = entries[0]
            services, orphaned = gather.regen_services(facts[e.name], e, models)
            inputs = [gather.service_input(reads[e.name], e, m, facts[e.name], spec, True) for m, spec in services]
            return plan_regen(RegenInput(entry=e, facts=facts[e.name], opts=opts, lock=LOCK, services=inputs,
                                         orphaned=orphaned, restart=bool(self.data.get("restart"))))
        m = models[self.data["model"]]
        request = self.request()
        if op == "deploy":
            spec = gather.service_spec(m, entries, request, facts)
            nodes = [PlanInput(entry=e, facts=facts[e.name], opts=opts, lock=LOCK, preflight=CHECKS,
                               target=gather.service_input(reads[e.name], e, m, facts[e.name], spec),
                               download=self.download()) for e in entries]
            return plan_deploy(*nodes)
        if op == "swap":
            e = entries[0]
            f = facts[e.name]
            spec, old = gather.swap_services(f, e, m, request, models, opts)
            target = gather.service_input(reads[e.name], e, m, f, spec)
            old_input = gather.service_input(reads[e.name], e, old[0], f, old[1], True) if old is not None else None
            return plan_swap(PlanInput(entry=e, facts=f, opts=opts, lock=LOCK, preflight=CHECKS, target=target,
                                       download=self.download(), old=old_input))
        raise AssertionError(f"{self.path.name}: unknown operation {op!r}")

    def result(self) -> str:
        plan = self.plan()
        text = plan.text()
        if plan.refusal is not None:
            text += f"\n(exit {plan.refusal.exit_code})"
        return text


@pytest.mark.parametrize("path", sorted(CASES.glob("*.yaml")), ids=lambda p: p.stem)
def test_case(path: Path):
    case = Case(path)
    got = case.result()
    if os.environ.get("UPDATE_GOLDEN") == "1" or "expect" not in case.data:
        text = path.read_text()
        text = text[:text.index("\nexpect:")] + "\n" if "\nexpect:" in text else text
        path.write_text(text.rstrip("\n") + "\nexpect: |\n" + "".join(f"  {line}\n" for line in got.splitlines()))
        case = Case(path)
    assert got == case.data["expect"].rstrip("\n"), f"plan changed: review and re-run with UPDATE_GOLDEN=1 ({path})"
    for must in case.data.get("says") or []:            # what the case is about, in words
        assert must in got, (path.name, must)
